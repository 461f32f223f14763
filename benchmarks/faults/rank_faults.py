"""Faults mid-batch (issue 28): a rank SIGKILLed or SIGSTOPped while 8 requests decode
together, or during a long prefill; what every open request gets and when, the
supervisor's exit code, what is left running; and the time to serve again.

    .venv/bin/python benchmarks/faults/rank_faults.py [--only NAME ...] [--out FILE]

Each scenario starts the server as an operator does (launch/run.py over mlx.launch on
loopback, the embedded trained mini-K3, ``--max-batch 8``, watchdog timeout
``--watchdog-timeout-s``), opens its requests (streamed chat completions; the prefill
scenarios add a non-streamed one), waits until they are decoding (every stream has
sent a token) or prefilling (keepalives), delivers the signal to one rank and times,
for every open request, the moment it ended and how (an SSE error event, a 5xx, a
closed connection without an answer). After the supervisor exits, the same server is
started again and timed to its first answered request: verify, load, warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
from k3dist.bench import record  # noqa: E402

from _served import Served, percentiles  # noqa: E402
from serving import BATCH_PROMPTS as PROMPTS  # noqa: E402


class Open:
    """One streamed request on a raw socket, read by its own thread: when it ended
    and how."""

    def __init__(self, port: int, body: dict, path: str = "/v1/chat/completions"):
        self.ended_at: float | None = None
        self.how = None
        self.tokens = 0
        self.keepalive = 0
        self.raw = b""
        self.stream = bool(body.get("stream"))
        self.s = socket.create_connection(("127.0.0.1", port), timeout=600)
        data = json.dumps(body).encode()
        self.s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: k3\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        try:
            while True:
                more = self.s.recv(65536)
                if not more:
                    break
                self.raw += more
                self.tokens = self.raw.count(b'"delta"')
                self.keepalive = len(re.findall(rb": keepalive [1-9]", self.raw))
        except OSError as e:
            self.how = f"socket error {type(e).__name__}"
        self.ended_at = time.monotonic()
        status = re.match(rb"HTTP/1\.[01] (\d+)", self.raw)
        if self.how is None:
            if status and status[1] != b"200":
                self.how = f"status {int(status[1])}"
            elif b'"error"' in self.raw.split(b"\r\n\r\n", 1)[-1]:
                self.how = "error event"
            elif b"[DONE]" in self.raw or (not self.stream and status):
                self.how = "finished"
            else:
                self.how = "closed without an answer"
        self.s.close()

    def message(self) -> str:
        m = re.search(rb'"message": ?"([^"]{0,160})', self.raw)
        return m[1].decode(errors="replace") if m else ""


def scenario(
    name: str, sig: int, victim: int, phase: str, args: list[str], timeout_s: float
) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"faults-{name}-"))
    srv = Served(tmp, args)
    try:
        pids = srv.processes()
        opens: list[Open] = []
        if phase == "decode":
            for p in PROMPTS:
                opens.append(
                    Open(
                        srv.port,
                        {
                            "messages": [{"role": "user", "content": p}],
                            "max_tokens": 2000,
                            "temperature": 0,
                            "stream": True,
                        },
                    )
                )
            ready = lambda: all(o.tokens >= 2 for o in opens)  # noqa: E731
        else:  # a long prefill (streamed: its keepalives show it), 7 more queued
            long = "def f(x):\n    return x * 2\n" * 300
            opens.append(
                Open(
                    srv.port,
                    {
                        "messages": [{"role": "user", "content": long}],
                        "max_tokens": 8,
                        "temperature": 0,
                        "stream": True,
                    },
                )
            )
            ready = lambda: opens[0].keepalive >= 2  # noqa: E731
        deadline = time.monotonic() + 300
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: requests never got going\n{srv.output()[-2000:]}")
            time.sleep(0.05)
        if phase == "prefill":
            for p in PROMPTS[1:]:  # waiting behind the prefill (one is not streamed)
                opens.append(
                    Open(
                        srv.port,
                        {
                            "messages": [{"role": "user", "content": p}],
                            "max_tokens": 8,
                            "temperature": 0,
                            "stream": p != PROMPTS[1],
                        },
                    )
                )
            time.sleep(0.5)
        t_sig = time.monotonic()
        os.kill(pids[f"rank{victim}"], sig)
        for o in opens:
            o.t.join(timeout_s + 30)
        rc = srv.proc.wait(timeout_s + 60)
        t_exit = time.monotonic() - t_sig
        left = srv.alive_pids()
        time.sleep(1.0)
        left_after_1s = srv.alive_pids()
    finally:
        srv.stop()
    return {
        "fault": f"{signal.Signals(sig).name} rank {victim} during "
        + (
            "decode of 8 requests (batch 8)"
            if phase == "decode"
            else "a long prefill (7 requests waiting)"
        ),
        "open_requests": len(opens),
        "tokens_before_fault": [o.tokens for o in opens],
        "how_each_ended": [o.how for o in opens],
        "messages": sorted({o.message() for o in opens}),
        "time_to_error_s": [round(o.ended_at - t_sig, 3) if o.ended_at else None for o in opens],
        "time_to_error_max_s": max((o.ended_at - t_sig for o in opens if o.ended_at), default=None),
        "every_request_got_an_error": all(
            o.how in ("error event",) or (o.how or "").startswith("status 5") for o in opens
        ),
        "supervisor_exit_code": rc,
        "supervisor_exited_after_s": round(t_exit, 3),
        "processes_left_at_exit": len(left),
        "processes_left_1s_later": len(left_after_1s),
        "server_log_tail": srv.output().splitlines()[-12:],
    }


def restart(args: list[str], n: int) -> dict:
    """Start the server n times (verify, load, warm-up): seconds to a first answer."""
    times, phases = [], []
    for _ in range(n):
        tmp = Path(tempfile.mkdtemp(prefix="faults-restart-"))
        t0 = time.monotonic()
        srv = Served(tmp, args)
        try:
            status, _ = srv.post(
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            )
            assert status == 200
            times.append(round(time.monotonic() - t0, 2))
            out = srv.output()
            ph = {
                "load_s": [float(x) for x in re.findall(r"\) in ([\d.]+)s", out)],
                "warmup_s": [float(x) for x in re.findall(r'"seconds": ([\d.]+)', out)],
            }
            phases.append(ph)
        finally:
            srv.stop()
    return {
        "seconds_to_first_answer": times,
        "percentiles": percentiles(times),
        "phases_per_start": phases,
    }


SCENARIOS = {
    "sigkill-rank1-decode": (signal.SIGKILL, 1, "decode"),
    "sigstop-rank1-decode": (signal.SIGSTOP, 1, "decode"),
    "sigkill-rank0-decode": (signal.SIGKILL, 0, "decode"),
    "sigstop-rank0-decode": (signal.SIGSTOP, 0, "decode"),
    "sigkill-rank1-prefill": (signal.SIGKILL, 1, "prefill"),
    "sigstop-rank1-prefill": (signal.SIGSTOP, 1, "prefill"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS))
    ap.add_argument("--watchdog-timeout-s", type=float, default=10.0)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    args = [
        "--max-batch",
        "8",
        "--max-context",
        "4096",
        "--prefill-chunk",
        "32",
        "--watchdog-timeout-s",
        str(a.watchdog_timeout_s),
    ]
    rows = {}
    for name in a.only or SCENARIOS:
        sig, victim, phase = SCENARIOS[name]
        rows[name] = scenario(name, sig, victim, phase, args, a.watchdog_timeout_s)
        print(
            json.dumps({name: {k: v for k, v in rows[name].items() if k != "server_log_tail"}}),
            flush=True,
        )
    report = {
        **record.environment(),
        "server_args": args,
        "watchdog_bound_s": a.watchdog_timeout_s + 1.0,
        "scenarios": rows,
        "restart": restart(["--max-batch", "8", "--max-context", "4096"], a.restarts)
        if a.restarts
        else None,
    }
    record.emit(report, a.out, indent=1)


if __name__ == "__main__":
    main()
