"""Cable faults on the two-host rig (issue 39): what each does to a two-Mac deployment.

    sudo .venv/bin/python benchmarks/faults/cable_faults.py [--only NAME ...] [--out FILE]

The rig (tests/rig.py): two network namespaces with a real sshd each joined by a veth
cable; the deployment of tests/two_macs.py (rank 1's folder rsynced to mac2, key on mac1,
watchdog_timeout_s 5, a prefix cache folder) started as on two Macs: ``launch/run.py
--hostfile <rig> -- launch/serve.py --config ...`` from mac1. Per fault: when it was
made, when the supervisor exited (detection + exit), its exit code and message, what the
open client got, and a restart after the cable is back (ready, a request from mac2
answered, its prefix-cache line, a clean stop). Faults:

- ``decode``: the cable pulled while a stream decodes;
- ``prefill``: pulled 1 s into a ~3,000-token prompt's prefill (16-token chunks);
- ``warmup``: pulled during warm-up (the launch with warm-up);
- ``flap``: down 2 s then up, while a stream decodes (under the watchdog's timeout);
- ``loss1``, ``loss5``: 1 % / 5 % of mac2's packets dropped both ways (nftables
  ``numgen random mod 100 < N drop``) during 100 mixed requests (chat, Anthropic
  Messages, streamed chat; 4 at a time, each bounded at 120 s);
- ``kill``: mac2's rank SIGKILLed while a stream decodes (a peer reboot);
- ``nosshd``: mac2's sshd stopped before the launch;
- ``prefixwrite``: the cable pulled while both ranks are writing a prefix-cache entry
  (tests/scripts/serve_slow_disk.py: the entry's ``.partial`` file written, then 60 s
  before it is hashed and renamed) and a stream decodes; the entry written before it
  must come back at the restart and the half-written one be swept.

The rig cannot delay packets or limit bandwidth: this kernel has no netem.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from k3dist.bench import record  # noqa: E402

import rig as rigmod  # noqa: E402
import two_macs  # noqa: E402
from two_macs import PY, Served  # noqa: E402

WATCHDOG_TIMEOUT_S = 5.0
EXIT_BOUND_S = WATCHDOG_TIMEOUT_S + 10  # the stated bound: timeout + exit and clean-up
FAULTS = ("decode", "prefill", "warmup", "flap", "loss1", "loss5", "kill", "nosshd", "prefixwrite")
SLOW_DISK = "tests/scripts/serve_slow_disk.py"
WRITE_DELAY_S = 60.0  # the half-written entry's write: far past the fault and the exit


def client_proc(rig, host: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *rig.netns(host),
            PY,
            str(REPO / "tests/scripts/rig_client.py"),
            f"http://{rigmod.ADDRS[0]}:{two_macs.API_PORT}",
            str(rig.home(1) / ".k3dist-key"),
            *args,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=rig.env(),
    )


def wait_line(p: subprocess.Popen, want: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"client ended before {want!r}")
        if line.strip() == want:
            return
    raise RuntimeError(f"no {want!r} within {timeout_s} s")


def client_result(p: subprocess.Popen, timeout_s: float = 150.0) -> dict:
    """The client's last (JSON) line; a stream's ``CHUNKS n t`` progress lines kept. A
    client still running after ``timeout_s`` is killed and recorded as such, with the
    progress it had printed (slow, or stalled)."""
    deadline = time.monotonic() + timeout_s
    progress, last = [], None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = p.stdout.readline()
        if not line:
            p.wait(10)
            break
        if line.startswith("CHUNKS "):
            progress.append([float(x) for x in line.split()[1:]])
        elif line.startswith("{"):
            last = json.loads(line)
    if p.poll() is None:
        p.kill()
        p.wait(10)
        return {"end": f"no end within {timeout_s:g} s (client killed)", "progress": progress}
    got = last or {"end": "no output"}
    if progress:
        got["progress"] = progress
    return got


def exit_message(out: str) -> str:
    lines = [x for x in out.splitlines() if x.startswith("[k3dist run] exit code")]
    if lines:
        return lines[-1]
    lines = [x for x in out.splitlines() if x.startswith("[k3dist run]")]
    return lines[-1] if lines else ""


def restart(rig, site) -> dict:
    """The cable back: start again, a request from mac2, stop; what it took."""
    rig.cable(True)
    rig.loss(None)
    rig.start_sshd(2)
    rig.wait_ssh()
    t0 = time.monotonic()
    served = Served(rig, site, "--no-warmup")
    res: dict = {}
    try:
        res["ready_s"] = round(served.wait_ready(240), 1)
        got = two_macs.client(rig, 2, rig.home(1) / ".k3dist-key")
        res["served_from_mac2"] = got["chat"]["completion_tokens"] > 0
    finally:
        served.stop()
    out = served.output()
    res["exit_code"] = served.proc.returncode
    res["verify"] = [
        line.split("verify ", 1)[1][:80] for line in out.splitlines() if ": verify " in line
    ]
    res["prefix_cache"] = [
        {k: v for k, v in json.loads(line.split("prefix cache: ", 1)[1]).items() if k in KEEP}
        for line in out.splitlines()
        if "prefix cache: {" in line
    ]
    res["launch_files_left"] = len(two_macs.launch_files_left(out))
    res["removed_earlier_files"] = [
        line for line in out.splitlines() if "an earlier run left on" in line
    ]
    res["s"] = round(time.monotonic() - t0, 1)
    return res


KEEP = ("entries", "skipped_at_start", "swept_at_start", "writing")


def supervisor_exit(served, t0: float) -> dict:
    """How the supervisor ended after a fault at ``t0`` (monotonic): seconds, exit code
    (None: still running EXIT_BOUND_S + 30 s later), within the bound, its message, and
    mlx.launch's temp files it could not remove (behind the cable)."""
    try:
        rc = served.proc.wait(EXIT_BOUND_S + 30)
    except subprocess.TimeoutExpired:
        rc = None
    exit_s = round(time.monotonic() - t0, 1)
    return {
        "exit_s": exit_s,
        "exit_code": rc,
        "within_bound": rc is not None and exit_s <= EXIT_BOUND_S,
        "message": exit_message(served.output()),
        "launch_files_left": len(two_macs.launch_files_left(served.output())),
    }


