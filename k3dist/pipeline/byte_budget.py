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
from k3dist.pipeline import expert_split
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
    # boxes of different memory, one per rank (ranks follows); None: ``ranks`` x the box
    boxes: tuple[Box, ...] | None = None
    expert_split: str = "memory"  # with boxes: expert_split.SPLITS (its module doc)


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


@dataclass(frozen=True)
class _Fixed:
    """What every rank holds besides routed experts (the same on every box)."""

    nonexpert: dict[str, dict]
    ne_rank: int
    ne_read: int  # non-expert bytes a decoded token reads on a rank
    kv: dict
    act: dict
    need: dict

    @property
    def total(self) -> int:
        return self.ne_rank + self.need["total"]


def _fixed(acc: Accounting, limits: Limits, req: PlanRequest) -> _Fixed:
    tc, N = acc.tc, req.ranks
    asplit = N if req.attention == "split" else 1
    kv = kv_state(tc, limits, asplit)
    act = activations(tc, limits, asplit)
    ne = _nonexpert_bytes(acc, req)
    ne_rank = sum(v["per_rank"] for v in ne.values())
    # a decoded token reads every non-expert byte on its rank but one embedding row
    H = tc["hidden_size"]
    efmt = QFormat.parse(ne["embed"]["format"]) if "embed" in ne else SOURCE
    erow = efmt.nbytes(1, H) if efmt.quantized and efmt.fits(H) else 2 * H
    ne_read = ne_rank - ne.get("embed", {}).get("per_rank", 0) + (erow if "embed" in ne else 0)
    need = kvmemory.need_bytes(kv, act)  # KV held + the larger of prefill / batch join
    return _Fixed(ne, ne_rank, ne_read, kv, act, need)


def _budgets(box: Box, req: PlanRequest) -> tuple[int, ...]:
    """Per rank: what the weights, KV and activations may take."""
    if req.boxes is not None:
        if req.budget_per_rank is not None:
            raise ValueError("--boxes gives each rank its box's budget; drop --budget")
        return tuple(b.usable_bytes for b in req.boxes)
    budget = req.budget_per_rank if req.budget_per_rank is not None else box.usable_bytes
    return (budget,) * req.ranks


def _with_expected(o: dict, grid: QualityGrid) -> dict:
    e = grid.expected(o["lo"], o["expert_bpw"]) or grid.beyond(o["lo"], o["expert_bpw"])
    o["expected"] = e.asdict() if e is not None else None
    return o


def _nothing_fits(options: list[dict], fx: _Fixed, budgets, req: PlanRequest) -> str:
    left = [b - fx.total - req.headroom for b in budgets]
    smallest = min(options, key=lambda o: o["lo_expert_bytes"])
    return (
        f"nothing fits {_gb_list(budgets)} bytes per rank: non-experts {fx.ne_rank}, KV/state "
        f"{fx.kv['total']}, activations {fx.act['total']} (batch join {fx.need['joining']}) "
        f"and headroom {req.headroom} leave {_gb_list(left)} for routed experts "
        f"({sum(left) / 1e9:,.1f} GB over {len(budgets)} ranks), but the smallest lo format "
        f"({smallest['lo']}, nothing promoted) needs {smallest['experts_per_rank']} on the "
        "fullest rank; lower the context, the batch or the prompt cache, quantize "
        "non-experts further or add boxes"
    )


def _gb_list(xs) -> str:
    xs = list(xs)
    return str(xs[0]) if len(set(xs)) == 1 else "/".join(str(x) for x in xs)


def _choose(options: list[dict], fx: _Fixed, budgets, req: PlanRequest, grid: QualityGrid):
    """The auto lo choice: of the options that fit, the lowest expected KL in the grid
    (or past its last row: an upper bound); ValueError with the numbers otherwise."""
    fit = [o for o in options if o["fits"]]
    if not fit:
        raise ValueError(_nothing_fits(options, fx, budgets, req))
    ok = [o for o in fit if o["expected"] is not None]
    if not ok:
        near = [grid.nearest(o["lo"], o["expert_bpw"]) for o in fit]
        lowest = min(r.expert_bpw for r in grid.rows)
        raise ValueError(
            "no lo format that fits lies in the measured quality grid "
            f"({grid.summary()['file']}, lowest measured {lowest} expert bpw) at its bytes: "
            + "; ".join(
                f"{o['lo']} at {o['expert_bpw']} bpw (nearest measured: {r.id})"
                for o, r in zip(fit, near, strict=True)
            )
            + f" with {_gb_list(budgets)} bytes per rank; add memory or boxes, measure it "
            "(benchmarks/quality/quality_grid.py) or name the format with --lo"
        )
    # measured or interpolated before any bound past the grid, then the lowest KL
    return min(ok, key=lambda o: ("extrapolated" in o["expected"], o["expected"]["kl"]))


