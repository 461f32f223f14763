"""Greedy generation on every rank of an expert-parallel group.

    mlx.launch -n 2 --python .venv/bin/python launch/generate.py --prompt-random 40

Each rank loads its own folder (``rank_dir`` with ``{rank}``), runs prefill and
``--max-tokens`` greedy steps, and (with ``--dump``) saves its tokens and logits so
ranks can be compared with each other and with single-process mlx-lm
(k3dist.bench.greedy.main).
"""

import sys

from k3dist.bench import greedy

if __name__ == "__main__":
    sys.exit(greedy.main())
