"""``python -m k3dist.pipeline.plan``: a graded build's byte-budget plan
(``k3dist.pipeline.byte_budget``) for a checkpoint's config and index, printed as a summary or
JSON. Every field of the box (``k3dist.config.box.Box``) and of the serving limits
(:class:`~k3dist.pipeline.byte_budget.Limits`, default: ``deploy/tb5.yaml``'s) is a flag.

    python -m k3dist.pipeline.plan --config CONFIG --index INDEX [--budget auto|BYTES] \
        --dry-run --json
        [--nonexpert-sensitivity benchmarks/results/2026-12-01/nonexpert.json]
        [--context TOKENS] [--max-batch N] [--prompt-cache-tokens TOKENS] [--prefill-chunk TOKENS]
        [--attention split|replicated] [--boxes 512,256,256 | --deployment deploy/tb5-3.yaml]

``--deployment FILE`` plans for a deployment YAML: its ``boxes`` (each box's memory and
wired limit; without them ``size`` boxes of ``--memory-gib``), its serving limits
(``max_context``, ``max_batch``, ``prompt_cache_tokens``, ``prefill_chunk``, ``dtype``) and
``attention``; a flag given beside it wins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from k3dist import REPO
from k3dist.config.box import Box, parse_boxes
from k3dist.config.deployment import Deployment, DeploymentError, add_renamed_flag, load_deployment
from k3dist.format.classes import CLASSES
from k3dist.format.folder import CONFIG_NAME, INDEX_NAME, read_index, read_json
from k3dist.format.kvmemory import GiB
from k3dist.format.layout import ATTENTION_MODES
from k3dist.format.qformat import QFormat
from k3dist.pipeline.accounting import account
from k3dist.pipeline.byte_budget import (
    DEFAULT_KL_TOLERANCE,
    DEFAULT_KL_TOLERANCE_WHY,
    DEFAULT_NONEXPERT,
    Limits,
    PlanRequest,
    add_budget_args,
    make_plan,
    measured_nonexpert,
    plan_request,
    quality_line,
    read_sensitivity,
    shipped,
)
from k3dist.pipeline.expert_split import SPLITS


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
    budget = (
        f"budget per rank {_gb(plan['budget_per_rank'])} (wired "
        f"{_gb(plan['box']['wired_limit_mb'] << 20)} - reserve "
        f"{_gb(plan['box']['runtime_reserve_bytes'])})"
        if "boxes" not in plan
        else "budget per box "
        + ", ".join(_gb(b["budget"]) for b in plan["per_box"])
        + " (each wired limit - reserve)"
    )
    lines = [
        f"ranks {plan['ranks']}, {budget}",
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
    if "boxes" in plan:
        lines.insert(
            3,
            f"boxes (experts split by {plan['expert_split']}): "
            + "; ".join(
                f"rank {b['rank']} {b['memory_gib']:g} GiB: experts {_gb(b['routed_experts'])} "
                f"({b['hi_experts']:,} hi), total {_gb(b['total'])}, reads "
                f"{_gb(b['read_per_token'])}/token"
                for b in plan["per_box"]
            )
            + f"; the fullest reader at {plan['read_ratio']}x the mean",
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Plan a graded build: lo-bank format, promoted "
        "experts per layer, non-expert formats, bytes per rank."
    )
    ap.add_argument("--src", help="checkpoint folder (config.json + index)")
    ap.add_argument("--config", help="config.json (instead of --src)")
    ap.add_argument("--index", help=f"{INDEX_NAME}[.gz] (instead of --src)")
    ap.add_argument("--ranks", type=int, help="ranks of one box size (default 2)")
    ap.add_argument(
        "--deployment",
        metavar="YAML",
        help="plan for this deployment (e.g. deploy/tb5-3.yaml): its boxes (memory and "
        "wired limit each) or size, serving limits and attention; flags given win "
        "(default: deploy/tb5.yaml's limits, --ranks boxes of --memory-gib)",
    )
    ap.add_argument(
        "--boxes",
        help="boxes of different memory, one per rank: GiB[:wired_limit_mb] each, e.g. "
        "512,256,256 or 512,256:237568,256 (wired limit default: memory - 24 GiB); "
        "routed experts placed per layer by what each box has left (--ranks follows)",
    )
    ap.add_argument(
        "--expert-split",
        choices=SPLITS,
        default=PlanRequest.expert_split,
        help="with --boxes: memory (default: experts in proportion to each box's room, the "
        "big box reads more per token) or equal (equal experts and reads, the smallest "
        "box's room on every box)",
    )
    add_budget_args(ap, auto=True)
    ap.add_argument("--lo", default="auto", help="lo-bank format (e.g. 2bit-g128) or auto")
    ap.add_argument(
        "--grid",
        default=None,
        help="quality grid JSON (benchmarks/quality/quality_grid.py --package); default the "
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
        help="per-class measurements (benchmarks/quality/nonexpert.py): each class takes the "
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
        default=None,
        help="attention heads (and their KDA state and prefill activations) split "
        "across ranks, as deploy/tb5.yaml serves (default: the deployment's, split), or "
        "replicated on each",
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
    _limit_args(ap)
    return ap


def _limit_args(ap: argparse.ArgumentParser) -> None:
    """The serving limits and the box, each a flag (default: deploy/tb5.yaml's, Box's)."""
    ap.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens of one request (the server's max_context; default: deploy/tb5.yaml's)",
    )
    add_renamed_flag(
        ap,
        "--batch",
        "--max-batch",
        dest="max_batch",
        type=int,
        default=None,
        help="requests decoded together, each with its own KV cache (the server's max_batch)",
    )
    ap.add_argument(
        "--prompt-cache-tokens",
        type=int,
        default=None,
        help="the prompt cache's token bound (prompt_cache_tokens; 0: 4 x context)",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="tokens of one prefill chunk (the server's prefill_chunk)",
    )
    ap.add_argument("--wired-limit-mb", type=int, default=Box.wired_limit_mb)
    ap.add_argument("--memory-gib", type=int, default=Box.memory_bytes // GiB)
    ap.add_argument("--runtime-reserve-gib", type=float, default=Box.runtime_reserve_bytes / GiB)
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan, build nothing "
        "(the only mode today: the graded build takes the plan's counts)",
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--out", help="also write the JSON here")


def _inputs(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """(config path, index path, accounting, box) of the flags."""
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
    box = Box(
        memory_bytes=args.memory_gib * GiB,
        wired_limit_mb=args.wired_limit_mb,
        runtime_reserve_bytes=int(args.runtime_reserve_gib * GiB),
    )
    return cfg_path, idx_path if index is not None else None, acc, box


def _nonexpert(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """(formats, where each came from) of --nonexpert-sensitivity and --nonexpert."""
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
    return nonexpert, origin


def _deployment(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Deployment:
    """--deployment's, or the shipped one (deploy/tb5.yaml) for the limits alone."""
    if not args.deployment:
        return shipped()
    try:
        return load_deployment(args.deployment)
    except (DeploymentError, FileNotFoundError) as e:
        ap.error(f"--deployment: {e}")