def _named(opt: dict, grid: QualityGrid) -> str | None:
    """The warning for a --lo outside the grid (None inside it)."""
    if opt["expected"] is not None:
        return None
    near = grid.nearest(opt["lo"], opt["expert_bpw"])
    return (
        f"--lo {opt['lo']} at {opt['expert_bpw']} expert bpw is outside the "
        f"measured quality grid ({grid.summary()['file']}); nearest measured row "
        f"{near.id} ({near.expert_bpw} bpw): KL {near.kl:.4f}, p95 {near.kl_p95:.4f}"
    )


def _per_box(chosen: dict, fx: _Fixed, budgets, req: PlanRequest) -> list[dict]:
    """Bytes each box holds and reads per token (batch 1, uniform routing)."""
    boxes = req.boxes or (None,) * len(budgets)
    out = []
    for r, (b, box) in enumerate(zip(budgets, boxes, strict=True)):
        experts = chosen["per_box_experts"][r]
        read = fx.ne_read + chosen["per_box_expert_read"][r]
        out.append(
            {
                "rank": r,
                "memory_gib": None if box is None else box.memory_bytes / GiB,
                "wired_limit_mb": None if box is None else box.wired_limit_mb,
                "budget": b,
                "routed_experts": experts,
                "hi_experts": chosen["per_box_hi"][r],
                "total": fx.total + experts,
                "headroom": b - fx.total - experts,
                "read_per_token": read,
            }
        )
    mean = sum(x["read_per_token"] for x in out) / len(out)
    for x in out:
        x["read_share_of_mean"] = round(x["read_per_token"] / mean, 4)
    return out


def make_plan(acc: Accounting, box: Box, limits: Limits, req: PlanRequest) -> dict:
    """The plan: lo format, promoted experts per layer, non-expert formats, bytes per
    rank against the box (or ``req.boxes``, one per rank) at the serving ``limits``.
    Raises ValueError (with the numbers) when nothing fits."""
    if req.boxes is not None:
        req = replace(req, ranks=len(req.boxes))
    E, L, N = acc.num_experts, len(acc.moe_layers), req.ranks
    if not L:
        raise ValueError("the config has no MoE layers; nothing to grade")
    if E < N:
        raise ValueError(f"{E} experts cannot give each of {N} ranks one")
    budgets = _budgets(box, req)
    fx = _fixed(acc, limits, req)
    room = expert_split.Room(
        budgets,
        fx.total,
        req.headroom,
        tuple(acc.moe_layers),
        E,
        acc.tc["num_experts_per_token"],
        acc.expert_params,
        acc.expert_bytes(MXFP4),
        req.lo_fallback,
        req.expert_split,
    )
    if not room.even and req.boxes is None:
        raise ValueError(
            f"{E} experts do not split evenly over {N} ranks; name the boxes "
            f"(--boxes, e.g. {','.join(['512'] * N)}) for uneven counts"
        )

    def option(fmt: QFormat) -> dict:
        o = expert_split.option(
            room, acc.expert_bytes(fmt), fmt.name, fmt.bpw, req.target_expert_bpw
        )
        return _with_expected(o, grid)

    grid = QualityGrid.load(req.grid)
    cands = [QFormat.parse(s) for s in req.lo_candidates]
    options = [option(f) for f in cands if all(f.fits(c) for _, c in acc.expert_mats)]
    if req.lo != "auto":
        chosen = option(QFormat.parse(req.lo))
        warning = _named(chosen, grid)
    else:
        chosen, warning = _choose(options, fx, budgets, req, grid), None
    if not chosen["fits"]:
        raise ValueError(
            f"lo format {chosen['lo']} does not fit {_gb_list(budgets)} bytes per rank "
            f"(routed experts {chosen['experts_per_rank']} + fixed {fx.total}); "
            "choose a smaller --lo or raise --budget"
        )
    return _assemble(acc, box, limits, req, fx, chosen, options, warning, grid, budgets)


