"""The long fuzz run (issue 28): generated hostile requests over the five endpoints
against the 2-rank server (mini build, vision on), then the ranks' liveness and lockstep.

    python benchmarks/faults/fuzz_requests.py [--requests 2000] [--seed 1] \
        --out benchmarks/results/DATE/fuzz.json

Builds the mini (synthesized, converted, sliced for 2 ranks) in a temporary folder,
starts the server as the tests do (tests/serving.py), runs k3dist.bench.fuzz, and writes
requests by endpoint and status, 5xx, connection errors and failures (.partial, then
renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from k3dist.bench import fuzz  # noqa: E402
from k3dist.factory import synth  # noqa: E402
from k3dist.pipeline import convert  # noqa: E402

from serving import Server, post_conn, rank_folders, wait_logs  # noqa: E402


def _block(job: tuple[int, int, int]) -> fuzz.Report:
    port, n, seed = job
    return fuzz.run(port, n, seed)


def _command() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


def _write(path: Path, out: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.rename(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=3, help="client processes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on the way out
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        src = synth.synthesize(t / "src", "mini", seed=0, progress=False)
        ranks = rank_folders(convert.convert(src, t / "build", progress=False), t / "ranks")
        srv = Server(
            ranks,
            t / "serve",
            (
                "--max-tokens",
                str(fuzz.SMALL_TOKENS),
                "--prefill-chunk",
                "256",
                "--vision",
                "--max-images",
                "2",
                "--max-image-pixels",
                str(64 * 64),
                "--max-batch",
                "2",
            ),
        )
        try:
            report = fuzz.Report()
            t0 = time.monotonic()
            blocks = [
                (srv.port, min(50, args.requests - i), args.seed + i)
                for i in range(0, args.requests, 50)
            ]
            # client processes side by side (each its own hypothesis run and seed); the
            # figures so far are written after each block of 50
            with ProcessPoolExecutor(args.workers) as ex:
                for part in ex.map(_block, blocks):
                    report.merge(part)
                    report.seconds = time.monotonic() - t0
                    s = report.summary()
                    print(
                        f"{s['requests']} requests, {s['failures']} failures, {s['seconds']:.0f} s",
                        flush=True,
                    )
                    _write(Path(args.out), {"command": _command(), "complete": False, **s})
            alive = srv.proc.poll() is None and set(srv.rank_pids()) == {0, 1}
            after = post_conn(srv.port, {"model": "kimi-k3", "prompt": "hi", "max_tokens": 2})
            logs = wait_logs(srv, 0, 1)
            lockstep = len(logs[0]) == len(logs[1]) and logs[0] == logs[1]
            differ = [
                {"entry": i, "rank0": a, "rank1": b}
                for i, (a, b) in enumerate(zip(*logs, strict=False))
                if a != b
            ][:5]
            load = os.getloadavg()
        finally:
            srv.stop()
    out = {
        "command": _command(),
        "complete": True,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "git": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "load_average_at_end": [round(x, 2) for x in load],
        **report.summary(),
        "ranks_alive_after": alive,
        "request_after_status": after[0],
        "token_log_entries": [len(x) for x in logs],
        "ranks_in_lockstep": lockstep,
        "first_differing_entries": differ,
    }
    _write(Path(args.out), out)
    print(json.dumps({k: v for k, v in out.items() if k != "first_failures"}, indent=1))


if __name__ == "__main__":
    main()
