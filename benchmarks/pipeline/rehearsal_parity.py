"""Greedy parity of a 2-rank run against one process, checked through the logits.

Greedy tokens alone are a weak check on an untrained build with near-flat logits (the
k3counts preset at 93 layers): a rounding difference flips a near-tie. So the single
process is teacher-forced on the 2-rank run's own tokens, and the report gives, per step,
both top-1s, the largest log-probability difference and the 2-rank top-1 margin. When
every step's top-1 agrees, the single process's greedy run makes the same tokens.

    mlx.launch -n 2 --python .venv/bin/python launch/generate.py \\
        --rank-dir 'PIPE/rank{rank}' --attention split --prompt-random 16 --max-tokens 6 \\
        --dump 'DIR/ep{rank}.npz'
    python benchmarks/pipeline/rehearsal_parity.py --build PIPE/work/dwq --dump DIR/ep0.npz
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import k3dist  # noqa: F401  (the BLAS preload the ranks have: same kernels, same sums)
from k3dist.model import two_bank

import mlx.core as mx
import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def compare(build: Path, dump: Path) -> dict:
    d = np.load(dump)
    prompt, tokens = d["prompt"].tolist(), d["tokens"].tolist()
    model = two_bank.load_build(build)[0]  # float32, every expert local
    out = model(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1 :]
    ref = log_softmax(np.array(out.astype(mx.float32)))
    ep = log_softmax(d["logits"])
    n = min(len(ref), len(ep), len(tokens))
    diff = np.abs(ref[:n] - ep[:n])
    top2 = np.sort(ep[:n], axis=-1)[:, -2:]
    ref_top1 = ref[:n].argmax(-1).tolist()
    return {
        "build": str(build),
        "dump": str(dump),
        "prompt_tokens": len(prompt),
        "steps": n,
        "ep_tokens": tokens[:n],
        "single_top1_on_ep_prefix": ref_top1,
        "greedy_equal": ref_top1 == tokens[:n],
        "max_abs_logprob_diff": float(diff.max()),
        "mean_abs_logprob_diff": float(diff.mean()),
        "ep_top1_margin_min": float((top2[:, 1] - top2[:, 0]).min()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, required=True, help="the unsliced (graded) build")
    ap.add_argument("--dump", type=Path, required=True, help="launch/generate.py --dump of rank 0")
    a = ap.parse_args()
    print(json.dumps(compare(a.build, a.dump)))


if __name__ == "__main__":
    main()
