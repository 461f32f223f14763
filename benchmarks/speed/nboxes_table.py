"""The buyer's table (issue 42): for each set of Macs, whether Kimi K3 fits unpruned, the
planner's expert bpw and promoted share (``k3dist.pipeline.byte_budget.make_plan`` with
``boxes``, experts split by memory), the expected KL from the measured quality grid
(through the planner's loader, so new grid rows count), the bytes each box holds and
reads per token, and the calibrated speed model's projections (``k3dist.bench.speedfit``,
the fitted terms, stock overheads, JACCL, EP with attention split; collectives and their
wire time counted at the set's rank count; decode routed over the plan's uneven
placement, the busiest box on the critical path).

    python benchmarks/speed/nboxes_table.py --out benchmarks/results/2026-12-06/nboxes-table.json

Projections, not measurements. Prefill takes the rank count's even split (a chunk
touches nearly every expert; a box holding more of them reads more: not modelled).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from k3dist.bench import costmodel as cm
from k3dist.bench import speedfit as sf
from k3dist.config.box import Box, parse_boxes
from k3dist.factory.synth import real_config
from k3dist.format.folder import REAL_K3_INDEX, read_index
from k3dist.format.placement import from_counts
from k3dist.pipeline import byte_budget
from k3dist.pipeline.accounting import account

# name -> (GiB of each box, how routed experts are split: k3dist.pipeline.expert_split)
SETS = {
    "2x256": ("256,256", "memory"),
    "2x512": ("512,512", "memory"),
    "512+256": ("512,256", "memory"),
    "3x256": ("256,256,256", "memory"),
    "4x256": ("256,256,256,256", "memory"),
    "512+256+256": ("512,256,256", "memory"),
    "512+256+256, equal split": ("512,256,256", "equal"),
    "3x512": ("512,512,512", "memory"),
    "4x512": ("512,512,512,512", "memory"),
}
CONTEXT, PROMPT, BACKEND, OVERHEAD = 2048, 8192, "jaccl", "pn-tp"
FORM = "phased"  # the MoE form deploy/tb5.yaml's moe_form auto runs on Metal


def plan_row(acc, spec: str, split: str = "memory") -> tuple[dict, dict | None]:
    limits = byte_budget.Limits.of(byte_budget.shipped())
    req = byte_budget.PlanRequest(boxes=parse_boxes(spec), expert_split=split)
    try:
        plan = byte_budget.make_plan(acc, Box(), limits, req)
    except ValueError as e:
        return {"fits": False, "why": str(e)}, None
    e = plan["quality"]["expected"]
    how = "extrapolated" if "extrapolated" in e else "measured" if e["measured"] else "interpolated"
    bpw = {r.id: r.expert_bpw for r in byte_budget.QualityGrid.load().rows}
    return {
        "fits": True,
        "lo": plan["lo"]["format"],
        "expert_bpw": plan["expert_bpw"],
        "promoted_share": plan["promoted_fraction"],
        "kl_mean": e["kl"],
        "kl_p95": e["kl_p95"],
        "kl_from": how,
        "grid_rows": e["grid_rows"],
        # the expert bpw of the measured rows it comes from (two: interpolated between)
        "grid_rows_bpw": [bpw[i] for i in e["grid_rows"]],
        "bytes_per_box": [b["total"] for b in plan["per_box"]],
        "expert_bytes_per_box": [b["routed_experts"] for b in plan["per_box"]],
        "read_per_token_per_box": [b["read_per_token"] for b in plan["per_box"]],
        "read_ratio": plan["read_ratio"],
    }, plan


def speed(config: dict, plan: dict, th: dict) -> dict:
    f = cm.facts(config, cm.plan_profile(plan, "nboxes"))
    n = plan["ranks"]
    counts = plan.get("experts_per_layer_per_rank")
    pl = (
        None
        if counts is None
        else from_counts(f.num_experts, {int(k): v for k, v in counts.items()})
    )
    t = sf.with_terms(th, OVERHEAD)
    d = {
        b: sf.project_decode(f, "ep-split", BACKEND, CONTEXT, b, t, FORM, size=n, pl=pl)
        for b in (1, 8)
    }
    chunk = byte_budget.shipped().prefill_chunk
    p = sf.project_prefill(f, "ep-split", BACKEND, PROMPT, chunk, t, FORM, size=n, pl=pl)
    return {
        "decode_b1_tok_s": d[1]["tok_s"],
        "decode_b8_tok_s": d[8]["tok_s"],
        "prefill_tok_s": p["prefill_tok_s"],
        "collectives_per_token": d[1]["n_collectives"],
        "decode_b1_terms_ms": d[1]["terms_ms"],
    }


HEADER = (
    "| Macs (GiB) | fits | expert bpw | promoted | KL mean / p95 (grid) | decode b1 / b8 "
    "tok/s | prefill tok/s | GB held per box | GB read per token per box |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def refusal(why: str) -> str:
    """The table's words for a refused set, with the numbers where the planner gave them."""
    m = re.search(r"leave (\d+) for routed experts.*?needs (\d+) on the fullest rank", why)
    if m:
        left, need = (int(x) / 1e9 for x in m.groups())
        return f"no: the 1-bit experts need {need:.0f} GB on a box, {left:.0f} GB left"
    return "no: below the grid's lowest measured quality"


