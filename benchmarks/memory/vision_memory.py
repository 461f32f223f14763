"""Memory per rank with and without the vision tower (issue 15), from the layouts.

For the trained mini-K3 (k3dist/data/mini-k3) and the real K3 (its config and tensor index
in k3dist/data): bytes per rank of a 2-rank source-format slicing (BF16 non-expert,
MXFP4 experts split evenly) with the tower on rank 0 only (k3dist.pipeline.slicing.
vision_ranks), the tower's BF16 bytes from the layout cross-checked against mlx-vlm's
own module (its parameter shapes), and the real graded plan's per-rank total with the
tower added.

    .venv/bin/python benchmarks/memory/vision_memory.py [--out FILE] [--activations]

``--activations`` (issue 28): the tower's peak memory while it runs, measured
(``mx.get_peak_memory``) on this machine's device for images of growing patch counts,
with the real K3 tower's width (hidden 1024, 12 heads of 128, MLP 4096) and one and
two of its 27 blocks (random weights: memory does not depend on their values), fitted
as ``a + b*N + c*N^2`` per block stack (N patches; the N^2 term is attention's score
matrix where the backend materialises it). From the fit: the peak at the largest
image the server accepts (``max_image_pixels``, after the processor's own rescale to
at most ``in_patch_limit`` patches), and the largest image whose tower peak stays
within the deployment's memory headroom, which sets the default cap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import k3dist
from k3dist.bench import record
from k3dist.format import layout
from k3dist.format.folder import REAL_K3_CONFIG, REAL_K3_INDEX, load_config, read_index
from k3dist.format.kvmemory import GiB
from k3dist.serve import vision

import mlx.core as mx
from mlx.utils import tree_flatten

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "benchmarks/results/2026-12-01/plan-k3.json"


def module_bytes(config: dict) -> int:
    """BF16 bytes of mlx-vlm's tower + projector built from ``config`` (shapes only:
    the arrays stay lazy)."""
    tower = vision.VisionTower(config)
    return sum(
        v.size * 2
        for _, v in tree_flatten(tower.parameters())
        if v.dtype in (mx.float32, mx.bfloat16)
    )


def per_rank(config: dict, size: int = 2) -> dict:
    specs = layout.source_specs(config)
    experts = sum(s.nbytes for s in specs if s.family == "experts")
    tower = sum(s.nbytes for s in specs if s.family == "vision")
    rest = sum(s.nbytes for s in specs) - experts - tower
    without = rest + experts // size
    return {
        "tower_bf16": tower,
        "tower_mlx_vlm_module": module_bytes(config),
        "tower_float32": 2 * tower,
        "rank0_with_tower": without + tower,
        "other_ranks": without,
        "all_ranks_would_hold": size * tower,
        "tower_share_of_rank0": round(tower / (without + tower), 6),
    }


def _peak(config: dict, layers: int, side: int, dtype) -> int:
    """Peak bytes of one tower forward (``layers`` blocks) on a side x side patch grid."""
    import copy

    import numpy as np

    cfg = copy.deepcopy(config)
    cfg["vision_config"]["vt_num_hidden_layers"] = layers
    tower = vision.VisionTower(cfg)
    tower.set_dtype(dtype)
    mx.eval(tower.parameters())
    p = cfg["vision_config"]["patch_size"]
    n = side * side
    patches = mx.array(np.random.default_rng(0).standard_normal((n, 3, p, p), np.float32))
    img = vision.Pixels(patches=patches, grid=(1, side, side), tokens=n // 4)
    mx.eval(patches)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(tower([img]))
    peak = mx.get_peak_memory() - base
    del tower
    mx.clear_cache()
    return peak


def activations(real: dict, sides: list[int], headroom_gib: float) -> dict:
    """The tower's measured peak while running, fitted and extrapolated (see --help)."""
    from k3dist.config.deployment import Deployment

    import numpy as np

    dtype = mx.float32  # what this Linux box serves in (the Mac serves bfloat16: half)
    rows = []
    for side in sides:
        for layers in (1, 2):
            rows.append(
                {
                    "patches": side * side,
                    "grid": [side, side],
                    "blocks": layers,
                    "peak_bytes": _peak(real, layers, side, dtype),
                }
            )
    n = np.array([r["patches"] for r in rows if r["blocks"] == 1], float)
    one = np.array([r["peak_bytes"] for r in rows if r["blocks"] == 1], float)
    two = np.array([r["peak_bytes"] for r in rows if r["blocks"] == 2], float)
    fit = np.polyfit(n, one, 2)  # c, b, a
    per_block = float(np.median((two - one) / n))  # what a further block adds, per patch

    def peak_at(patches: float) -> float:
        return float(np.polyval(fit, patches))

    ip = vision.K3Processor(real["vision_config"]).ip
    p = ip.patch_size
    cap_default = Deployment().max_image_pixels
    largest = min(cap_default // (p * p), ip.in_patch_limit)
    budget = headroom_gib * GiB
    # the largest patch count whose peak fits the headroom (the fit is increasing)
    lo, hi = 1, ip.in_patch_limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak_at(mid) <= budget else (lo, mid - 1)
    side = int(math.isqrt(lo)) * p
    return {
        "device": str(mx.default_device()),
        "dtype": str(dtype),
        "measured": rows,
        "fit_one_block": {
            "c_bytes_per_patch2": fit[0],
            "b_bytes_per_patch": fit[1],
            "a_bytes": fit[2],
        },
        "fit_max_relative_error": float(np.max(np.abs(np.polyval(fit, n) - one) / one)),
        "more_blocks_add_bytes_per_patch": per_block,
        "attention_scores_bytes_per_patch2": 12 * 4,  # 12 heads x float32, if materialised
        "in_patch_limit": ip.in_patch_limit,
        "max_image_pixels_at_measure": cap_default,
        "largest_accepted_image_patches": largest,
        "peak_at_largest_accepted_image_bytes": peak_at(largest),
        "headroom_budget_bytes": budget,
        "largest_patches_within_headroom": lo,
        "largest_square_image_within_headroom_px": [side, side],
        "cap_within_headroom_pixels": side * side,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument(
        "--activations",
        action="store_true",
        help="measure the tower's running peak (see the module help)",
    )
    ap.add_argument(
        "--sides", default="8,16,24,32,48,64", help="patch-grid sides measured (N = side^2 patches)"
    )
    ap.add_argument(
        "--headroom-gib",
        type=float,
        default=None,
        help="budget for the tower's peak (default: memory_headroom_gib)",
    )
    args = ap.parse_args()
    mini = load_config(k3dist.MINI_K3)
    real = json.loads(REAL_K3_CONFIG.read_text())
    idx = read_index(REAL_K3_INDEX)
    names = {s.name for s in layout.vision_specs(real)}
    in_index = {n for n in idx["weight_map"] if n.startswith(layout.VISION_PREFIXES)}
    assert names == in_index, "the layout's vision tensors are not the reference index's"
    report = {
        "command": " ".join(sys.argv),
        "mini_k3": per_rank(mini),
        "kimi_k3": {**per_rank(real), "vision_tensors": len(names)},
    }
    if PLAN.exists():
        plan = json.loads(PLAN.read_text())
        total = plan["bytes_per_rank"]["total"]
        report["kimi_k3_graded_plan"] = {
            "plan": PLAN.name,
            "usable_per_rank": plan["budget_per_rank"],
            "rank_total_without_tower": total,
            "rank0_total_with_tower": total + report["kimi_k3"]["tower_bf16"],
        }
    if args.activations:
        from k3dist.config.deployment import Deployment

        report["tower_activations"] = activations(
            real,
            [int(x) for x in args.sides.split(",")],
            args.headroom_gib
            if args.headroom_gib is not None
            else Deployment().memory_headroom_gib,
        )
    record.emit(report, args.out)


if __name__ == "__main__":
    main()
