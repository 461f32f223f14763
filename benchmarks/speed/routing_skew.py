"""Expert-parallel load imbalance from real routing: the trained mini-K3 on held-out text.

    python benchmarks/speed/routing_skew.py [--ranks 2 4] [--batch 1 8] [--windows 8]
        [--out benchmarks/results/DATE/routing.json]

Each MoE layer ends in an ``all_sum``, so a decode step waits for the rank that reads
the most experts. For each rank count, placement (contiguous; load-aware from the
calibration split's routing counts) and batch size, this routes held-out windows
through the trained mini-K3 (single process, mlx-lm's ``kimi_k3``), draws decode steps
of B tokens from different windows, and reports the expected experts read and pairs
computed on the busiest rank, next to the same under uniform routing with the same
experts, top-k and placement. ``skew`` = measured / uniform is what
``benchmarks/speed/project.py --routing-skew`` carries over to the real K3 (whose own uniform
expectation it already computes exactly).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import k3dist
from k3dist.bench import baselines, record, routing
from k3dist.factory import windows as win
from k3dist.format import placement
from k3dist.pipeline.default import ensure_default_build

import numpy as np


def selections(model, tokens: np.ndarray) -> dict[int, np.ndarray]:
    """Per MoE layer: ``[windows, seq, k]`` expert ids the router picks."""
    per: dict[int, list[np.ndarray]] = {}
    for row in tokens:
        for i, s in routing.router_selections(model, row.tolist()).items():
            per.setdefault(i, []).append(s)
    return {i: np.stack(v) for i, v in per.items()}


def step_load(owners: np.ndarray, sel: np.ndarray, size: int) -> tuple[float, float, float]:
    """``sel``: [steps, B, k]. Mean over steps of the busiest rank's experts read (the
    union of the step's B tokens) and pairs computed, and of the experts read in all."""
    steps, E = sel.shape[0], len(owners)
    touched = np.zeros((steps, E), dtype=bool)
    np.put_along_axis(touched, sel.reshape(steps, -1), True, axis=-1)
    read = np.stack([touched[:, owners == r].sum(-1) for r in range(size)], -1)
    pairs = np.stack([(owners[sel] == r).sum((-1, -2)) for r in range(size)], -1)
    return (float(read.max(-1).mean()), float(pairs.max(-1).mean()), float(touched.sum(-1).mean()))


def draw_steps(sel: np.ndarray, batch: int, steps: int, rng) -> np.ndarray:
    """Decode steps of ``batch`` requests: each row a token of a different window."""
    W, T, _ = sel.shape
    if batch > W:
        raise SystemExit(f"--batch {batch} needs at least as many held-out windows ({W})")
    out = []
    for _ in range(steps):
        w = rng.choice(W, size=batch, replace=False)
        out.append(sel[w, rng.integers(0, T, size=batch)])
    return np.stack(out)


def uniform_steps(E: int, k: int, batch: int, steps: int, rng) -> np.ndarray:
    keys = rng.random((steps, batch, E))
    return np.argpartition(keys, k - 1, axis=-1)[..., :k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", help="MLX build (default: the trained mini-K3, runs/mini-build)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per domain")
    ap.add_argument(
        "--calib-windows",
        type=int,
        default=8,
        help="calibration windows per domain (load-aware placement's counts)",
    )
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4096, help="sampled decode steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    build = Path(a.build) if a.build else ensure_default_build()
    model, _ = baselines.load_single(build)
    tc = model.args.text_config
    E, k = tc.num_experts, tc.num_experts_per_token
    held, _, _ = win.token_set("eval", a.seq, a.windows)
    calib, _, _ = win.token_set("calib", a.seq, a.calib_windows)
    sel = selections(model, held)
    counts = {
        i: np.bincount(s.reshape(-1), minlength=E) for i, s in selections(model, calib).items()
    }
    moe = sorted(sel)
    rng = np.random.default_rng(a.seed)
    res: dict = {
        "command": record.command_line(),
        "k3dist": k3dist.__version__,
        "build": record.repo_path(build),
        "experts": E,
        "top_k": k,
        "moe_layers": len(moe),
        "held_out_tokens": int(held.size),
        "calibration_tokens": int(calib.size),
        "results": {},
    }
    for size in a.ranks:
        plcs = {
            "contiguous": placement.contiguous(E, size, moe),
            "load-aware": placement.load_aware(counts, size),
        }
        for kind, plc in plcs.items():
            for B in a.batch:
                m = [
                    step_load(np.asarray(plc.owners[i]), draw_steps(sel[i], B, a.steps, rng), size)
                    for i in moe
                ]
                u = [
                    step_load(np.asarray(plc.owners[i]), uniform_steps(E, k, B, a.steps, rng), size)
                    for i in moe
                ]
                mean = np.mean(m, 0)
                uni = np.mean(u, 0)
                res["results"][f"{size}/{kind}/{B}"] = {
                    "ranks": size,
                    "placement": kind,
                    "batch": B,
                    "busiest_rank_experts_read": round(float(mean[0]), 4),
                    "busiest_rank_pairs": round(float(mean[1]), 4),
                    "experts_read_all_ranks": round(float(mean[2]), 4),
                    "uniform_busiest_rank_experts_read": round(float(uni[0]), 4),
                    "uniform_busiest_rank_pairs": round(float(uni[1]), 4),
                    "uniform_experts_read_all_ranks": round(float(uni[2]), 4),
                    "ideal": round(B * k / size, 4),
                    "skew": round(float(mean[0] / uni[0]), 4),
                    "skew_pairs": round(float(mean[1] / uni[1]), 4),
                    "skew_union": round(float(mean[2] / uni[2]), 4),
                }
    text = json.dumps(res, indent=1)
    print(text)
    for key, r in res["results"].items():
        print(
            f"{key:22} busiest {r['busiest_rank_experts_read']:7.3f} uniform "
            f"{r['uniform_busiest_rank_experts_read']:7.3f} skew {r['skew']:.3f}",
            file=sys.stderr,
        )
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
