"""Build profiles: the MXFP4 build (``k3dist.pipeline.convert``) and what is made from it.

``--profile mxfp4`` is that build alone. ``2bit`` / ``3bit`` / ``mixed2`` / ``graded``
first make it (``--mxfp4 DIR``, default ``OUT.mxfp4`` beside OUT; reused when complete,
resumed when not), then ``k3dist.pipeline.promote`` it into OUT (its own journal: resumable
too): ``2bit`` / ``3bit`` every routed expert affine at g64 where the experts' columns
allow, else g32; ``mixed2`` every ``down_proj`` and the first and last MoE layer at
3-bit, the rest 2-bit (per projection, one graded build); ``graded`` plans the budget
from the source's own config and index (``k3dist.pipeline.byte_budget``), builds the
MXFP4 stage with the plan's non-expert formats, promotes each layer's top ``--scores``
experts (hi bank, MXFP4 source bytes) and stores the plan in the manifest.

    python -m k3dist.pipeline.profiles --src SRC --out OUT --profile 2bit|3bit|mixed2
    python -m k3dist.pipeline.profiles --src SRC --out OUT --profile graded --budget 480e9 \
        --scores SCORES.npz [--nonexpert-sensitivity benchmarks/results/DATE/nonexpert.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from k3dist.config.box import Box, parse_boxes
from k3dist.config.deployment import add_renamed_flag
from k3dist.format import layout
from k3dist.format.classes import CLASSES
from k3dist.format.folder import read_index
from k3dist.format.graded import LO, GradedMap
from k3dist.format.journal import write_json_atomic
from k3dist.format.kvmemory import GiB
from k3dist.format.manifest import MANIFEST
from k3dist.format.placement import read_counts
from k3dist.format.qformat import GROUP_SIZES, QFormat
from k3dist.format.sfile import CheckpointError
from k3dist.format.source import Source
from k3dist.pipeline import byte_budget
from k3dist.pipeline import promote as grader
from k3dist.pipeline.accounting import account
from k3dist.pipeline.convert import Converter, add_nonexpert_args, convert, parse_nonexpert
from k3dist.pipeline.expert_split import SPLITS
from k3dist.pipeline.promote import GradedBuilder

PROFILES = ("mxfp4", "2bit", "3bit", "mixed2", "graded")
CALIBRATE_HINT = (
    "python -m k3dist.pipeline.calibrate (per-expert sensitivity scores: npz of "
    "layer_L arrays); routing counts (a frequency baseline) also work"
)


def lo_format(tc: dict, bits: int, group: int = 64) -> QFormat:
    """``bits``-bit affine at group ``group`` where every routed-expert matrix's
    columns allow it, else the largest smaller group that does (mini-K3: 96 columns,
    g32)."""
    acc_cols = {
        tc["hidden_size"]
        if tc.get("routed_expert_hidden_size") is None
        else tc["routed_expert_hidden_size"],
        tc["moe_intermediate_size"],
    }
    for g in sorted((g for g in GROUP_SIZES if g <= group), reverse=True):
        f = QFormat("affine", bits, g)
        if all(f.fits(c) for c in acc_cols):
            return f
    raise ValueError(f"no {bits}-bit group size fits the routed experts' columns {acc_cols}")


def mixed2_formats(tc: dict) -> dict[tuple[int, str], QFormat]:
    """The ``mixed2`` recipe (mlx-lm's ``mixed_2_6`` idea, at 2/3 bits for the routed
    experts): every expert's ``down_proj`` (its output feeds the residual stream
    directly; mlx-lm keeps ``down_proj`` richer for the same reason) and all three
    projections of the first and last MoE layer (mlx-lm: the first and last eighth of
    layers) at 3-bit, every other projection 2-bit. (layer, projection) -> format."""
    lo2, lo3 = lo_format(tc, 2), lo_format(tc, 3)
    moe = layout.moe_layers(tc)
    out = {}
    for layer in moe:
        for proj in layout.MLP_PROJS:
            rich = proj == "down_proj" or layer in (moe[0], moe[-1])
            out[(layer, proj)] = lo3 if rich else lo2
    return out


class PerProjection(GradedBuilder):
    """``grade.GradedBuilder`` whose lo bank format is chosen per (layer, projection):
    one graded build, two lo formats (the quantization block is per path, and the
    loader builds each projection from its own entry)."""

    def __init__(self, build, out, gmap, lo_of: dict[tuple[int, str], QFormat], plan=None):
        base = min(lo_of.values(), key=lambda f: f.bits)
        super().__init__(build, out, gmap, base, plan)
        self.lo_of = lo_of
        self.ident = {
            **self.ident,
            "lo_by_projection": {
                f"{layer}.{proj}": f.name for (layer, proj), f in sorted(lo_of.items())
            },
        }

    def _bank_entries(self, layer, proj, w, s):
        base, self.lo = self.lo, self.lo_of[(layer, proj)]
        try:
            return super()._bank_entries(layer, proj, w, s)
        finally:
            self.lo = base

    def config_out(self) -> dict:
        cfg = super().config_out()
        for (layer, proj), f in self.lo_of.items():
            cfg["quantization"][f"language_model.model.layers.{layer}.mlp.{LO}.{proj}"] = (
                f.qconfig()
            )
        return cfg


def plan_graded(
    src: Source,
    ranks: int = 2,
    budget: int | None = None,
    budget_total: int | None = None,
    target_bpw: float | None = None,
    lo: str = "auto",
    nonexpert: dict[str, str] | None = None,
    nonexpert_from: dict[str, str] | None = None,
    context: int | None = None,
    headroom: int | None = None,
    batch: int | None = None,
    prompt_cache_tokens: int | None = None,
    boxes: str | None = None,
    expert_split: str | None = None,
) -> dict:
    """The byte-budget plan (``k3dist.pipeline.byte_budget``) from the source's own config and
    index; ``context``, ``batch``, ``prompt_cache_tokens``: the serving limits it leaves
    KV/state for (None: the plan's defaults); ``boxes`` (``512,256,256``, ``plan --boxes``):
    boxes of different memory, one per rank (``ranks`` follows), experts split by
    ``expert_split``. ValueError with the numbers when nothing fits."""
    index = read_index(src.index_path) if src.index_path.exists() else None
    acc = account(src.config, index, str(src.index_path))
    limits = byte_budget.Limits.of(
        byte_budget.shipped(), context=context, batch=batch, prompt_cache_tokens=prompt_cache_tokens
    )
    box_list = parse_boxes(boxes) if boxes else None
    if box_list is not None and ranks not in (2, len(box_list)):
        raise ValueError(f"--ranks {ranks} but --boxes names {len(box_list)} boxes")
    req = byte_budget.plan_request(
        len(box_list) if box_list else ranks,
        budget,
        budget_total,
        target_bpw,
        auto=True,
        lo=lo,
        nonexpert=dict(nonexpert or byte_budget.DEFAULT_NONEXPERT),
        nonexpert_from=dict(nonexpert_from or {}),
        boxes=box_list,
        expert_split=expert_split or byte_budget.PlanRequest.expert_split,
    )
    if headroom is not None:
        req = replace(req, headroom=headroom)
    return byte_budget.make_plan(acc, Box(), limits, req)


def _graded_plan(
    source: Source,
    plan: dict | None,
    plan_kw: dict | None,
    nonexpert: str | dict | None,
    progress: bool,
) -> dict:
    """The graded profile's plan: ``plan`` as given, else made from ``plan_kw`` (explicit
    ``nonexpert`` formats beat the plan's); its summary printed with ``progress``."""
    kw = dict(plan_kw or {})
    if nonexpert is not None:  # explicit formats beat the plan's
        fmts = parse_nonexpert(nonexpert)
        kw["nonexpert"] = {c: f.name if f.quantized else "bf16" for c, f in fmts.items()}
        kw["nonexpert_from"] = dict.fromkeys(fmts, "--nonexpert")
    plan = plan_graded(source, **kw) if plan is None else dict(plan)
    if progress:
        print(
            f"plan: lo {plan['lo']['format']}, expert bpw {plan['expert_bpw']}, "
            f"{plan['bytes_per_rank']['total'] / 1e9:,.1f} GB per rank; "
            + byte_budget.quality_line(plan)
        )
        if plan["quality"]["warning"]:
            print(f"warning: {plan['quality']['warning']}", file=sys.stderr)
    return plan


def _promoted(plan: dict, scores: str | Path, allocation: str) -> dict[int, list[int]]:
    """The experts each layer promotes: the plan's count spent on the highest ``scores``
    over all layers (``global``) or in every layer (``per-layer``); noted in ``plan``."""
    counts = {int(k): int(v) for k, v in plan["promoted_per_layer"].items()}
    if allocation == "global":
        promoted = grader.promote_global(read_counts(scores), sum(counts.values()), plan["ranks"])
    elif allocation == "per-layer":
        promoted = grader.promote_top(read_counts(scores), counts)
    else:
        raise ValueError(f"--allocation {allocation!r}: global or per-layer")
    plan["allocation"] = allocation
    return promoted


def _k_hi(
    promoted: dict[int, list[int]],
    build,
    tc: dict,
    routes: str | Path | None,
    k_hi: int | None,
) -> dict[int, int]:
    """k_hi per layer: the observed maximum from calibration ``routes``, else ``k_hi``,
    else uniform routing at the plan's drop target."""
    if routes is not None:
        return grader.k_hi_calibrated(routes, promoted, build)
    if k_hi is not None:
        return dict.fromkeys(promoted, k_hi)
    target = byte_budget.PlanRequest().k_hi_drop_target
    E, k = tc["num_experts"], tc["num_experts_per_token"]
    return {i: max(1, byte_budget.k_hi_uniform(E, k, len(v), target)) for i, v in promoted.items()}


def convert_profile(
    src: str | Path,
    out: str | Path,
    profile: str = "mxfp4",
    *,
    mxfp4_dir: str | Path | None = None,
    base=None,
    rank_pattern: str | None = None,
    keep: bool = False,
    nonexpert_bits: int = 16,
    group_size: int = 64,
    nonexpert: str | dict | None = None,
    scores: str | Path | None = None,
    plan_kw: dict | None = None,
    plan: dict | None = None,
    k_hi: int | None = None,
    routes: str | Path | None = None,
    allocation: str = "global",
    progress: bool = True,
) -> Path:
    """One ``--profile``; every stage streamed and resumable (module doc). ``graded``:
    the plan fixes how many experts are promoted; ``allocation`` ``global`` spends them
    on the highest ``scores`` over all layers (a multiple of the ranks per layer),
    ``per-layer`` takes the plan's count in every layer; ``k_hi`` per layer comes from
    calibration ``routes`` when given (observed maximum), else ``k_hi``, else uniform
    routing at the plan's drop target. ``base`` (a ``k3dist.pipeline.view.SourceView``):
    the MXFP4 base build read from the source a layer at a time instead of written to
    ``mxfp4_dir``. ``rank_pattern`` (graded): the graded build written straight into the
    rank folders ``rank_pattern.format(rank=r)`` of the plan's ranks, ``out`` holding one
    graded file at a time (``k3dist.pipeline.direct``; deleted unless ``keep``); returns the
    rank folders (placed as the plan says for boxes of different sizes). ``plan``: a plan
    already made (the pipeline's ``plan.json``) instead of one from ``plan_kw``."""
    if profile not in PROFILES:
        raise ValueError(f"--profile {profile!r}: one of {', '.join(PROFILES)}")
    if profile == "mxfp4":
        return convert(src, out, nonexpert_bits, group_size, progress, nonexpert)
    source, out = Source(src), Path(out)
    stage = Path(mxfp4_dir) if mxfp4_dir else out.with_name(out.name + ".mxfp4")
    tc = source.text_config
    if plan is not None and (profile != "graded" or plan_kw is not None):
        raise ValueError("give a graded profile plan_kw or a plan, not both")
    if profile == "graded":
        if scores is None:
            raise ValueError(f"--profile graded needs --scores FILE: {CALIBRATE_HINT}")
        if not Path(scores).exists():
            raise ValueError(f"--scores {scores}: no such file; make it with {CALIBRATE_HINT}")
        plan = _graded_plan(source, plan, plan_kw, nonexpert, progress)
        nonexpert = {c: v["format"] for c, v in plan["nonexpert"].items() if c in CLASSES}
        nonexpert_bits = 16
    if base is not None:  # the source read as its MXFP4 base build: nothing written
        want = Converter(source, None, nonexpert_bits, group_size, nonexpert=nonexpert).ident
        if want != base.manifest["identity"]:
            raise ValueError(
                f"{base}: a base build view of {base.manifest['identity']}, this profile "
                f"reads {want}; make the view with the plan's non-expert formats"
            )
        build = base
    else:
        build = Converter(source, stage, nonexpert_bits, group_size, nonexpert=nonexpert).run(
            progress
        )
    E = tc["num_experts"]
    if profile == "graded":
        promoted = _promoted(plan, scores, allocation)
        khi = _k_hi(promoted, build, tc, routes, k_hi)
        gb = grader.builder(build, out, promoted, khi, plan["lo"]["format"], plan=plan)
        if rank_pattern is not None:  # straight into rank folders: OUT is scratch
            from k3dist.pipeline import direct, rank_files

            plc = rank_files.plan_placement(plan, E, gb.gmap)  # boxes of different sizes
            return direct.grade_into_ranks(gb, rank_pattern, plan["ranks"], progress, keep, plc)
        gb.run(progress)
    elif profile in ("2bit", "3bit"):
        grader.grade(build, out, {}, 0, lo_format(tc, int(profile[0])), progress=progress)
    else:  # mixed2
        lo_of = mixed2_formats(tc)
        gmap = GradedMap(E, {}, {}, False, "mixed2")
        PerProjection(build, out, gmap, lo_of).run(progress)
    m = json.loads((out / MANIFEST).read_text())
    m["convert_profile"] = {
        "profile": profile,
        "mxfp4_build": build.describe if base is not None else str(build.resolve()),
        "scores": str(scores) if scores else None,
    }
    write_json_atomic(out / MANIFEST, m)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m k3dist.pipeline.profiles",
        description="Make a build profile of Moonshot's K3 checkpoint: the MXFP4 build "
        "(experts bit-exact), then a low-bit / graded build from it, one layer at a time.",
    )
    ap.add_argument("--src", required=True, help="Moonshot-format checkpoint folder")
    ap.add_argument("--out", required=True, help="output build folder (resumes if partial)")
    ap.add_argument(
        "--profile",
        choices=PROFILES,
        default="mxfp4",
        help="mxfp4: experts in their source bytes (default); 2bit / 3bit: "
        "every routed expert affine (g64 where the columns allow, else g32); "
        "mixed2: down_proj and the first/last MoE layer 3-bit, the rest 2-bit; "
        "graded: plan a byte budget, promoted experts keep MXFP4, the rest the "
        "plan's lo format (needs a budget and --scores)",
    )
    ap.add_argument(
        "--mxfp4",
        help="where the MXFP4 stage of a non-mxfp4 profile is built "
        "(resumable; reused; default OUT.mxfp4 beside OUT)",
    )
    add_nonexpert_args(ap)
    g = ap.add_argument_group("graded profile")
    byte_budget.add_budget_args(g, auto=True)
    g.add_argument(
        "--scores",
        help="per-expert scores, npz of layer_L arrays (as grade "
        "--scores): the highest of each layer are promoted",
    )
    g.add_argument("--ranks", type=int, help="ranks of one box size (default 2)")
    g.add_argument(
        "--boxes",
        help="boxes of different memory, one per rank (plan --boxes: GiB[:wired_limit_mb])",
    )
    g.add_argument(
        "--expert-split",
        choices=SPLITS,
        help="with --boxes: memory (default) or equal (plan --expert-split)",
    )
    g.add_argument("--lo", default="auto", help="lo-bank format or auto (the plan's)")
    g.add_argument(
        "--k-hi",
        type=int,
        help="hi routes per token (default: from --routes, "
        "else uniform routing at the plan's drop target)",
    )
    g.add_argument(
        "--routes",
        help="calibration routes.npz (python -m "
        "k3dist.pipeline.calibrate): k_hi per layer = the observed maximum",
    )
    g.add_argument(
        "--allocation",
        choices=("global", "per-layer"),
        default="global",
        help="global (default, measured better: benchmarks/results/*/quality*): "
        "the plan's promotions go to the highest scores over all layers; "
        "per-layer: the plan's count in every layer",
    )
    g.add_argument("--context", type=int, help="tokens of context the plan leaves KV for")
    add_renamed_flag(
        g,
        "--batch",
        "--max-batch",
        dest="max_batch",
        type=int,
        help="requests served together the plan leaves KV for (plan default)",
    )
    g.add_argument(
        "--prompt-cache-tokens",
        type=int,
        help="the prompt cache bound the plan leaves KV for (plan default)",
    )
    g.add_argument("--headroom-gib", type=float, help="kept free per rank (plan default)")
    g.add_argument(
        "--nonexpert-sensitivity",
        metavar="JSON",
        help="measured non-expert formats (plan --nonexpert-sensitivity)",
    )
    g.add_argument("--kl-tolerance", type=float, help="with --nonexpert-sensitivity")
    return ap