def pull_during_stream(rig, site, what: str) -> dict:
    served = Served(rig, site, *(() if what == "warmup" else ("--no-warmup",)))
    res: dict = {}
    stream = None
    try:
        if what == "warmup":
            served.wait_for(r"\[k3dist rank 1\] loaded ", 240)
            time.sleep(1.0)
        else:
            served.wait_ready(240)
            if what == "prefill":
                stream = client_proc(rig, 1, "--stream", "8", "--prompt-words", "700")
                wait_line(stream, "SENT")
                time.sleep(1.0)
            else:  # the flap's stream must end by itself: a few hundred tokens
                stream = client_proc(rig, 1, "--stream", "200" if what == "flap" else "3000")
                wait_line(stream, "FIRST")
        t0 = time.monotonic()
        if what == "kill":
            pids = [p for p in two_macs.rig_pids(2) if b"serve.py" in _cmdline(p)]
            for p in pids:
                subprocess.run(["kill", "-KILL", str(p)], check=False)
            res["killed"] = len(pids)
        else:
            rig.cable(False)
        if what == "flap":
            time.sleep(2.0)
            rig.cable(True)
            got = client_result(stream, 300)  # 200 tokens: ~50 s at load 20
            res["client"] = got
            res["still_serving"] = served.proc.poll() is None
            if got.get("end") != "done" and res["still_serving"]:  # stalled, or slow?
                try:
                    after = two_macs.client(rig, 2, rig.home(1) / ".k3dist-key", 60)
                    res["answers_after"] = after["chat"]["completion_tokens"] > 0
                except (AssertionError, subprocess.TimeoutExpired) as e:
                    res["answers_after"] = f"{type(e).__name__}: {str(e)[-300:]}"
            served.stop()
            res["exit_code"] = served.proc.returncode
            res["message"] = "stopped with SIGTERM after the stream" if res["still_serving"] else ""
            return res
        res.update(supervisor_exit(served, t0))
        if stream is not None:
            res["client"] = client_result(stream)
    finally:
        rig.cable(True)
        served.stop()
        if stream is not None and stream.poll() is None:
            stream.kill()
    return res


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class SlowDiskServed(Served):
    """The same supervised launch with tests/scripts/serve_slow_disk.py as the script:
    prefix-cache writes stall (after the ``.partial`` file) while ``flag`` exists."""

    def __init__(self, rig, site, flag: Path) -> None:
        self.rig, self.site = rig, site
        self.log_path = site.work / f"run-{time.monotonic_ns()}.log"
        self.t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    *rig.netns(1),
                    PY,
                    "launch/run.py",
                    "--hostfile",
                    str(rig.hostfile),
                    "-p",
                    str(two_macs.RING_PORT),
                    "--",
                    SLOW_DISK,
                    f"--write-delay-s={WRITE_DELAY_S}",
                    "--after-write",
                    f"--slow-while={flag}",
                    "--config",
                    str(site.deploy),
                    "--no-warmup",
                ],
                cwd=REPO,
                env=rig.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


