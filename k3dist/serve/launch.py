"""Run a script on every rank through mlx.launch, supervised (k3dist.serve.supervise):
the command line of ``launch/run.py``.

    .venv/bin/python launch/run.py --hostfile hostfiles/local.json -- launch/serve.py
    .venv/bin/python launch/run.py --hostfile hostfiles/tb5.json -- launch/serve.py \\
        --config deploy/tb5.yaml

Before any rank starts, every host reached over ssh must answer within
--host-timeout-s (+5 s); with a hostfile naming other machines, k3dist-doctor's fast
checks (k3dist.serve.doctor: versions, repo path, rank folders, the API key, ports,
ring addresses) must pass too when the script has a --config (--no-doctor skips them).
Exit code: 0 when every rank ended cleanly (a stop asked with SIGTERM/SIGINT/SIGHUP
included), else the first failing rank's own code (128 + N for a rank killed by signal
N; 3 naming the lost rank's host when only survivors reported), or 2 when nothing was
started (an unreachable host, a failed doctor check, bad arguments). A launcher that
does not end within --grace-s of the first failure is ended with everything it started.
The ranks run with this interpreter (--python)
unless told otherwise; mlx.launch options this script does not name (-p, --env,
--backend, ...) go to it unchanged; the script and its arguments follow ``--``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3dist.serve import supervise
from k3dist.serve.hosts import LOCAL_HOST, HostUnreachable, preflight_hosts, read_hosts


def doctor_fast(hostfile: str, python: str, passthrough: list[str], command: list[str]):
    """k3dist-doctor's fast subset (ssh, versions, repo path, rank folders by size, the
    API key, ports free, ring addresses reached) for the script's own ``--config``;
    the failed checks (fatal ones)."""
    from k3dist.serve import doctor

    def value(args: list[str], *names: str) -> str | None:
        for i, a in enumerate(args):
            for n in names:
                if a == n and i + 1 < len(args):
                    return args[i + 1]
                if a.startswith(n + "="):
                    return a.split("=", 1)[1]
        return None

    port = value(passthrough, "-p", "--starting-port")
    plan = doctor.plan_from(
        hostfile,
        value(command[1:], "--config"),
        python,
        str(Path.cwd()),
        int(port) if port else doctor.RING_PORT,
        fast=True,
    )
    return [c for c in doctor.run_checks(plan) if not c.ok and c.fatal]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s [options] [mlx.launch options] -- SCRIPT [ARGS ...]",
    )
    ap.add_argument("--hostfile", help="mlx.launch hostfile (hostfiles/*.json)")
    ap.add_argument("--hosts", default=LOCAL_HOST, help="comma-separated hosts")
    ap.add_argument("-n", "--repeat-hosts", type=int, default=1, help="ranks per host")
    ap.add_argument("--python", default=sys.executable, help="the ranks' interpreter")
    ap.add_argument(
        "--launcher",
        default=str(Path(sys.executable).with_name("mlx.launch")),
        help="mlx.launch to run (default: the one beside this interpreter)",
    )
    ap.add_argument(
        "--host-timeout-s", type=float, default=5.0, help="ssh connect timeout of the host check"
    )
    ap.add_argument(
        "--grace-s",
        type=float,
        default=5.0,
        help="how long mlx.launch may take to end after the first failure",
    )
    ap.add_argument(
        "--kill-grace-s",
        type=float,
        default=5.0,
        help="between SIGTERM and SIGKILL when ranks must be ended",
    )
    ap.add_argument(
        "--no-doctor",
        action="store_true",
        help="skip k3dist-doctor's fast checks of a hostfile with other machines",
    )
    if "--" not in argv:
        ap.parse_known_args(argv)  # --help
        ap.error("put the script and its arguments after --, e.g. -- launch/serve.py")
    split = argv.index("--")
    args, passthrough = ap.parse_known_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        ap.error("no script after --")

    try:
        hosts = read_hosts(args.hostfile, args.hosts, args.repeat_hosts)
        preflight_hosts(hosts, args.host_timeout_s, args.python, source=args.hostfile or "--hosts")
    except (HostUnreachable, ValueError) as e:
        print(f"[k3dist run] {e}", file=sys.stderr, flush=True)
        return supervise.START_FAILED_EXIT_CODE
    remote = args.hostfile and not all(h.local for h in hosts)
    has_config = any(a == "--config" or a.startswith("--config=") for a in command)
    if remote and has_config and not args.no_doctor:
        failed = doctor_fast(args.hostfile, args.python, passthrough, command)
        if failed:
            print(
                f"[k3dist run] k3dist-doctor --fast: {len(failed)} check(s) failed; no rank "
                "was started:\n" + "\n".join(c.line() for c in failed),
                file=sys.stderr,
                flush=True,
            )
            return supervise.START_FAILED_EXIT_CODE
    where = (
        ["--hostfile", args.hostfile]
        if args.hostfile
        else ["--hosts", args.hosts, "-n", str(args.repeat_hosts)]
    )
    launch = [args.launcher, *where, "--python", args.python, *passthrough, "--", *command]
    return supervise.run(launch, hosts, grace_s=args.grace_s, kill_grace_s=args.kill_grace_s)


if __name__ == "__main__":
    sys.exit(main())
