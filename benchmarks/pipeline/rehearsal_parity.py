"""Greedy parity of a 2-rank run against one process, checked through the logits.

Greedy tokens alone are a weak check on an untrained build with near-flat logits (the
k3counts preset at 93 layers): a rounding difference flips a near-tie. So the single
process is teacher-forced on the 2-rank run's own tokens, and the report gives, per step,
both top-1s, the largest log-probability difference and the 2-rank top-1 margin. When
every step's top-1 agrees, the single process's greedy run makes the same tokens.

``--sensitivity`` also measures how far the single process itself moves when its input
moves by a rounding: the embedding's scales times (1 + eps) for each eps, the largest
log-probability change at the prompt's last position and whether its top-1 holds. A
difference between the expert-parallel run and one process no larger than what a 1e-7
change does alone is rounding amplified by the build, not a wrong computation.

    mlx.launch -n 2 --python .venv/bin/python launch/generate.py \\
        --rank-dir 'PIPE/rank{rank}' --attention split --prompt-random 16 --max-tokens 6 \\
        --dump 'DIR/ep{rank}.npz'
    python benchmarks/pipeline/rehearsal_parity.py --build PIPE/work/dwq --dump DIR/ep0.npz \
        [--sensitivity] [--out benchmarks/results/DATE/NAME.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import k3dist  # noqa: F401  (the BLAS preload the ranks have: same kernels, same sums)
from k3dist.bench import record
from k3dist.format.folder import load_config
from k3dist.format.graded import GradedMap
from k3dist.model import two_bank

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


EPS = (1e-7, 1e-6, 1e-5)


def sensitivity(model, prompt: list[int]) -> list[dict]:
    """The single process's last-position log-probabilities with the embedding's scales
    (or weight) times 1 + eps, against unchanged: the build's own amplification."""
    emb = model.language_model.model.embed_tokens
    key = "scales" if "scales" in emb.parameters() else "weight"
    saved = dict(emb.parameters())

    def last() -> np.ndarray:
        out = model(mx.array([prompt]))[0, -1]
        return log_softmax(np.array(out.astype(mx.float32)))

    base, rows = last(), []
    for eps in EPS:
        emb.update({key: saved[key] * (1 + eps)})
        moved = last()
        emb.update(saved)
        rows.append(
            {
                "eps": eps,
                "max_abs_logprob_change": float(np.abs(moved - base).max()),
                "top1_held": int(moved.argmax()) == int(base.argmax()),
            }
        )
    return rows


def load_single(build: Path):
    """The whole build in one process, float32: graded (two banks) or uniform (mlx-lm)."""
    if GradedMap.from_config(load_config(build)) is not None:
        return two_bank.load_build(build)[0]  # float32, every expert local
    model = load_model(build)[0]
    model.set_dtype(mx.float32)
    return model


def compare(build: Path, dump: Path, with_sensitivity: bool = False) -> dict:
    d = np.load(dump)
    prompt, tokens = d["prompt"].tolist(), d["tokens"].tolist()
    model = load_single(build)
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
        "sensitivity": sensitivity(model, prompt) if with_sensitivity else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, required=True, help="the unsliced (graded) build")
    ap.add_argument("--dump", type=Path, required=True, help="launch/generate.py --dump of rank 0")
    ap.add_argument("--sensitivity", action="store_true", help="see the module doc")
    ap.add_argument("--dump-command", help="the command that made --dump, for the record")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    report = {**record.environment(), **compare(a.build, a.dump, a.sensitivity)}
    report["build"], report["dump"] = record.repo_path(a.build), record.repo_path(a.dump)
    report["dump_command"] = a.dump_command
    record.emit(report, a.out)


if __name__ == "__main__":
    main()
