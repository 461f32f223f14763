"""``python -m k3dist.build.plan``: a graded build's byte-budget plan
(``k3dist.build.planner``) for a checkpoint's config and index, printed as a summary or
JSON. Every :class:`~k3dist.build.planner.Box` field is a flag.

    python -m k3dist.build.plan --config CONFIG --index INDEX [--budget auto|BYTES] --dry-run --json
        [--nonexpert-sensitivity benchmarks/results/nonexpert-2026-12-01.json]
        [--context TOKENS] [--batch N] [--prompt-cache-tokens TOKENS] [--prefill-chunk TOKENS]
        [--attention split|replicated]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from k3dist import REPO
from k3dist.build.accounting import account
from k3dist.build.planner import (
    DEFAULT_KL_TOLERANCE,
    DEFAULT_KL_TOLERANCE_WHY,
    DEFAULT_NONEXPERT,
    Box,
    PlanRequest,
    make_plan,
    measured_nonexpert,
    quality_line,
    read_sensitivity,
)
from k3dist.format.classes import CLASSES
from k3dist.format.folder import CONFIG_NAME, INDEX_NAME, read_index, read_json
from k3dist.format.kvmemory import GiB
from k3dist.format.layout import ATTENTION_MODES
from k3dist.format.qformat import QFormat


def _relpath(p: str) -> str:
    """``p`` relative to the repository, as results record paths (``../shared/...`` for
    the reference beside it)."""
    try:
        return os.path.relpath(Path(p).resolve(), REPO)
    except ValueError:
        return p


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def summary(plan: dict) -> str:
    pr, kv = plan["bytes_per_rank"], plan["kv_state"]
    lines = [
        f"ranks {plan['ranks']}, budget per rank {_gb(plan['budget_per_rank'])} "
        f"(wired {_gb(plan['box']['wired_limit_mb'] << 20)} - reserve "
        f"{_gb(plan['box']['runtime_reserve'])})",
        f"lo bank {plan['lo']['format']}, hi bank mxfp4 ({plan['hi']['expert_bytes']:,} B "
        f"per expert); promoted {plan['promoted_total']:,} "
        f"({100 * plan['promoted_fraction']:.1f}%), expert bpw {plan['expert_bpw']}",
        quality_line(plan),
        "per rank: " + ", ".join(f"{k} {_gb(v)}" for k, v in pr.items()),
        f"KV/state: batch {kv['batch']} x {kv['context']:,} tokens "
        f"({_gb(kv['per_request'])} a request) {_gb(kv['requests'])} + prompt cache "
        f"({kv['prompt_cache']['tokens']:,} tokens, at most "
        f"{kv['prompt_cache']['tokens_held_at_most']:,} held) {_gb(kv['prompt_cache']['total'])}",
        f"headroom per rank {_gb(plan['headroom_per_rank'])}; build {_gb(plan['build_bytes'])}"
        f" (source {_gb(plan['source_bytes'])})",
        "non-experts: "
        + ", ".join(
            f"{k} {v['format']} {_gb(v['per_rank'])}" for k, v in plan["nonexpert"].items()
        ),
        "alternatives: "
        + "; ".join(
            f"{o['lo']}: {'fits' if o['fits'] else 'no'} {o['promoted_total']:,} promoted "
            f"({o['expert_bpw']} bpw"
            + (f", KL {o['expected']['kl']:.4f}" if o.get("expected") else ", not in grid")
            + ")"
            for o in plan["alternatives"]
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Plan a graded build: lo-bank format, promoted "
        "experts per layer, non-expert formats, bytes per rank."
    )
    ap.add_argument("--src", help="checkpoint folder (config.json + index)")
    ap.add_argument("--config", help="config.json (instead of --src)")
    ap.add_argument("--index", help=f"{INDEX_NAME}[.gz] (instead of --src)")
    ap.add_argument("--ranks", type=int, default=2)
    g = ap.add_mutually_exclusive_group()
    g.add_argument(
        "--budget",
        default="auto",
        help="bytes per rank for weights + KV + activations, e.g. 480e9; auto: "
        "the box's wired limit less the runtime reserve",
    )
    g.add_argument("--budget-total", type=float, help="bytes over all ranks")
    g.add_argument("--target-bpw", type=float, help="routed-expert bits per weight")
    ap.add_argument("--lo", default="auto", help="lo-bank format (e.g. 2bit-g128) or auto")
    ap.add_argument(
        "--grid",
        default=None,
        help="quality grid JSON (benchmarks/quality_grid.py --package); default the "
        "shipped k3dist/data/quality-grid.json. auto lo: the lowest measured KL at the "
        "plan's bytes; a --lo outside the grid is warned about",
    )
    ap.add_argument(
        "--nonexpert",
        action="append",
        default=[],
        metavar="CLASS=FORMAT",
        help=f"override a class ({', '.join(CLASSES)}), e.g. attention=8bit-g64",
    )
    ap.add_argument(
        "--nonexpert-sensitivity",
        metavar="JSON",
        help="per-class measurements (benchmarks/nonexpert.py): each class takes the "
        "fewest bits within --kl-tolerance; without it DEFAULT_NONEXPERT",
    )
    ap.add_argument(
        "--kl-tolerance",
        type=float,
        default=DEFAULT_KL_TOLERANCE,
        help=f"nats/token a class may add (default {DEFAULT_KL_TOLERANCE}: "
        "KL of seven classes adds to well under the 2-bit experts' error)",
    )
    ap.add_argument(
        "--attention",
        choices=ATTENTION_MODES,
        default=PlanRequest.attention,
        help="attention heads (and their KDA state and prefill activations) split "
        "across ranks, as deploy/tb5.yaml serves (default), or replicated on each",
    )
    ap.add_argument(
        "--lo-fallback",
        action="store_true",
        help="promoted experts also keep a lo copy (overflow routes use it)",
    )
    ap.add_argument(
        "--headroom-gib",
        type=float,
        default=PlanRequest.headroom / GiB,
        help="kept free per rank beyond weights, KV/state and activations",
    )
    ap.add_argument(
        "--context",
        type=int,
        default=Box.context,
        help="tokens of one request (the server's max_context)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=Box.batch,
        help="requests decoded together, each with its own KV cache (max_batch)",
    )
    ap.add_argument(
        "--prompt-cache-tokens",
        type=int,
        default=Box.prompt_cache_tokens,
        help="the prompt cache's token bound (prompt_cache_tokens; 0: 4 x context)",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=Box.prefill_chunk,
        help="tokens of one prefill chunk (the server's prefill_chunk)",
    )
    ap.add_argument("--wired-limit-mb", type=int, default=Box.wired_limit_mb)
    ap.add_argument("--physical-gib", type=int, default=512)
    ap.add_argument("--runtime-reserve-gib", type=float, default=Box.runtime_reserve / GiB)
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan, build nothing "
        "(the only mode today: the graded build takes the plan's counts)",
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)

    if args.src:
        cfg_path = Path(args.src) / CONFIG_NAME
        idx_path = Path(args.src) / INDEX_NAME
    elif args.config:
        cfg_path, idx_path = Path(args.config), Path(args.index) if args.index else None
    else:
        ap.error("give --src or --config [--index]")
    config, _ = read_json(cfg_path, "config")
    index = read_index(idx_path) if idx_path and idx_path.exists() else None
    acc = account(config, index, str(idx_path))
    box = replace(
        Box(),
        physical=args.physical_gib * GiB,
        wired_limit_mb=args.wired_limit_mb,
        runtime_reserve=int(args.runtime_reserve_gib * GiB),
        context=args.context,
        batch=args.batch,
        prompt_cache_tokens=args.prompt_cache_tokens or None,
        prefill_chunk=args.prefill_chunk,
    )
    if args.batch < 1 or args.context < 1:
        ap.error("--batch and --context must be at least 1")
    nonexpert, origin = dict(DEFAULT_NONEXPERT), dict.fromkeys(DEFAULT_NONEXPERT, "default")
    if args.nonexpert_sensitivity:
        try:
            sens = read_sensitivity(args.nonexpert_sensitivity)
        except (OSError, ValueError) as e:
            ap.error(f"--nonexpert-sensitivity: {e}")
        nonexpert, origin = measured_nonexpert(
            sens, args.kl_tolerance, f"measured ({_relpath(args.nonexpert_sensitivity)})"
        )
    for kv in args.nonexpert:
        c, _, f = kv.partition("=")
        if c not in CLASSES:
            ap.error(f"--nonexpert {kv}: class must be one of {CLASSES}")
        QFormat.parse(f)
        nonexpert[c], origin[c] = f, "--nonexpert"
    budget = None
    if args.budget_total is not None:
        budget = int(args.budget_total) // args.ranks
    elif args.budget != "auto":
        budget = int(float(args.budget))
    req = PlanRequest(
        ranks=args.ranks,
        budget_per_rank=budget,
        target_expert_bpw=args.target_bpw,
        lo=args.lo,
        grid=args.grid,
        nonexpert=nonexpert,
        nonexpert_from=origin,
        attention=args.attention,
        lo_fallback=args.lo_fallback,
        headroom=int(args.headroom_gib * GiB),
    )
    try:
        plan = make_plan(acc, box, req)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    argv = list(sys.argv[1:] if argv is None else argv)
    paths = {"--src", "--config", "--index", "--out"}
    rel = [_relpath(a) if i and argv[i - 1] in paths else a for i, a in enumerate(argv)]
    plan = {
        "command": "python -m k3dist.build.plan " + " ".join(rel),
        "inputs": {
            "config": _relpath(str(cfg_path)),
            "index": _relpath(str(idx_path)) if index is not None else None,
            "index_total_size": acc.index_total,
            "source_bytes_from_config": acc.source_total,
        },
        "nonexpert_sensitivity": {
            "file": _relpath(args.nonexpert_sensitivity),
            "kl_tolerance": args.kl_tolerance,
            "why": DEFAULT_KL_TOLERANCE_WHY,
        }
        if args.nonexpert_sensitivity
        else None,
        **plan,
    }
    if plan["quality"]["warning"]:
        print(f"warning: {plan['quality']['warning']}", file=sys.stderr)
    text = json.dumps(plan, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text if args.json else summary(plan))


if __name__ == "__main__":
    main()
