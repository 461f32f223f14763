"""Byte-budget planner for graded builds: what fits, per rank, before anything is built.

Over the accounting of a checkpoint (``k3dist.pipeline.accounting``: every tensor in its
class, bytes in any format of ``k3dist.format.qformat``), the **memory model** (the box,
``k3dist.config.box.Box``, and the serving :class:`Limits`) and the **plan**
(:func:`make_plan`): per box, the usable
memory (below), the KV/state the server holds at its limits (``batch`` requests at
``context`` tokens and the prompt cache) and the activations of a prefill chunk at that
context; what is left holds the weights. The plan picks the lo-bank format of the routed
experts, how many experts per layer keep their MXFP4 bytes (the hi bank) and the format
of each non-expert class, and reports bytes per rank. Which experts are promoted is for
calibration (``k3dist`` sensitivity scoring) to decide; the plan fixes how many.

Memory assumptions (``Box`` and :class:`Limits` fields; every one a flag of
``python -m k3dist.pipeline.plan``):

- a "512 GB" M3 Ultra has 512 GiB (549.76 GB) of unified memory; GPU-wired memory is
  capped by macOS at ``iogpu.wired_limit_mb`` (default ~75% of RAM on large machines).
  We assume it is raised to 499712 MB (488 GiB), leaving 24 GiB to macOS and the
  process's unwired memory (Python, tokenizer, HTTP server, file cache pressure);
- of the wired memory, ``runtime_reserve`` (4 GiB) stays free for MLX's allocator cache
  and fragmentation, Metal command buffers and the collective buffers;
- KV/state (``k3dist.format.kvmemory``, the arithmetic the server's preflight checks a
  deployment with): per request the MLA latent cache ``(kv_lora_rank + qk_rope_head_dim) x
  2 B`` per token for each MLA layer (mlx-lm's ``KVCache`` holds the latent, growing in
  steps of 256; whole on every rank), and the KDA recurrent state (``heads x head_dim^2``
  F32) + conv state (``3 x (kernel - 1) x heads x head_dim``, bf16) for each KDA layer
  (split by heads across the ranks with ``--attention split``, the default; whole on every
  rank with ``--attention replicated``); ``--max-batch`` requests (the server's ``max_batch``:
  they decode together, each with its own cache) at ``--context`` tokens, plus the prompt
  cache: at most ``max(--prompt-cache-tokens, context) + context`` tokens in at most 9
  entries, each with a whole KDA state;
- activations (``k3dist.format.kvmemory.prefill_activation_bytes``, also what preflight
  checks): the peak of one prefill chunk of ``--prefill-chunk`` tokens at full context —
  an MLA layer decompresses k and v for the whole context (``heads x context x (nope + v)
  x 2 B``) and builds the rope scores and the attention scores (``2 x heads x chunk x
  context x 2 B``: mlx-lm's fallback path materialises both), over the heads a rank holds
  — plus the chunk's logits (F32), hidden states of the AttnRes block stack and the MoE
  intermediates;
- the defaults describe the deployment the project ships, ``deploy/tb5.yaml``
  (:func:`shipped`, read through ``k3dist.config.deployment`` when asked): attention split
  over the ranks, 4 requests at 128K, a 128K-token prompt cache, prefill chunks of 256
  tokens.

Promoted experts keep **no** 2-bit fallback copy in the lo bank by default: a route the
hi bank cannot take (more than ``k_hi`` promoted routes in one token) is dropped and
counted. A fallback copy costs one lo-format expert per promoted expert (the plan
reports it: ``fallback_copy_bytes``); at the K3 plan's promotion counts that is tens of
GB, i.e. roughly half the promotions, for routes that ``k_hi`` from calibration makes
rare (~4e-6 of token-layers at ``k_hi`` = 6 under uniform routing).

Non-expert formats come from measurement with ``--nonexpert-sensitivity FILE`` (the
JSON of ``benchmarks/quality/nonexpert.py``: KL(teacher || student) with one class quantized at a
time): each class takes the fewest bits whose KL is at most ``--kl-tolerance``
(default :data:`DEFAULT_KL_TOLERANCE` = 0.002 nats/token; why: ``DEFAULT_KL_TOLERANCE_WHY``);
without the file, :data:`DEFAULT_NONEXPERT`. Each class's ``from`` in the plan says which.

The command is ``python -m k3dist.pipeline.plan`` (``k3dist.pipeline.plan``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from k3dist import REPO
from k3dist.config.box import Box
from k3dist.config.deployment import FIELDS, Deployment, load_deployment
from k3dist.format import kvmemory
from k3dist.format.classes import CLASSES
from k3dist.format.kvmemory import GiB
from k3dist.format.qformat import MXFP4, SOURCE, QFormat
from k3dist.pipeline.accounting import Accounting
from k3dist.pipeline.quality import QualityGrid

# A starting point, not a measurement (sensitivity scoring replaces it): every class
# that every token reads at <= ~6 bits (the cost model's 12 tok/s condition), the
# latent projections and lm_head at 8 (few, wide, on every token's path).
DEFAULT_NONEXPERT = {
    "attention": "6bit-g64",
    "shared": "6bit-g64",
    "latent": "8bit-g64",
    "router": "8bit-g64",
    "dense_mlp": "6bit-g64",
    "embed": "6bit-g64",
    "lm_head": "8bit-g64",
}


# Measured non-expert formats (``--nonexpert-sensitivity``): per class, the fewest bits
# whose KL(teacher || student) with that class alone quantized (everything else bf16,
# experts MXFP4) is at most this many nats per token. DEFAULT_KL_TOLERANCE_WHY says why.
DEFAULT_KL_TOLERANCE = 0.002
DEFAULT_KL_TOLERANCE_WHY = (
    "0.002 nats/token per class: were KL additive over the seven classes, at most 0.014 "
    "together, under half the 0.036 of 2-bit routed experts and near the 0.0096 of 3-bit "
    "ones (2026-12-01/quality): the non-experts never dominate the expert error the budget "
    "is spent on. Measured on the mini-K3 (2026-12-01/nonexpert) it is sub-additive: the "
    "pick at 0.002 sums to 0.0065 class by class and measures 0.0042 whole, the same as "
    "DEFAULT_NONEXPERT (0.0043) with 7-11% fewer non-expert bytes read per token on the "
    "real K3. 0.001 would keep the router in bf16 as well as the embedding; 0.005 takes "
    "shared, latent, dense MLP and lm_head to 4-bit and attention to 5-bit, where each "
    "bit removed about doubles a class's KL"
)


def read_sensitivity(path: str | Path) -> dict[str, dict[str, float]]:
    """``{class: {format: KL}}`` from a ``benchmarks/quality/nonexpert.py`` result (its rows
    that quantize one class; combined rows are ignored)."""
    rep = json.loads(Path(path).read_text())
    out: dict[str, dict[str, float]] = {}
    for r in rep.get("rows", []):
        if r.get("class") in CLASSES and isinstance(r.get("format"), str):
            out.setdefault(r["class"], {})[QFormat.parse(r["format"]).name] = float(r["kl"])
    if not out:
        raise ValueError(
            f"{path}: no per-class rows (class, format, kl); write it with "
            "python benchmarks/quality/nonexpert.py"
        )
    return out


def measured_nonexpert(
    sens: dict[str, dict[str, float]],
    tolerance: float = DEFAULT_KL_TOLERANCE,
    where: str = "measured",
) -> tuple[dict[str, str], dict[str, str]]:
    """Per class the format with the fewest bits per weight whose measured KL is at most
    ``tolerance`` (none: the source dtype); classes not measured keep
    ``DEFAULT_NONEXPERT``. Returns (formats, where each came from)."""
    formats, origin = dict(DEFAULT_NONEXPERT), dict.fromkeys(DEFAULT_NONEXPERT, "default")
    for c in CLASSES:
        if c not in sens:
            continue
        ok = [(QFormat.parse(f).bpw, f, kl) for f, kl in sens[c].items() if kl <= tolerance]
        if ok:
            _, f, kl = min(ok)
            formats[c] = f
            origin[c] = f"{where}: KL {kl:.5f} <= {tolerance}"
        else:
            best = min(sens[c].items(), key=lambda x: x[1])
            formats[c] = "bf16"
            origin[c] = (
                f"{where}: no format within {tolerance} (best {best[0]}, KL "
                f"{best[1]:.5f}); source dtype"
            )
    return formats, origin


def shipped() -> Deployment:
    """The deployment the project ships (``deploy/tb5.yaml``): the plan's default
    serving limits, read when asked, never at import."""
    return load_deployment(REPO / "deploy" / "tb5.yaml")


@dataclass(frozen=True)
class Limits:
    """What the server holds beside the weights: a deployment's keys (see module doc)."""

    context: int  # tokens of one request (prompt + completion): max_context
    batch: int  # requests decoded together: max_batch
    prompt_cache_tokens: int | None  # None: the prompt cache's default bound
    prefill_chunk: int  # tokens of one prefill chunk
    act_bytes: int  # of activations and caches (the deployment's dtype)
    cache_step: int = kvmemory.CACHE_STEP  # mlx-lm KVCache growth step

    @classmethod
    def of(cls, dep: Deployment, **overrides) -> Limits:
        """The limits ``dep`` serves with; ``overrides`` that are not None on top."""
        limits = cls(
            context=dep.max_context,
            batch=dep.max_batch,
            prompt_cache_tokens=dep.prompt_cache_tokens,
            prefill_chunk=dep.prefill_chunk,
            act_bytes=kvmemory.act_bytes(dep.dtype),
        )
        return replace(limits, **{k: v for k, v in overrides.items() if v is not None})


