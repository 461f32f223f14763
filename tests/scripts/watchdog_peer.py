"""A rank that only keeps a watchdog (and optionally an all_sum loop) running.

Standalone:    python watchdog_peer.py --rank R --size N --port P --pid-dir D
Under mlx.launch: mlx.launch -n 2 ... watchdog_peer.py --launch --pid-dir D
Writes D/rank{R}.port (rank 0: the port it bound, so tests can pass --port 0) and,
once the watchdog has formed, D/rank{R}.pid; then loops until stopped.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from k3dist.model.group import join
from k3dist.serve import peer_link, watchdog

import mlx.core as mx


def _publish(path: Path, value: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(value))
    tmp.rename(path)  # appears whole: the test polls for it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launch", action="store_true", help="rank/size/address from mlx.launch")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--size", type=int)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int)
    ap.add_argument("--pid-dir", required=True)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--stop-with-launcher", action="store_true")
    ap.add_argument(
        "--no-kill-silent",
        action="store_true",
        help="leave a silent peer to the launcher (as if on another machine)",
    )
    args = ap.parse_args()

    group = None
    if args.launch:
        group = join()
        rank, size = group.rank(), group.size()
        host, port = peer_link.coordinator_address(group, port=args.port)
    else:
        rank, size, host, port = args.rank, args.size, args.host, args.port
    wd = watchdog.Watchdog(
        rank,
        size,
        host,
        port,
        interval_s=args.interval,
        timeout_s=args.timeout,
        connect_timeout_s=20.0,
        parent_pid=os.getppid() if args.stop_with_launcher else None,
        kill_silent_peers=not args.no_kill_silent,
        on_stop=lambda reason, origin: print(f"on_stop rank {rank}", flush=True),
    )
    watchdog.install_signal_handlers(wd)
    _publish(Path(args.pid_dir) / f"rank{rank}.port", wd.port)  # rank 0: the bound port
    wd.start()
    _publish(Path(args.pid_dir) / f"rank{rank}.pid", os.getpid())
    print(f"rank {rank} ready (watchdog {host}:{port})", flush=True)
    steps = 0
    while True:
        if group is not None:
            # Stands in for the serve loop: a collective every 10 ms, forever.
            x = mx.distributed.all_sum(mx.ones(4), group=group)
            mx.eval(x)
            steps += 1
            time.sleep(0.01)
        else:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