def _boxes(args: argparse.Namespace, dep: Deployment) -> tuple[Box, ...] | None:
    """--boxes, else --deployment's boxes (None: equal boxes)."""
    if args.boxes:
        return parse_boxes(args.boxes)
    return dep.box_list() if args.deployment else None


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    cfg_path, idx_path, acc, box = _inputs(ap, args)
    dep = _deployment(ap, args)
    limits = Limits.of(
        dep,
        context=args.context,
        batch=args.max_batch,
        prompt_cache_tokens=args.prompt_cache_tokens,
        prefill_chunk=args.prefill_chunk,
    )
    if limits.batch < 1 or limits.context < 1:
        ap.error("--max-batch and --context must be at least 1")
    nonexpert, origin = _nonexpert(ap, args)
    try:
        boxes = _boxes(args, dep)
        if boxes is not None and args.ranks not in (None, len(boxes)):
            raise ValueError(f"--ranks {args.ranks} but --boxes names {len(boxes)} boxes")
        req = plan_request(
            len(boxes) if boxes else args.ranks or (dep.size if args.deployment else 2),
            args.budget,
            args.budget_total,
            args.target_bpw,
            auto=True,
            lo=args.lo,
            grid=args.grid,
            nonexpert=nonexpert,
            nonexpert_from=origin,
            attention=args.attention
            or (dep.attention if args.deployment else PlanRequest.attention),
            lo_fallback=args.lo_fallback,
            headroom=int(args.headroom_gib * GiB),
            boxes=boxes,
            expert_split=args.expert_split,
        )
    except ValueError as e:
        ap.error(str(e))
    try:
        plan = make_plan(acc, box, limits, req)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    plan = _record(plan, args, argv, cfg_path, idx_path, acc)
    if plan["quality"]["warning"]:
        print(f"warning: {plan['quality']['warning']}", file=sys.stderr)
    text = json.dumps(plan, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text if args.json else summary(plan))


def _record(plan: dict, args, argv, cfg_path: Path, idx_path: Path | None, acc) -> dict:
    """The plan with the command and inputs that made it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    paths = {"--src", "--config", "--index", "--out", "--deployment"}
    rel = [_relpath(a) if i and argv[i - 1] in paths else a for i, a in enumerate(argv)]
    return {
        "command": "python -m k3dist.pipeline.plan " + " ".join(rel),
        "inputs": {
            "config": _relpath(str(cfg_path)),
            "index": _relpath(str(idx_path)) if idx_path is not None else None,
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


if __name__ == "__main__":
    main()
