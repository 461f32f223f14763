"""Idle is idle (issue 28): CPU seconds per idle minute of every process of a 2-rank
server (supervisor, mlx.launch, each rank), and how soon a request starts after idling.

    .venv/bin/python benchmarks/serving/idle_cpu.py [--seconds 60] [--requests 10] [--out FILE]

Starts the server as an operator does (launch/run.py over mlx.launch on loopback, the
embedded mini-K3 unless --rank-dir), sends one request, then samples utime + stime
(/proc/PID/stat) of each process over ``--seconds`` with no traffic. Then sends
``--requests`` one-token completions, each after ``--gap-s`` of idling, and reports
their latency (request sent -> answer read) percentiles.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
from k3dist.bench import record  # noqa: E402

from _served import Served, cpu_seconds, percentiles  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="idle window sampled")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--gap-s", type=float, default=2.0, help="idle time before each request")
    ap.add_argument("--rank-dir", help="rank folders ({rank}); default: the embedded mini")
    ap.add_argument(
        "--unsupervised", action="store_true", help="mlx.launch directly (no launch/run.py)"
    )
    ap.add_argument("--label", default="", help="a name for this run in the report")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    extra = ["--rank-dir", a.rank_dir] if a.rank_dir else []
    tmp = Path(tempfile.mkdtemp(prefix="idle-cpu-"))
    srv = Served(tmp, extra, supervised=not a.unsupervised)
    try:
        status, _ = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 200, status
        time.sleep(2.0)  # let the request's tail settle
        procs = srv.processes()
        t0 = time.monotonic()
        c0 = {role: cpu_seconds(pid) for role, pid in procs.items()}
        load0 = os.getloadavg()
        time.sleep(a.seconds)
        dt = time.monotonic() - t0
        c1 = {role: cpu_seconds(pid) for role, pid in procs.items()}
        per_min = {
            role: round((c1[role] - c0[role]) * 60.0 / dt, 3)
            for role in procs
            if c0[role] is not None and c1[role] is not None
        }
        lat = []
        for _ in range(a.requests):
            time.sleep(a.gap_s)
            t = time.perf_counter()
            status, body = srv.post(
                "/v1/completions", {"prompt": "def f(x):", "max_tokens": 1, "temperature": 0}
            )
            lat.append(time.perf_counter() - t)
            assert status == 200, (status, body)
    finally:
        rc = srv.stop()
    report = {
        **record.environment(),
        "label": a.label,
        "server_command": srv.cmd,
        "idle_window_s": round(dt, 2),
        "loadavg_during_idle_window": [round(x, 2) for x in load0],
        "cpu_s_per_idle_minute": per_min,
        "cpu_s_per_idle_minute_total": round(sum(per_min.values()), 3),
        "request_after_idle_latency_s": percentiles(lat),
        "idle_gap_before_each_request_s": a.gap_s,
        "server_exit_code_after_sigterm": rc,
    }
    record.emit(report, a.out, indent=1)


if __name__ == "__main__":
    main()
