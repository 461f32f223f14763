"""The 2-rank server as an operator starts it (launch/run.py: the supervisor over
mlx.launch on loopback), for the serving benchmarks (idle_cpu, soak, faults): free
ports, the process tree by role, per-process CPU seconds and RSS from /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(REPO / "tests"))  # the port helpers the tests use

from k3dist.pipeline.rss import rss as rss_bytes  # noqa: E402,F401  (soak reads it here)

from serving import free_port  # noqa: E402
from util import free_base_port  # noqa: E402


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, from /proc/PID/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _children(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (mlx.launch starts ranks from threads)."""
    kids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for t in tasks:
        try:
            kids += Path(f"/proc/{pid}/task/{t}/children").read_text().split()
        except OSError:
            pass
    return [int(k) for k in kids]


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"MLX_RANK="):
            return int(kv.split(b"=")[1])
    return None


class Served:
    """``launch/run.py --hosts 127.0.0.1 -n 2 -- launch/serve.py ARGS`` in its own
    session (``entry``: another script in launch/serve.py's place, taking its flags);
    ``processes()`` names the supervisor, mlx.launch and each rank."""

    def __init__(
        self,
        tmp: Path,
        args: list[str],
        *,
        supervised: bool = True,
        ready_timeout_s: float = 600,
        entry: Path = REPO / "launch/serve.py",
    ):
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        py = sys.executable
        serve = [str(entry), "--port", str(self.port), *args]
        ring = ["-p", str(free_base_port(2))]
        if supervised:
            cmd = [
                py,
                str(REPO / "launch/run.py"),
                "--hosts",
                "127.0.0.1",
                "-n",
                "2",
                *ring,
                "--",
                *serve,
            ]
        else:
            cmd = [str(Path(py).with_name("mlx.launch")), "-n", "2", *ring, "--python", py, *serve]
        self.cmd = cmd
        self.log_path = tmp / "server.log"
        self.log = open(self.log_path, "w")
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.ready_s = self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t_start
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def processes(self) -> dict[str, int]:
        """role -> pid: supervisor, launcher (mlx.launch), rank0, rank1."""
        out: dict[str, int] = {}
        top = self.proc.pid
        todo = [top]
        while todo:
            pid = todo.pop()
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            rank = _rank_of(pid)
            if rank is not None and b"serve.py" in cmd:
                out[f"rank{rank}"] = pid
            elif b"mlx.launch" in cmd:
                out["launcher"] = pid
            elif pid == top:
                out["supervisor"] = pid
            todo += _children(pid)
        return out

    def post(self, path: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def alive_pids(self) -> list[int]:
        """Every process still in the server's session (none after a clean end)."""
        pids = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    if os.getsid(int(p)) == self.proc.pid:
                        pids.append(int(p))
                except OSError:
                    pass
        return pids

    def stop(self, timeout_s: float = 60) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        for pid in self.alive_pids():  # nothing of ours may outlive the run
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()
        return self.proc.returncode


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    return {
        f"p{p}": round(s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))], 4) for p in ps
    } | {"n": len(s), "max": round(s[-1], 4)}