def prefix_files(site, pattern: str) -> list[list[str]]:
    """Per rank, the prefix-cache files matching ``pattern`` (shared filesystem)."""
    root = site.work / "prefixes"
    return [sorted(p.name for p in root.glob(f"*/rank{r}-of-2/{pattern}")) for r in (0, 1)]


def wait_files(site, pattern: str, more_than: list[list[str]], timeout_s: float) -> list:
    """Until every rank has a ``pattern`` file it did not have in ``more_than``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = prefix_files(site, pattern)
        new = [sorted(set(n) - set(o)) for n, o in zip(now, more_than, strict=True)]
        if all(new):
            return new
        time.sleep(0.2)
    raise RuntimeError(f"no new {pattern} on every rank within {timeout_s} s: {now}")


def prefix_write(rig, site) -> dict:
    """A prefix-cache write in flight on both ranks when the cable goes."""
    flag = site.work / "slow-disk"
    flag.unlink(missing_ok=True)
    served = SlowDiskServed(rig, site, flag)
    res: dict = {}
    stream = None
    try:
        served.wait_ready(240)
        sides = prefix_files(site, "*.json")
        # entry A at disk speed: whole (data renamed, sidecar last) on both ranks
        first = client_proc(rig, 1, "--stream", "8", "--prompt-words", "120")
        res["first_client"] = client_result(first)
        res["written_before"] = wait_files(site, "*.json", sides, 60)
        flag.touch()  # from now on every write stalls after its .partial file
        parts = prefix_files(site, "*.partial*")
        second = client_proc(rig, 1, "--stream", "8", "--prompt-words", "240")
        res["second_client"] = client_result(second)
        res["writing_at_fault"] = wait_files(site, "*.partial*", parts, 60)
        stream = client_proc(rig, 1, "--stream", "3000")
        wait_line(stream, "FIRST")
        t0 = time.monotonic()
        rig.cable(False)
        res.update(supervisor_exit(served, t0))
        res["client"] = client_result(stream)
        res["partials_after_exit"] = prefix_files(site, "*.partial*")
    finally:
        rig.cable(True)
        served.stop()
        flag.unlink(missing_ok=True)
        if stream is not None and stream.poll() is None:
            stream.kill()
    return res


def loss(rig, site, percent: int, n: int) -> dict:
    served = Served(rig, site, "--no-warmup")
    res: dict = {"loss_percent": percent}
    try:
        served.wait_ready(240)
        rig.loss(percent)
        c = client_proc(rig, 1, "--mixed", str(n), "--concurrency", "4", "--timeout-s", "120")
        res["client"] = client_result(c, timeout_s=n * 130)
        rig.loss(None)
        res["still_serving"] = served.proc.poll() is None
        res["message"] = exit_message(served.output())
    finally:
        rig.loss(None)
        served.stop()
    res["exit_code"] = served.proc.returncode
    return res


def nosshd(rig, site) -> dict:
    rig.stop_sshd(2)
    t0 = time.monotonic()
    served = Served(rig, site, "--no-warmup")
    try:
        rc = served.proc.wait(60)
    finally:
        served.stop()
        rig.start_sshd(2)
    return {
        "exit_s": round(time.monotonic() - t0, 1),
        "exit_code": rc,
        "message": exit_message(served.output())[:400],
    }


def run_fault(rig, site, name: str, n: int) -> dict:
    before = prefix_files(site, "*.json")  # entries whole on disk before the fault
    if name in ("decode", "prefill", "warmup", "flap", "kill"):
        res = pull_during_stream(rig, site, name)
    elif name.startswith("loss"):
        res = loss(rig, site, int(name[4:]), n)
    elif name == "prefixwrite":
        res = prefix_write(rig, site)
    else:
        res = nosshd(rig, site)
    res["restart"] = r = restart(rig, site)
    now = prefix_files(site, "*.json")
    r["entries_before"] = [len(b) for b in before]
    r["entries_before_kept"] = [len(set(b) & set(a)) for b, a in zip(before, now, strict=True)]
    r["partials_left"] = [len(p) for p in prefix_files(site, "*.partial*")]
    if name == "prefixwrite":  # the entry written whole just before the fault
        r["written_before_kept"] = [
            sorted(set(w) & set(a)) for w, a in zip(res["written_before"], now, strict=True)
        ]
    return res


MADE = {
    "decode": "cable pulled while a stream decodes",
    "prefill": "cable pulled 1 s into a ~3,000-token prefill",
    "warmup": "cable pulled during warm-up",
    "flap": "cable down 2 s, then up, while a stream decodes",
    "loss1": "1 % loss on mac2, 100 mixed requests",
    "loss5": "5 % loss on mac2, 100 mixed requests",
    "kill": "mac2's rank SIGKILLed while a stream decodes",
    "nosshd": "mac2's sshd stopped before the launch",
    "prefixwrite": "cable pulled while both ranks write a prefix-cache entry and a stream decodes",
}


def _client(res: dict) -> str:
    c = res.get("client")
    if not c:
        return "(no client open)"
    if "outcomes" in c:
        return (
            f"{c['answered']}/{c['requests']} answered: "
            + ", ".join(f"{k} {v}" for k, v in c["outcomes"].items())
            + f" (p50 {c['p50_s']} s, max {c['max_s']} s)"
        )
    err = c.get("error")
    msg = err.get("message", "") if isinstance(err, dict) else (err or "")
    return f"{c['end']}" + (f": {msg}" if msg else "") + f" ({c.get('chunks', 0)} chunks)"


def table(result: dict) -> str:
    """The Markdown table docs/two-hosts.md shows (tests check it matches the JSON)."""
    rows = [
        "| fault | exit after | exit code | the supervisor says | the open client got | "
        "restart (cable back) |",
        "|---|---|---|---|---|---|",
    ]
    for name in FAULTS:
        res = result["faults"].get(name)
        if res is None:
            continue
        if "failed" in res:
            rows.append(f"| {MADE[name]} | run failed: {res['failed'][:120]} | | | | |")
            continue
        bound = result.get("exit_bound_s")
        after = f"{res['exit_s']} s (bound {bound:g} s)" if "exit_s" in res else "kept serving"
        msg = res.get("message", "").replace("[k3dist run] ", "").replace("|", "/")
        msg = msg.split(" (every report")[0].split("; rank 1's own exit")[0]
        msg = msg if len(msg) <= 200 else msg[:197] + "..."
        made = MADE[name] + (
            f" (kept from {Path(res['kept_from']).name})" if "kept_from" in res else ""
        )
        rows.append(
            f"| {made} | {after} | {res.get('exit_code')} | {msg} | {_client(res)} | "
            f"{_restart(res.get('restart', {}))} |"
        )
    return "\n".join(rows) + "\n"


def _restart(r: dict) -> str:
    out = (
        f"ready {r.get('ready_s')} s, served from mac2: {r.get('served_from_mac2')}, "
        f"stop exit {r.get('exit_code')}"
    )
    verified = [v.split(":")[0] for v in r.get("verify", [])]
    if verified:
        out += f", rank folders verified {verified}"
    caches = r.get("prefix_cache") or []
    if caches:
        out += f", prefix entries {[p['entries'] for p in caches]}"
        out += f" (skipped {[p['skipped_at_start'] for p in caches]}"
        if any("swept_at_start" in p for p in caches):
            out += f", half-written swept {[p.get('swept_at_start') for p in caches]}"
        out += ")"
    if "entries_before_kept" in r:
        out += f", entries from before kept {r['entries_before_kept']} of {r['entries_before']}"
    if "written_before_kept" in r:
        kept = [len(k) for k in r["written_before_kept"]]
        out += f" (the one written just before the fault: {kept})"
    if "partials_left" in r:
        out += f", .partial files left {r['partials_left']}"
    if r.get("removed_earlier_files"):
        out += ", the temp files left behind the cable removed"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=FAULTS, default=list(FAULTS))
    ap.add_argument("--requests", type=int, default=100, help="the loss runs' requests")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--keep-from",
        help="an earlier results file: its rows for faults neither run now nor in --out are "
        "kept, marked kept_from (with --only and no fault: merge only)",
    )
    ap.add_argument("--table", help="print the Markdown table of this results file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())), end="")
        return 0
    from k3dist.pipeline import default

    build = default.ensure_default_build()
    out = Path(
        args.out or REPO / "benchmarks/results" / time.strftime("%Y-%m-%d") / "cable-faults.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "command": record.command_line(),
        "environment": record.environment(),
        "watchdog_timeout_s": WATCHDOG_TIMEOUT_S,
        "exit_bound_s": EXIT_BOUND_S,
        "faults": {},
    }
    if out.exists() and set(args.only) != set(FAULTS):  # --only: the other rows are kept
        kept = json.loads(out.read_text())
        result["faults"] = kept.get("faults", {})
        result["commands"] = [*kept.get("commands", [kept.get("command")]), result["command"]]
        was = kept.get("environments", [kept.get("environment")])
        result["environments"] = [*was, result["environment"]]
    if args.keep_from:  # rows neither run now nor in OUT: from an earlier file, marked
        for name, row in json.loads(Path(args.keep_from).read_text())["faults"].items():
            if name not in result["faults"] and name not in args.only:
                result["faults"][name] = dict(row, kept_from=args.keep_from)
    if args.only == []:  # nothing to run: the merged file only
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    rig = rigmod.Rig.up()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    try:
        site = two_macs.make_site(
            rig,
            build,
            rig.root / "work",
            prefill_chunk=16,
            prefix_cache_dir=str(rig.root / "work" / "prefixes"),
            prefix_cache_min_tokens=64,
        )
        for name in args.only:
            t0, load = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
            try:
                res = run_fault(rig, site, name, args.requests)
            except Exception as e:  # noqa: BLE001 - recorded, the next fault still runs
                res = {"failed": f"{type(e).__name__}: {e}"[-2000:]}
            res["wall_s"] = round(time.monotonic() - t0, 1)
            res["loadavg_before"] = load
            res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            result["faults"][name] = res
            print(name, json.dumps(res), flush=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        rig.down()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
