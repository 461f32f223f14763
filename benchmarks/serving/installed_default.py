"""README's serve command from a NON-editable install (``pip install .`` into a fresh
venv): the embedded default comes from the installed package's data, not the checkout.

    .venv/bin/python benchmarks/serving/installed_default.py --venv /tmp/k3dist-wheel-venv \\
        --out benchmarks/results/DATE/installed-default.json

Steps, each timed: a fresh venv (``python3 -m venv``, removed first) and ``pip install -q .``
of this checkout; where that venv's ``k3dist`` and its shipped mini-K3 lie (they must be
under the venv's site-packages); README's serve command run as printed from the
checkout, with that venv's interpreter in ``.venv/bin/python``'s place (``scripts/setup &&``
is the install line, replaced by the two above; ``-p``, ``--port`` and ``--watchdog-port``
added only when given, so that runs beside others do not meet on the defaults);
``/health`` until 200; one chat completion; SIGTERM to the supervisor, its exit code and
the processes left. The rank folders of the embedded default are made on first use under
the checkout's ``runs/``: a cache there from an editable run would be reused
(``default_cached_before`` says).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3dist.bench import record

REPO = Path(__file__).resolve().parents[2]
README_MARK = "scripts/setup && .venv/bin/python launch/run.py"


def readme_command() -> str:
    """README's serve command, as printed."""
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith(README_MARK):
            return line.strip()
    raise SystemExit(f"README.md: no line starting {README_MARK!r}")


def timed(cmd: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise SystemExit(f"{cmd}: exit {res.returncode}\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return round(time.monotonic() - t0, 1), res


def install(venv: Path) -> dict:
    """A fresh venv with this checkout installed into it, not editable."""
    shutil.rmtree(venv, ignore_errors=True)
    venv_s, _ = timed(["python3", "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "pip"), "install", "-q", "."]
    pip_s, _ = timed(pip, cwd=REPO)
    # run as the ranks run launch/serve.py: a script file from the checkout, so sys.path
    # starts at the script's folder (``python -c`` would put the checkout itself first)
    probe = venv / "probe_k3dist.py"
    probe.write_text(
        "import json, k3dist\nprint(json.dumps([k3dist.__file__, str(k3dist.MINI_K3)]))\n"
    )
    _, res = timed([str(venv / "bin" / "python"), str(probe)], cwd=REPO)
    k3dist_file, mini = json.loads(res.stdout)
    _, show = timed([str(venv / "bin" / "pip"), "show", "-f", "k3dist"], cwd=REPO)
    site = str(venv / "lib")
    return {
        "venv_command": f"python3 -m venv {venv}",
        "install_command": " ".join(pip),
        "venv_s": venv_s,
        "pip_install_s": pip_s,
        "k3dist_file": k3dist_file,
        "mini_k3": mini,
        "from_site_packages": k3dist_file.startswith(site) and mini.startswith(site),
        "editable": "__editable__" in show.stdout or "Editable project location" in show.stdout,
        "mini_k3_files": sorted(p.name for p in Path(mini).iterdir()),
    }


def get(url: str, timeout: float = 2.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def chat(url: str) -> dict:
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            status, out = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        status, out = e.code, json.loads(e.read() or b"{}")
    choice = (out.get("choices") or [{}])[0]
    return {
        "request": body,
        "status": status,
        "seconds": round(time.monotonic() - t0, 2),
        "model": out.get("model"),
        "message": choice.get("message"),
        "finish_reason": choice.get("finish_reason"),
        "usage": out.get("usage"),
    }


def ranks_serving(port: int) -> dict[int, str]:
    """pid -> interpreter (argv[0]) of every process running launch/serve.py on ``port``
    (the ranks: mlx.launch may start them outside the supervisor's session)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1].endswith(b"launch/serve.py") and str(port).encode() in argv:
            out[int(pid)] = argv[0].decode()
    return out


def session_left(sid: int) -> list[int]:
    """Processes still in the server's session."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                left.append(int(pid))
        except OSError:
            pass
    return left


def serve(venv: Path, args: argparse.Namespace, log_path: Path) -> dict:
    """README's serve command with the venv's interpreter; /health, one chat, stop."""
    printed = readme_command().split("&&", 1)[1].split()
    cmd = [str(venv / "bin" / "python") if w == ".venv/bin/python" else w for w in printed]
    split = cmd.index("--")
    if args.ring_port:
        cmd[split:split] = ["-p", str(args.ring_port)]
    if args.port:
        cmd += ["--port", str(args.port)]
    if args.watchdog_port:
        cmd += ["--watchdog-port", str(args.watchdog_port)]
    url = f"http://127.0.0.1:{args.port or 8080}"
    res: dict = {"command": " ".join(cmd), "url": url}
    print("+", res["command"], file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while True:
                if proc.poll() is not None:
                    res["exited_early"] = proc.returncode
                    break
                if time.monotonic() - t0 > args.ready_timeout_s:
                    res["health"] = f"no 200 within {args.ready_timeout_s} s"
                    break
                try:
                    if get(url + "/health") == 200:
                        res["health"] = 200
                        res["health_s"] = round(time.monotonic() - t0, 1)
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            if res.get("health") == 200:
                res["rank_interpreters"] = sorted(ranks_serving(args.port or 8080).values())
                res["chat"] = chat(url)
        finally:
            t_stop = time.monotonic()
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            res["stop_s"] = round(time.monotonic() - t_stop, 1)
            res["exit_code"] = proc.returncode
            time.sleep(1.0)
            res["processes_left"] = len(session_left(proc.pid))
            res["ranks_left"] = len(ranks_serving(args.port or 8080))
    text = log_path.read_text(errors="replace")
    res["embedded_default_prepared"] = "embedded default: preparing" in text
    res["log_tail"] = text.splitlines()[-15:]
    res["checkout_paths_in_log"] = sorted(
        set(re.findall(re.escape(f"{REPO}/k3dist") + r"\S*", text))
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=Path("/tmp/k3dist-wheel-venv"))
    ap.add_argument("--port", type=int, help="the API port (README's: 8080, the default)")
    ap.add_argument("--ring-port", type=int, help="mlx.launch -p (its default if not given)")
    ap.add_argument(
        "--watchdog-port", type=int, help="serve's --watchdog-port (default: ring port + 1000)"
    )
    ap.add_argument("--ready-timeout-s", type=float, default=900)
    ap.add_argument("--log", type=Path, default=Path("/tmp/k3dist-installed-default.log"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    before = os.getloadavg()
    cached = (REPO / "runs" / "mini-build").exists()
    rep: dict = {
        **record.environment(),
        "readme_command": readme_command(),
        "default_cached_before": cached,
    }
    rep["install"] = install(a.venv)
    rep["serve"] = serve(a.venv, a, a.log)
    chat_ok = rep["serve"].get("chat", {}).get("status") == 200
    ranks = rep["serve"].get("rank_interpreters", [])
    from_venv = len(ranks) == 2 and all(r.startswith(str(a.venv)) for r in ranks)
    rep["served"] = bool(rep["install"]["from_site_packages"] and from_venv and chat_ok)
    rep["loadavg_before"] = [round(x, 2) for x in before]
    rep["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rep, indent=1) + "\n")
    print(json.dumps({k: rep[k] for k in ("served", "install", "serve")}, indent=1))
    sys.exit(0 if rep["served"] else 1)


if __name__ == "__main__":
    main()
