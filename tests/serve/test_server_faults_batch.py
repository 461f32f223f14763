"""Issue 28, under the supervisor (launch/run.py over mlx.launch on loopback), one
server start: idle, no process spins (each uses well under a CPU second in 5 s; before,
rank 1 spun in a collective and mlx.launch on its ranks' stdin); then a rank SIGKILLed
while 8 requests decode together: every open stream gets an error event naming the
lost rank within the watchdog bound, the supervisor exits non-zero (the killed rank's
128 + 9), and nothing is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from serving import BATCH_PROMPTS as PROMPTS
from serving import free_port, get_json, post_conn
from util import REPO, free_base_port

WATCHDOG_S = 15.0
IDLE_S = 5.0
# The ranks pause in their 30th decode step (60 s at most), so the kill finds all 8
# requests still generating (tests/serve/test_server_faults.py's PAUSED says why).
ENTRY = REPO / "tests/scripts/serve_paused.py"
PAUSE = ("--pause-after", "30", "--pause-s", "60")


def _session_pids(sid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.getsid(int(p)) == sid:
                    out.append(int(p))
            except OSError:
                pass
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _roles(sid: int) -> dict[str, int]:
    out = {}
    for pid in _session_pids(sid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"mlx.launch" in cmd:
            out["launcher"] = pid
        elif b"run.py" in cmd:
            out["supervisor"] = pid
    return out | {f"rank{r}": _rank_pid(sid, r) for r in range(2)}


def _rank_pid(sid: int, rank: int) -> int:
    for pid in _session_pids(sid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if ENTRY.name.encode() in cmd and f"MLX_RANK={rank}".encode() in env:
            return pid
    raise LookupError(f"rank {rank} not found")


class _Stream:
    def __init__(self, port: int, prompt: str):
        self.raw, self.ended = b"", None
        self.s = socket.create_connection(("127.0.0.1", port), timeout=120)
        data = json.dumps(
            {"prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
        ).encode()
        self.s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: k3\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data
        )
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        try:
            while more := self.s.recv(65536):
                self.raw += more
        except OSError:
            pass
        self.ended = time.monotonic()
        self.s.close()

    @property
    def chunks(self) -> int:
        return self.raw.count(b'"choices"')


def test_sigkill_of_rank_1_while_8_requests_decode(ranks, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    cmd = [
        sys.executable,
        str(REPO / "launch/run.py"),
        "--hosts",
        "127.0.0.1",
        "-n",
        "2",
        "-p",
        str(free_base_port(2)),
        "--",
        str(ENTRY),
        *PAUSE,
        "--rank-dir",
        ranks,
        "--port",
        str(port),
        "--max-context",
        "512",
        "--prefill-chunk",
        "32",
        "--max-batch",
        "8",
        "--no-warmup",
        "--watchdog-timeout-s",
        str(WATCHDOG_S),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, HOME=str(tmp_path)),
    )
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None and time.time() < deadline, (
                tmp_path / "server.log"
            ).read_text()
            try:
                if get_json(f"http://127.0.0.1:{port}/health", 2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        post_conn(port, {"prompt": "hi", "max_tokens": 2})  # through the idle gate once
        time.sleep(1.0)
        roles = _roles(proc.pid)
        c0 = {r: _cpu_s(pid) for r, pid in roles.items()}
        time.sleep(IDLE_S)
        idle = {r: round(_cpu_s(pid) - c0[r], 3) for r, pid in roles.items()}
        streams = [_Stream(port, p) for p in PROMPTS]
        deadline = time.time() + 120
        while not all(s.chunks >= 2 for s in streams):
            assert time.time() < deadline, [s.raw[-200:] for s in streams]
            time.sleep(0.05)
        t = time.monotonic()
        os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)
        for s in streams:
            s.t.join(WATCHDOG_S + 10)
        rc = proc.wait(60)
        took = time.monotonic() - t
        time.sleep(0.5)
        left = _session_pids(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    out = (tmp_path / "server.log").read_text()
    waits = [round(s.ended - t, 2) for s in streams]
    print(
        f"\nidle {IDLE_S:g} s: CPU seconds {idle}; SIGKILL rank 1 with 8 decoding: errors "
        f"after {waits} s; supervisor exit {rc} after {took:.2f} s; left running: {left}"
    )
    assert set(idle) == {"supervisor", "launcher", "rank0", "rank1"}, idle
    assert all(v < 0.25 for v in idle.values()), idle
    for s in streams:
        body = s.raw.split(b"\r\n\r\n", 1)[1]
        assert b"[DONE]" not in body and re.search(rb'"error".*rank 1 was lost', body), body[-400:]
    assert max(waits) < WATCHDOG_S + 1, waits
    assert rc == 128 + signal.SIGKILL, (rc, out[-2000:])
    assert left == [], left
