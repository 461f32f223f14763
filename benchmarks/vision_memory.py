"""Memory per rank with and without the vision tower (issue 15), from the layouts.

For the trained mini-K3 (data/mini-k3) and the real K3 (its config and tensor index
in k3dist/data): bytes per rank of a 2-rank source-format slicing (BF16 non-expert,
MXFP4 experts split evenly) with the tower on rank 0 only (k3dist.build.slicing.
vision_ranks), the tower's BF16 bytes from the layout cross-checked against mlx-vlm's
own module (its parameter shapes), and the real graded plan's per-rank total with the
tower added.

    .venv/bin/python benchmarks/vision_memory.py [--out FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from importlib import resources
from pathlib import Path

import k3dist
from k3dist.bench import kit as bench
from k3dist.format import layout
from k3dist.serve import vision

import mlx.core as mx
from mlx.utils import tree_flatten

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "benchmarks/results/plan-k3-2026-12-01.json"


def module_bytes(config: dict) -> int:
    """BF16 bytes of mlx-vlm's tower + projector built from ``config`` (shapes only:
    the arrays stay lazy)."""
    tower = vision.VisionTower(config)
    return sum(v.size * 2 for _, v in tree_flatten(tower.parameters())
               if v.dtype in (mx.float32, mx.bfloat16))


def per_rank(config: dict, size: int = 2) -> dict:
    specs = layout.source_specs(config)
    experts = sum(s.nbytes for s in specs if s.family == "experts")
    tower = sum(s.nbytes for s in specs if s.family == "vision")
    rest = sum(s.nbytes for s in specs) - experts - tower
    without = rest + experts // size
    return {"tower_bf16": tower, "tower_mlx_vlm_module": module_bytes(config),
            "tower_float32": 2 * tower, "rank0_with_tower": without + tower,
            "other_ranks": without, "all_ranks_would_hold": size * tower,
            "tower_share_of_rank0": round(tower / (without + tower), 6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    mini = json.loads((k3dist.DATA_DIR / "mini-k3" / "config.json").read_text())
    real = json.loads(resources.files("k3dist").joinpath("data/kimi-k3-config.json").read_text())
    idx = json.loads(gzip.decompress(resources.files("k3dist").joinpath(
        "data/kimi-k3-model.safetensors.index.json.gz").read_bytes()))
    names = {s.name for s in layout.vision_specs(real)}
    in_index = {n for n in idx["weight_map"] if n.startswith(vision.VISION_PREFIXES)}
    assert names == in_index, "the layout's vision tensors are not the reference index's"
    report = {"command": " ".join(sys.argv), "mini_k3": per_rank(mini),
              "kimi_k3": {**per_rank(real), "vision_tensors": len(names)}}
    if PLAN.exists():
        plan = json.loads(PLAN.read_text())
        total = plan["bytes_per_rank"]["total"]
        report["kimi_k3_graded_plan"] = {
            "plan": PLAN.name, "usable_per_rank": plan["budget_per_rank"],
            "rank_total_without_tower": total,
            "rank0_total_with_tower": total + report["kimi_k3"]["tower_bf16"]}
    bench.emit(report, args.out)


if __name__ == "__main__":
    main()