def _plan_kw(args: argparse.Namespace) -> dict:
    """The graded profile's plan arguments of the flags."""
    plan_kw = {
        "ranks": args.ranks or 2,
        "boxes": args.boxes,
        "expert_split": args.expert_split,
        "lo": args.lo,
        "context": args.context,
        "batch": args.max_batch,
        "prompt_cache_tokens": args.prompt_cache_tokens,
        "budget": int(args.budget) if args.budget is not None else None,
        "budget_total": int(args.budget_total) if args.budget_total else None,
        "target_bpw": args.target_bpw,
        "headroom": None if args.headroom_gib is None else int(args.headroom_gib * GiB),
    }
    if args.nonexpert_sensitivity:
        tol = args.kl_tolerance or byte_budget.DEFAULT_KL_TOLERANCE
        plan_kw["nonexpert"], plan_kw["nonexpert_from"] = byte_budget.measured_nonexpert(
            byte_budget.read_sensitivity(args.nonexpert_sensitivity), tol
        )
    return plan_kw


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    graded_only = (
        "budget",
        "budget_total",
        "target_bpw",
        "scores",
        "k_hi",
        "routes",
        "context",
        "max_batch",
        "prompt_cache_tokens",
        "headroom_gib",
        "nonexpert_sensitivity",
        "kl_tolerance",
        "boxes",
        "expert_split",
    )
    given = [f"--{k.replace('_', '-')}" for k in graded_only if getattr(args, k) is not None]
    if args.profile != "graded" and given:
        ap.error(f"{', '.join(given)}: only with --profile graded")
    if args.profile == "mxfp4" and args.mxfp4:
        ap.error("--mxfp4: only with a profile other than mxfp4")
    plan_kw = _plan_kw(args) if args.profile == "graded" else None
    try:
        path = convert_profile(
            args.src,
            args.out,
            args.profile,
            mxfp4_dir=args.mxfp4,
            nonexpert_bits=args.nonexpert_bits,
            group_size=args.group_size,
            nonexpert=args.nonexpert,
            scores=args.scores,
            plan_kw=plan_kw,
            k_hi=args.k_hi,
            routes=args.routes,
            allocation=args.allocation,
        )
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