def kv_state(tc: dict, limits: Limits, attention_split: int = 1) -> dict:
    """Bytes of the KV cache and KDA state a server holds on one rank:
    ``limits.batch`` requests at ``limits.context`` tokens and the prompt cache
    (``k3dist.format.kvmemory.serving_bytes``; ``mla_latent_cache`` and ``kda_state`` are
    one request's, ``total`` all of it)."""
    return kvmemory.serving_bytes(
        tc,
        context=limits.context,
        batch=limits.batch,
        prompt_cache_tokens=limits.prompt_cache_tokens,
        act=limits.act_bytes,
        size=attention_split,
        step=limits.cache_step,
    )


def activations(tc: dict, limits: Limits, attention_split: int = 1) -> dict:
    """Peak transient bytes of one prefill chunk of ``limits.prefill_chunk`` tokens at
    ``limits.context`` on one rank (``k3dist.format.kvmemory.prefill_activation_bytes``, what
    the server's preflight checks a deployment with)."""
    return kvmemory.prefill_activation_bytes(
        tc,
        context=limits.context,
        chunk=limits.prefill_chunk,
        act=limits.act_bytes,
        size=attention_split,
    )


ASSUMPTIONS = [
    "512 GB M3 Ultra = 512 GiB unified memory; sysctl iogpu.wired_limit_mb raised to "
    "499712 (488 GiB wired for the GPU), 24 GiB left to macOS and unwired process memory",
    "runtime_reserve of the wired memory kept free: MLX allocator cache and fragmentation, "
    "Metal command buffers, collective buffers",
    "KV/state (k3dist.format.kvmemory, as the server's preflight checks it): `batch` "
    "requests decoded together (max_batch) at `context` tokens each: MLA latent cache "
    "(kv_lora_rank + qk_rope_head_dim) x 2 B per token per MLA layer in 256-token steps; KDA "
    "recurrent state heads x head_dim^2 F32 + conv state per KDA layer; plus the prompt "
    "cache: at most max(prompt_cache_tokens, context) + context tokens in at most 9 entries, "
    "each with a whole KDA state",
    "activations (k3dist.format.kvmemory, as the server's preflight checks them): peak of "
    "one prefill chunk (`prefill_chunk` tokens, the server's prefill_chunk) at full "
    "context: MLA k/v decompressed for the whole context, rope and attention scores (bf16, "
    "materialised), F32 logits of the chunk, hidden states of the AttnRes block stack, MoE "
    "intermediates",
    "attention split across ranks by heads (the default, as deploy/tb5.yaml and every "
    "deployment serve it, k3dist.model.attention: attention weights, KDA state and prefill "
    "activations divided over the ranks, the MLA latent cache whole on each); "
    "--attention replicated keeps all of it on every rank; shared experts split by their "
    "intermediate dimension; routed experts split evenly, promoted experts balanced",
    "non-expert formats: DEFAULT_NONEXPERT is a starting point (<= 6 bits for what every "
    "token reads, 8 bits for latent projections, router and lm_head); with "
    "--nonexpert-sensitivity each measured class takes the fewest bits within the KL "
    "tolerance (measured on the mini-K3: the real model's sensitivities may differ); "
    "each class's 'from' says which",
    "MLA kv_b_proj counted as its source matrix; mlx-lm splits it into embed_q / "
    "unembed_out at load (same element count; group boundaries may differ slightly)",
    "lo-format choice 'auto': of the lo formats that fit, the one with the lowest KL "
    "measured (interpolated) at the plan's expert bpw in the quality grid "
    "(k3dist/data/quality-grid.json, benchmarks/quality/quality_grid.py: the trained sparse "
    "mini-K3, graded builds at expert bpw x lo format x score student); the plan's "
    "'quality' cites the grid rows and the score student the pipeline calibrates with. "
    "Expert bpw carries over from the mini-K3 (same MXFP4 hi bank, same promoted share at "
    "a given bpw); the real model's KL at that bpw may differ, the ranking is what is used",
]