def _assemble(acc, box, limits, req, fx, chosen, options, warning, grid, budgets) -> dict:
    """The plan's JSON (module doc) for the chosen option."""
    E, L = acc.num_experts, len(acc.moe_layers)
    k = acc.tc["num_experts_per_token"]
    counts = chosen["promoted_per_layer"]
    k_his = [k_hi_uniform(E, k, c, req.k_hi_drop_target) if c else 0 for c in counts]
    lo_b, hi_b = chosen["lo_expert_bytes"], acc.expert_bytes(MXFP4)
    per_box = _per_box(chosen, fx, budgets, req)
    fullest = max(per_box, key=lambda x: x["total"])
    per_rank = {
        "nonexpert": fx.ne_rank,
        "routed_experts": chosen["experts_per_rank"],
        "kv_state": fx.kv["total"],
        "activations": fx.act["total"],
        # the batch-join copy of the caches where it outgrows a prefill chunk (kvmemory)
        "batch_join_extra": fx.need["transient"] - fx.act["total"],
    }
    per_rank["total"] = sum(per_rank.values())
    build_bytes = (
        sum(v["bytes"] for v in fx.nonexpert.values())
        + acc.classes.get("vision", {}).get("source_bytes", 0)
        + sum(counts) * hi_b
        + (L * E - (0 if req.lo_fallback else sum(counts))) * lo_b
    )
    uneven = {}
    if req.boxes is not None:
        uneven = {
            "boxes": [
                {"memory_gib": b.memory_bytes / GiB, "wired_limit_mb": b.wired_limit_mb}
                for b in req.boxes
            ],
            "expert_split": req.expert_split,
            "experts_per_layer_per_rank": {
                str(layer): chosen["counts"][layer] for layer in acc.moe_layers
            },
        }
    return {
        "ranks": req.ranks,
        **uneven,
        "box": {
            **asdict(box),
            "usable_wired": box.usable_bytes,
            "os_reserve": box.memory_bytes - box.wired_bytes,
        },
        "limits": asdict(limits),
        "budget_per_rank": fullest["budget"],
        "attention": req.attention,
        "lo": {"format": chosen["lo"], **QFormat.parse(chosen["lo"]).qconfig()},
        # what the grid measured at these bytes, and the score student the pipeline
        # calibrates with (the grid's best row's; the lo format itself outside the grid)
        "quality": {"expected": chosen["expected"], "warning": warning, "grid": grid.summary()},
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
        "nonexpert": fx.nonexpert,
        "nonexpert_read_per_token_per_rank": fx.ne_read,
        "kv_state": fx.kv,
        "activations": fx.act,
        "bytes_per_rank": per_rank,
        "per_box": per_box,
        # the fullest reader's bytes per token over the mean: what it slows a step by
        "read_ratio": max(x["read_share_of_mean"] for x in per_box),
        "expert_read_ratio": chosen["read_ratio"],
        "headroom_per_rank": min(x["headroom"] for x in per_box),
        "headroom_requested": req.headroom,
        "build_bytes": build_bytes,
        "source_bytes": acc.source_total,
        "routed_expert_params": L * E * acc.expert_params,
        "assumptions": ASSUMPTIONS,
        "alternatives": [
            {
                k2: v
                for k2, v in o.items()
                if not k2.startswith(("promoted_per", "per_box", "counts"))
            }
            for o in options
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
    if "extrapolated" in e:  # past the format's last measured row: that row's, an upper bound
        how = "past the grid, an upper bound from its last row"
    return (
        f"quality (mini-K3 grid, {q['grid']['windows_per_domain']} windows/domain): expected "
        f"KL {'at most ' if 'extrapolated' in e else ''}{e['kl']:.4f}, p95 {e['kl_p95']:.4f}, "
        f"flip {e['flip']:.3f} ({how}: "
        f"{' .. '.join(e['grid_rows'])}); scores from the {e['calib_student']} student"
        + (
            f"; with --dwq KL {d['kl']:.4f}, p95 {d['kl_p95']:.4f} (measured: {d['row']})"
            if (d := e.get("dwq"))
            else ""
        )
    )