def markdown_row(row: dict) -> str:
    """One row of docs/n-boxes.md's table (tests/test_docs.py renders it from the JSON)."""
    name = row["set"]
    if not row["fits"]:
        return f"| {name} | {refusal(row['why'])} | | | | | | | |"
    kl = f"{row['kl_mean']:.4f} / {row['kl_p95']:.4f} ({row['kl_from']})"
    if row["kl_from"] == "interpolated":
        a, b = row["grid_rows_bpw"]
        kl = f"{row['kl_mean']:.4f} / {row['kl_p95']:.4f} (between {a:.2f} and {b:.2f})"
    if row["kl_from"] == "extrapolated":
        kl = f"at most {row['kl_mean']:.4f} / {row['kl_p95']:.4f} (past the grid)"
    held = ", ".join(f"{x / 1e9:.0f}" for x in row["bytes_per_box"])
    read = ", ".join(f"{x / 1e9:.1f}" for x in row["read_per_token_per_box"])
    return (
        f"| {name} | yes | {row['expert_bpw']:.2f} | {100 * row['promoted_share']:.1f}% | {kl} "
        f"| {row['decode_b1_tok_s']:.1f} / {row['decode_b8_tok_s']:.1f} "
        f"| {row['prefill_tok_s']:.0f} | {held} | {read} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    config = real_config()
    acc = account(config, read_index(REAL_K3_INDEX), str(REAL_K3_INDEX))
    th = sf.fit(sf.Counts(config))
    rows = []
    for name, (spec, split) in SETS.items():
        row, plan = plan_row(acc, spec, split)
        if plan is not None:
            row |= speed(config, plan, th)
        rows.append({"set": name, "boxes_gib": spec, "expert_split": split, **row})
        print(json.dumps(rows[-1])[:400], flush=True)
    out = {
        "command": "python benchmarks/speed/nboxes_table.py " + " ".join(sys.argv[1:]),
        "what": "K3 unpruned on sets of Macs: planner (experts split by memory), quality "
        "grid expectation, calibrated speed-model projections (not measurements)",
        "constants": {
            "context": CONTEXT,
            "prefill_prompt": PROMPT,
            "backend": BACKEND,
            "overheads_of": OVERHEAD,
            "mode": "ep-split",
            "moe_form": FORM,
            "limits": "deploy/tb5.yaml (4 requests at 128K, 128K prompt cache)",
            "box": "M3 Ultra, wired limit = memory - 24 GiB, 4 GiB runtime reserve",
        },
        "grid": byte_budget.QualityGrid.load().summary(),
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(json.dumps(out, indent=1) + "\n")
    print("\n".join([HEADER, *map(markdown_row, rows)]))


if __name__ == "__main__":
    main()
