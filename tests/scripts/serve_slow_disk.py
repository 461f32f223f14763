"""launch/serve.py on a slow disk (tests only): every prefix-store write on this rank
takes ``--write-delay-s`` seconds longer (a sleep before mlx-lm's ``save_prompt_cache``
writes the entry; with ``--after-write``, after it has written the entry's ``.partial``
file and before the store hashes and renames it, so a half-finished entry is on disk),
so a stop or a fault reliably arrives while a write is in flight. ``--slow-while PATH``:
only while PATH exists (the writes before it are at disk speed). Everything else is the
real server: the real model, the real store, the real watchdog and SIGTERM path. Every
other argument is launch/serve.py's.

    mlx.launch -n 2 tests/scripts/serve_slow_disk.py --write-delay-s 4 \\
        --rank-dir 'runs/mini-ranks/rank{rank}' --prefix-cache-dir /tmp/p --no-warmup
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import k3dist  # noqa: F401  (OpenBLAS preload before mlx)
from k3dist.serve import prefix_store

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--write-delay-s", type=float, required=True)
    ap.add_argument("--after-write", action="store_true")
    ap.add_argument("--slow-while", type=Path, default=None)
    mine, rest = ap.parse_known_args()
    sys.argv[1:] = rest  # launch/serve.py parses the rest
    write = prefix_store.save_prompt_cache

    def slow_write(*args, **kwargs) -> None:
        slow = mine.slow_while is None or mine.slow_while.exists()
        if slow and not mine.after_write:
            time.sleep(mine.write_delay_s)
        write(*args, **kwargs)
        if slow and mine.after_write:
            time.sleep(mine.write_delay_s)

    prefix_store.save_prompt_cache = slow_write
    sys.argv[0] = str(REPO / "launch/serve.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