@dataclass
class PlanRequest:
    ranks: int = FIELDS["size"].default
    budget_per_rank: int | None = None  # weights + KV + activations; None: the box's
    target_expert_bpw: float | None = None  # instead of a budget
    lo: str = "auto"  # a QFormat name, or "auto": the grid's lowest KL at the plan's bytes
    lo_candidates: tuple[str, ...] = ("3bit-g64", "2bit-g32", "2bit-g64", "2bit-g128", "1bit-g64")
    grid: str | None = None  # the quality grid file; None: k3dist/data/quality-grid.json
    nonexpert: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_NONEXPERT))
    nonexpert_from: dict[str, str] = field(default_factory=dict)  # class -> why its format
    # "split" (deploy/tb5.yaml's and every deployment's default: each rank holds its share
    # of the attention heads, k3dist.model.attention) | "replicated"
    attention: str = FIELDS["attention"].default
    lo_fallback: bool = False
    headroom: int = 8 * GiB  # kept free per rank beyond every modelled need
    k_hi_drop_target: float = 1e-5  # k_hi from uniform routing: P(overflow) below this


# the budget flags: exactly one (the plan command alone may give none: auto)
BUDGET_FLAGS = "--budget BYTES (per rank), --budget-total BYTES or --target-bpw BITS"


