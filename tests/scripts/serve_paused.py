"""launch/serve.py whose decoding pauses mid-request (tests only): every rank sleeps
``--pause-s`` seconds in its ``--pause-after``-th decode step, so a signal sent while the
client reads the stream reliably arrives while the request is still generating (without
it, the server can finish all of a short request's tokens before the client has read its
third chunk, and the stop then rightly ends nothing). With ``--prefill-pause-s``, every
rank sleeps that long in each prefill chunk instead: a short prompt's prefill outlasts a
client's idle time-out without minutes of CPU. Everything else is the real
server: the real model, lockstep, watchdog and signal paths. Every other argument is
launch/serve.py's.

    mlx.launch -n 2 tests/scripts/serve_paused.py --pause-after 20 --pause-s 60 \\
        --rank-dir 'runs/mini-ranks/rank{rank}' --no-warmup
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import k3dist  # noqa: F401  (OpenBLAS preload before mlx)
from k3dist.serve import loader

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--pause-after", type=int, default=0, help="decode steps before (0: none)")
    ap.add_argument("--pause-s", type=float, default=0.0)
    ap.add_argument("--prefill-pause-s", type=float, default=0.0, help="in each prefill chunk")
    mine, rest = ap.parse_known_args()
    sys.argv[1:] = rest  # launch/serve.py parses the rest
    make = loader.make_model_class

    def paused_class(*args, **kwargs):
        base = make(*args, **kwargs)

        class Paused(base):
            decode_steps = 0

            def __call__(self, inputs, cache=None, input_embeddings=None):
                if inputs.shape[1] == 1:  # a decode step (prefill: the prompt's chunks)
                    Paused.decode_steps += 1
                    if Paused.decode_steps == mine.pause_after:
                        time.sleep(mine.pause_s)
                else:
                    time.sleep(mine.prefill_pause_s)
                return super().__call__(inputs, cache, input_embeddings)

        return Paused

    loader.make_model_class = paused_class
    sys.argv[0] = str(REPO / "launch/serve.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