def _budget(value: str) -> float | None:
    return None if value == "auto" else float(value)


def add_budget_args(parser: argparse.ArgumentParser, *, auto: bool = False) -> None:
    """The budget flags, mutually exclusive; ``auto``: none of them (or ``--budget
    auto``) plans for the box's usable memory. :func:`plan_request` reads them."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument(
        "--budget",
        type=_budget if auto else float,
        help="bytes per rank for weights + KV + activations, e.g. 480e9"
        + ("; auto (default): the box's wired limit less the runtime reserve" if auto else ""),
    )
    g.add_argument("--budget-total", type=float, help="bytes over all ranks")
    g.add_argument("--target-bpw", type=float, help="routed-expert bits per weight")


def plan_request(
    ranks: int,
    budget: float | None = None,
    budget_total: float | None = None,
    target_bpw: float | None = None,
    *,
    auto: bool = False,
    **fields,
) -> PlanRequest:
    """The plan request of the budget flags (:func:`add_budget_args`): exactly one of
    them (none with ``auto``), a total split evenly over ``ranks``; ``fields``: the
    request's other fields. ValueError naming the flags otherwise."""
    given = sum(x is not None for x in (budget, budget_total, target_bpw))
    if given > 1 or (given == 0 and not auto):
        raise ValueError(f"give one of {BUDGET_FLAGS}")
    per_rank = (
        int(budget)
        if budget is not None
        else (int(budget_total) // ranks if budget_total is not None else None)
    )
    return PlanRequest(
        ranks=ranks, budget_per_rank=per_rank, target_expert_bpw=target_bpw, **fields
    )


def overflow_probability(E: int, k: int, promoted: int, k_hi: int) -> float:
    """P(more than ``k_hi`` of a token's ``k`` routes hit ``promoted`` of ``E``
    experts) under uniform routing (hypergeometric)."""
    total = math.comb(E, k)
    return (
        sum(
            math.comb(promoted, j) * math.comb(E - promoted, k - j)
            for j in range(k_hi + 1, min(k, promoted) + 1)
        )
        / total
    )


def k_hi_uniform(E: int, k: int, promoted: int, target: float) -> int:
    """Smallest ``k_hi`` whose uniform-routing overflow probability is below
    ``target``; calibration on real routing replaces it (skew raises it)."""
    for kh in range(0, min(k, promoted) + 1):
        if overflow_probability(E, k, promoted, kh) <= target:
            return kh
    return min(k, promoted)


def _nonexpert_bytes(acc: Accounting, req: PlanRequest) -> dict[str, dict]:
    """Per class: format, build bytes and resident bytes on one rank."""
    out = {}
    for c in CLASSES:
        if c not in acc.tensors:
            continue
        fmt = QFormat.parse(req.nonexpert.get(c, "bf16"))
        nb = acc.class_bytes(c, fmt)
        split = 1
        if c == "shared":
            split = req.ranks  # split by intermediate dim, in the MoE all_sum
        elif c == "attention" and req.attention == "split":
            split = req.ranks
        out[c] = {
            "format": fmt.name,
            "from": req.nonexpert_from.get(c, "default"),
            "bpw": round(fmt.bpw, 4),
            "bytes": nb,
            "per_rank": -(-nb // split),
            "params": acc.classes[c]["params"],
            "source_bytes": acc.classes[c]["source_bytes"],
        }
    small = acc.classes.get("small", {}).get("source_bytes", 0)
    out["small"] = {
        "format": "source",
        "from": "never quantized (norms, biases, convs, A_log, dt_bias, AttnRes)",
        "bytes": small,
        "per_rank": small,
        "params": acc.classes.get("small", {}).get("params", 0),
        "source_bytes": small,
    }
    return out


def _per_layer(total: int, layers: int, ranks: int, cap: int) -> list[int]:
    """``total`` promotions spread over layers, each a multiple of ``ranks`` (hi bytes
    balanced across ranks) and at most ``cap``."""
    per = min(cap, (total // layers) // ranks * ranks)
    counts = [per] * layers
    left = total - per * layers
    i = 0
    while left >= ranks and i < layers:
        if counts[i] + ranks <= cap:
            counts[i] += ranks
            left -= ranks
        i += 1
    return counts


def make_plan(acc: Accounting, box: Box, limits: Limits, req: PlanRequest) -> dict:
    """The plan: lo format, promoted experts per layer, non-expert formats, bytes per
    rank against the box at the serving ``limits``. Raises ValueError (with the numbers)
    when nothing fits."""
    tc, N = acc.tc, req.ranks
    E, L = acc.num_experts, len(acc.moe_layers)
    if not L:
        raise ValueError("the config has no MoE layers; nothing to grade")
    if E % N:
        raise ValueError(f"{E} experts do not split over {N} ranks")
    asplit = N if req.attention == "split" else 1
    kv = kv_state(tc, limits, asplit)
    act = activations(tc, limits, asplit)
    usable = box.usable_bytes
    budget = req.budget_per_rank if req.budget_per_rank is not None else usable
    ne = _nonexpert_bytes(acc, req)
    ne_rank = sum(v["per_rank"] for v in ne.values())
    # a decoded token reads every non-expert byte on its rank but one embedding row
    H = tc["hidden_size"]
    efmt = QFormat.parse(ne["embed"]["format"]) if "embed" in ne else SOURCE
    erow = efmt.nbytes(1, H) if efmt.quantized and efmt.fits(H) else 2 * H
    ne_read = ne_rank - ne.get("embed", {}).get("per_rank", 0) + (erow if "embed" in ne else 0)
    need = kvmemory.need_bytes(kv, act)  # KV held + the larger of prefill / batch join
    fixed = ne_rank + need["total"]
    hi_b = acc.expert_bytes(MXFP4)
    params = acc.expert_params

    def option(fmt: QFormat) -> dict:
        lo_b = acc.expert_bytes(fmt)
        step = hi_b if req.lo_fallback else hi_b - lo_b  # bytes one promotion adds
        base = L * E * lo_b // N
        room = budget - req.headroom - fixed - base
        if req.target_expert_bpw is not None:
            want = (req.target_expert_bpw * params / 8 - lo_b) / (hi_b - lo_b)
            promoted = max(0, min(L * E, int(want * L * E)))
            promoted = promoted // (L * N) * (L * N) if promoted >= L * N else 0
        else:
            promoted = max(0, min(L * E, room * N // step)) if room > 0 else 0
        counts = _per_layer(promoted, L, N, E if req.lo_fallback else E - N)  # lo never empty
        promoted = sum(counts)
        experts_rank = base + promoted * step // N
        fits = fixed + experts_rank <= budget - req.headroom and room >= 0
        expert_bpw = (
            (promoted * hi_b + (L * E - promoted + (promoted if req.lo_fallback else 0)) * lo_b)
            * 8
            / (L * E * params)
        )
        return {
            "lo": fmt.name,
            "lo_bpw": round(fmt.bpw, 4),
            "lo_expert_bytes": lo_b,
            "fits": bool(fits),
            "promoted_total": promoted,
            "promoted_fraction": round(promoted / (L * E), 4),
            "promoted_per_layer": counts,
            "expert_bpw": round(expert_bpw, 4),
            "experts_per_rank": experts_rank,
            "headroom_per_rank": budget - fixed - experts_rank,
        }

    cands = [QFormat.parse(s) for s in req.lo_candidates]
    cands = [f for f in cands if all(f.fits(c) for _, c in acc.expert_mats)]
    options = [option(f) for f in cands]
    grid = QualityGrid.load(req.grid)
    for o in options:
        e = grid.expected(o["lo"], o["expert_bpw"])
        o["expected"] = e.asdict() if e is not None else None
    warning = None
    if req.lo != "auto":
        chosen = option(QFormat.parse(req.lo))
        e = grid.expected(chosen["lo"], chosen["expert_bpw"])
        chosen["expected"] = e.asdict() if e is not None else None
        if e is None:
            near = grid.nearest(chosen["lo"], chosen["expert_bpw"])
            warning = (
                f"--lo {chosen['lo']} at {chosen['expert_bpw']} expert bpw is outside the "
                f"measured quality grid ({grid.summary()['file']}); nearest measured row "
                f"{near.id} ({near.expert_bpw} bpw): KL {near.kl:.4f}, p95 {near.kl_p95:.4f}"
            )
    else:
        fit = [o for o in options if o["fits"]]
        if not fit:
            raise ValueError(
                f"nothing fits {budget} bytes per rank: non-experts {ne_rank}, KV/state "
                f"{kv['total']}, activations {act['total']} (batch join {need['joining']}) leave "
                f"{budget - fixed} for "
                f"routed experts, but the smallest lo format needs "
                f"{min(o['experts_per_rank'] for o in options)}; lower the context, the "
                "batch or the prompt cache, quantize non-experts further or add ranks"
            )
        ok = [o for o in fit if o["expected"] is not None]
        if not ok:
            near = [grid.nearest(o["lo"], o["expert_bpw"]) for o in fit]
            raise ValueError(
                "no lo format that fits lies in the measured quality grid "
                f"({grid.summary()['file']}) at its bytes: "
                + "; ".join(
                    f"{o['lo']} at {o['expert_bpw']} bpw (nearest measured: {r.id})"
                    for o, r in zip(fit, near, strict=True)
                )
                + "; measure it (benchmarks/quality/quality_grid.py) or name the format with --lo"
            )
        chosen = min(ok, key=lambda o: o["expected"]["kl"])
    if not chosen["fits"]:
        raise ValueError(
            f"lo format {chosen['lo']} does not fit {budget} bytes per rank "
            f"(routed experts {chosen['experts_per_rank']} + fixed {fixed}); "
            "choose a smaller --lo or raise --budget"
        )
    k = tc["num_experts_per_token"]
    counts = chosen["promoted_per_layer"]
    k_his = [k_hi_uniform(E, k, c, req.k_hi_drop_target) if c else 0 for c in counts]
    lo_b = chosen["lo_expert_bytes"]
    experts_rank = chosen["experts_per_rank"]
    per_rank = {
        "nonexpert": ne_rank,
        "routed_experts": experts_rank,
        "kv_state": kv["total"],
        "activations": act["total"],
        # the batch-join copy of the caches where it outgrows a prefill chunk (kvmemory)
        "batch_join_extra": need["transient"] - act["total"],
    }
    per_rank["total"] = sum(per_rank.values())
    build_bytes = (
        sum(v["bytes"] for v in ne.values())
        + acc.classes.get("vision", {}).get("source_bytes", 0)
        + sum(counts) * hi_b
        + (L * E - (0 if req.lo_fallback else sum(counts))) * lo_b
    )
    return {
        "ranks": N,
        "box": {
            **asdict(box),
            "usable_wired": usable,
            "os_reserve": box.memory_bytes - box.wired_bytes,
        },
        "limits": asdict(limits),
        "budget_per_rank": budget,
        "attention": req.attention,
        "lo": {"format": chosen["lo"], **QFormat.parse(chosen["lo"]).qconfig()},
        # what the grid measured at these bytes, and the score student the pipeline
        # calibrates with (the grid's best row's; the lo format itself outside the grid)
        "quality": {
            "expected": chosen["expected"],
            "warning": warning,
            "grid": grid.summary(),
        },
        "calib_student": (chosen["expected"] or {}).get("calib_student") or chosen["lo"],
        "hi": {
            "format": "mxfp4",
            **MXFP4.qconfig(),
            "expert_bytes": hi_b,
            "source": "original MXFP4 bytes, bit-exact",
        },
        "lo_fallback": req.lo_fallback,
        "fallback_copy_bytes": sum(counts) * lo_b,
        "promoted_total": sum(counts),
        "promoted_fraction": chosen["promoted_fraction"],
        "promoted_per_layer": dict(zip(map(str, acc.moe_layers), counts, strict=True)),
        "k_hi_uniform": {str(layer): kh for layer, kh in zip(acc.moe_layers, k_his, strict=True)},
        "k_hi_drop_target": req.k_hi_drop_target,
        "expert_bpw": chosen["expert_bpw"],
        "nonexpert": ne,
        "nonexpert_read_per_token_per_rank": ne_read,
        "kv_state": kv,
        "activations": act,
        "bytes_per_rank": per_rank,
        "headroom_per_rank": budget - per_rank["total"],
        "headroom_requested": req.headroom,
        "build_bytes": build_bytes,
        "source_bytes": acc.source_total,
        "routed_expert_params": L * E * acc.expert_params,
        "assumptions": ASSUMPTIONS,
        "alternatives": [
            {k2: v for k2, v in o.items() if k2 != "promoted_per_layer"} for o in options
        ],
    }


def quality_line(plan: dict) -> str:
    """Expected KL / p95 at the plan's bytes from the quality grid, with the rows cited
    (or the warning of a --lo outside it)."""
    q = plan.get("quality") or {}
    e = q.get("expected")
    if e is None:
        return f"quality: outside the measured grid: {q.get('warning')}"
    how = "measured" if e["measured"] else "interpolated"
    return (
        f"quality (mini-K3 grid, {q['grid']['windows_per_domain']} windows/domain): expected "
        f"KL {e['kl']:.4f}, p95 {e['kl_p95']:.4f}, flip {e['flip']:.3f} ({how}: "
        f"{' .. '.join(e['grid_rows'])}); scores from the {e['calib_student']} student"
        + (
            f"; with --dwq KL {d['kl']:.4f}, p95 {d['kl_p95']:.4f} (measured: {d['row']})"
            if (d := e.get("dwq"))
            else ""
        )
    )
