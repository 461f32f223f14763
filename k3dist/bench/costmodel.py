"""Decode cost model for the real K3 on N boxes: per step (one token per request) and rank,
the bytes read, the FLOPs and the collectives of each way to split the model.

Modes (what each rank holds and computes; counts follow the code, not a sketch):

- ``ep-replicated`` (``k3dist.model``): attention, router, latent projections, norms
  and layer 0's dense MLP on every rank; shared experts split by their intermediate
  dimension; routed experts by a placement. One ``all_sum`` per MoE layer of the
  routed latent output (3584) + the shared partial output (7168).
- ``ep-split``: ``ep-replicated`` with attention split by heads as mlx-lm's
  ``kimi_k3.Model.shard`` splits it (KDA q/k/v/g/b/f_b/o projections, convs,
  ``A_log``, ``dt_bias``; MLA q_b/kv_b/g/o) and one more ``all_sum`` (7168) per
  layer after ``o_proj``. Replicated: KDA ``f_a_proj``, ``o_norm``; MLA ``q_a``,
  ``kv_a`` and their norms. Layer 0's dense MLP splits too (gate/up by rows, down_proj
  by its input, one more ``all_sum``): 186 collectives per step, as TP, counted from
  the running model by ``k3dist.serve.introspect`` (mini-K3: 12 = 6 + 5 + 1).
- ``tp`` (mlx-lm ``shard()``): attention as above, shared experts, every routed expert
  (intermediate 3072/N) and the dense MLP split; router, latent projections, norms,
  embedding and ``lm_head`` replicated. Collectives per step: one ``all_sum`` (7168)
  after every attention ``o_proj`` (93: the 69 KDA layers and 24 MLA layers alike),
  one per MoE layer (3584 + 7168, 92), one after the dense MLP (7168, 1): 186.
- ``pp`` (mlx-lm ``KimiK3TextModel.pipeline``): contiguous layer ranges (93 = 47 + 46
  for N = 2, the first range the larger), each rank all experts of its layers.
  Per step: one send/recv per boundary of the hidden state plus the AttnRes blocks
  done so far, then one ``all_gather`` of the output; every rank then runs the final
  norm and ``lm_head`` (in parallel). Decode runs the ranges one after the other.

Equations (per step; ``b`` = bytes at the build profile, ``N`` ranks):

    B_rank   = sum_layers( sum_groups s_g(mode) b_g + R_layer ) + state + head
    R_layer  = EP: E[max_r n_r] b_pair (+ rho b_expert, placeholder form)   [critical path]
               TP: k b_pair / N        PP: k b_pair (on the owning stage)
    F_rank   = 2 x (weight elements multiplied) + attention (MLA over the context, KDA state)
    t_comp   = max(B_rank / (BW eta), F_rank / (P phi))
    t_comm   = sum_c count_c (lambda + wire_c / beta),  wire = 2(N-1)/N size (all_sum),
               size (send), (N-1) size (all_gather)
    t_sync   = n_moe sigma (local form only: one host sync per MoE layer)
    t_step   = t_comp + t_comm + t_sync          (PP: sum over stages + hand-offs + head)
    tok/s    = 1 / t_step

``state`` is the KDA recurrent state (96 x 128 x 128 F32 per layer, split by heads
where attention is) read and written, plus the MLA latent cache (``context`` x 576 x
2 B per MLA layer, whole on every rank). ``s_g`` is 1 (replicated) or 1/N (split) per
tensor group and mode; ``n_r`` is the
number of the step's ``k`` routed pairs rank ``r`` owns: each MoE layer ends in an
``all_sum``, so a step waits for the busiest rank of every layer, E[max_r n_r] (exact
under uniform routing, sampled from routing counts when given). The mean per rank,
``k f_r b_pair`` with ``f_r`` the rank's owned (load-weighted) fraction, is reported
beside it. Placeholder form: every rank computes all ``k`` pairs (FLOPs), the
non-owned ones on one local expert; its weights are read from memory ``rho`` times per
layer (default 1: the redirected pairs run in the same gather kernel over the same
weights, so repeats hit the cache; the expert (17.5 MB) is re-read per layer because
92 of them do not stay cache-resident across a step). Local form: only owned pairs
are computed, after one host sync per MoE layer.

Per-box footprint: the largest rank's resident weights (mlx-lm drops the vision
tower at load) + cache (``batch`` requests at ``context``, not rounded to the cache step,
no prompt cache: what a server must budget is ``k3dist.format.kvmemory.serving_bytes``),
against the box's usable (wired less reserve) bytes. The build's size (``footprint``)
is the sum of every tensor at the profile's bits; for ``mxfp4`` (experts as shipped,
non-experts in their source dtypes) it is the source's 1,560,860,324,864 bytes.

Batch (``batch`` requests decoded in lockstep, one step each): weights are read once
per step, the routed experts read are the union of the batch's (sampled: B tokens, k
experts each, uniformly or from routing counts), FLOPs, caches, states and collective
payloads scale with B (latency is paid once); ``tok_s`` is then the aggregate.

Nothing overlaps in this model: collectives sit between dependent layers, and memory
and compute time are a roofline maximum. Prefill and the KV growth during a step are
not modelled; ``context`` sets the MLA latent cache read per step (per request).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from k3dist.config.box import SOURCES as BOX_SOURCES
from k3dist.config.box import Box
from k3dist.format import kvmemory, layout
from k3dist.format.placement import Placement, contiguous
from k3dist.model.forms import MOE_FORMS

import numpy as np

MODES = ("ep-replicated", "ep-split", "tp", "pp")
EP_MODES = ("ep-replicated", "ep-split")
FORMS = MOE_FORMS
ACT_BYTES = 2  # bf16 activations on the wire (the build's dtype)

# Tensor groups of a decoder layer and whether each mode splits them over ranks.
GROUPS = ("attn_heads", "attn_rep", "norms", "dense_mlp", "router", "latent", "shared")
SPLIT = {
    "ep-replicated": {"shared"},
    "ep-split": {"attn_heads", "shared", "dense_mlp"},
    "tp": {"attn_heads", "shared", "dense_mlp"},
    "pp": set(),
}
# Attention modules mlx-lm's shard() splits by heads (q/k/v fused as qkv_proj there).
_HEAD_SPLIT = {
    "q_proj",
    "k_proj",
    "v_proj",
    "q_conv1d",
    "k_conv1d",
    "v_conv1d",
    "A_log",
    "dt_bias",
    "b_proj",
    "f_b_proj",
    "g_proj",
    "g_b_proj",
    "o_proj",
    "q_b_proj",
    "kv_b_proj",
}


@dataclass(frozen=True)
class Backend:
    name: str
    latency_s: float  # per collective, as a decode step sees it
    bandwidth: float  # bytes/s on the wire
    source: str


BACKENDS = {
    "jaccl": Backend(
        "jaccl",
        50e-6,
        6.3e9,
        "assumed: 27-31 us and 6.1-6.5 GB/s measured for JACCL RDMA over a direct TB5 cable "
        "(M3 Ultra <-> M5 Max, jundot/omlx PR #3118) + ~20 us assumed for MLX's GPU->CPU "
        "hand-off around each collective",
    ),
    "ring": Backend(
        "ring",
        600e-6,
        2.5e9,
        "assumed: ~1 round trip over the Thunderbolt IP bridge (ping 0.38-0.95 ms between "
        "M3 Ultras, exo-explore/exo issue #2295) + MLX's ring software path (0.07-0.13 ms "
        "median per all_sum over loopback here, heavy tails under load: benchmarks/"
        "project.py --calibrate); wire bandwidth assumed (TB5 is 80 Gb/s "
        "= 10 GB/s raw; TCP gets less)",
    ),
}


@dataclass(frozen=True)
class Hardware:
    """One box (``k3dist.config.box.Box``: memory, bandwidth, compute) and its link,
    with what decode achieves of it. Defaults: M3 Ultra (80-core GPU, 512 GB) over TB5."""

    box: Box = Box()
    bw_fraction: float = 0.6  # achieved by decode kernels (see SOURCES)
    flops_fraction: float = 0.5  # assumed; decode at batch 1 is far from this bound
    backend: Backend = BACKENDS["jaccl"]
    sync_s: float = 1.0e-3  # host sync per MoE layer (local form): assumed
    placeholder_reads: float = 1.0  # memory reads of the redirect expert per layer

    @property
    def mem_bw(self) -> float:
        return self.box.mem_bw

    @property
    def flops(self) -> float:
        return self.box.flops

    @property
    def usable_memory(self) -> int:
        return self.box.usable_bytes


SOURCES = {
    **{f"box.{k}": v for k, v in BOX_SOURCES.items()},
    "bw_fraction": "derived, not K3: mlx decodes llama-3.1-8b-4bit at 119 tok/s on an M3 "
    "Ultra (raullenchai/Rapid-MLX PR #586): ~4.2 GB/token x 119 = 0.50 TB/s "
    "= 0.61 of 819 GB/s, a dense-model figure that K3's MoE gathers and KDA "
    "kernels may not reach. Not calibratable here: this machine's MLX CPU "
    "matvecs are compute-bound (see measured_here). The anchors' implied "
    "values are reported beside it",
    "flops_fraction": "assumed",
    "sync_s": "assumed: one host sync per MoE layer drains the GPU queue and serialises "
    "graph building; ~1 ms is what the published graded build's 2.06x loss on "
    "Metal implies at ~90 ms/step over 92 layers ((2.06-1) x 90 / 92)",
    "placeholder_reads": "assumed: the redirect expert is read from memory once per layer "
    "(repeats within the gather kernel hit the cache; 92 x 17.5 MB "
    "do not stay resident across a step)",
    "link": "spec: Thunderbolt 5, 80 Gb/s (10 GB/s) each way per port",
}


@dataclass(frozen=True)
class Profile:
    """Bits per weight of a build, scales included."""

    name: str
    expert_bits: float = 4.25  # hi bank: MXFP4, 4 bits + one 8-bit scale per 32
    lo_bits: float = 2.5  # lo bank: 2-bit affine, group 64, bf16 scale + bias
    hi_fraction: float = 1.0  # share of experts kept at expert_bits
    hi_pair_fraction: float | None = None  # share of routed pairs on hi (None: hi_fraction)
    nonexpert_bits: int = 16  # 16: source dtypes (bf16/F32); 8 or 4: affine
    group_size: int = 64
    router_bits: int = 8  # mlx-lm's quant_predicate keeps the router at 8-bit
    # per non-expert class (the planner's: attention, shared, latent, router, dense_mlp,
    # embed, lm_head) -> bits (16: source dtype); overrides nonexpert_bits/router_bits
    class_bits: tuple[tuple[str, int], ...] | None = None
    source: str = "assumed"  # where the numbers come from

    def __post_init__(self):
        if self.nonexpert_bits not in (16, 8, 4):
            raise ValueError(f"nonexpert_bits must be 16, 8 or 4, not {self.nonexpert_bits}")
        for f in ("hi_fraction", "hi_pair_fraction"):
            v = getattr(self, f)
            if v is not None and not 0 <= v <= 1:
                raise ValueError(f"{f} must be in [0, 1], not {v}")

    def affine_bits(self, bits: int) -> float:
        return bits + 32 / self.group_size  # bf16 scale and bias per group

    @property
    def expert_store_bits(self) -> float:
        return self.hi_fraction * self.expert_bits + (1 - self.hi_fraction) * self.lo_bits

    @property
    def expert_pair_bits(self) -> float:
        f = self.hi_fraction if self.hi_pair_fraction is None else self.hi_pair_fraction
        return f * self.expert_bits + (1 - f) * self.lo_bits


def plan_profile(plan: dict, name: str | None = None, source: str = "") -> Profile:
    """A build plan (``python -m k3dist.pipeline.plan --json``, one attention mode) as a
    profile: its promoted fraction on the hi bank (MXFP4), its lo format, and each
    non-expert class at its planned bits. Routed pairs land on hi in proportion to the
    promoted fraction (calibrated promotion puts more there: this is a floor)."""
    lo = plan["lo"]
    if lo["mode"] != "affine":
        raise ValueError(f"plan lo format {lo['format']}: the cost model reads affine lo banks")
    classes = []
    for cls, v in plan["nonexpert"].items():
        fmt = v["format"]
        if cls == "small":
            continue  # norms, biases, convolutions: kept in their source dtypes
        classes.append((cls, 16 if fmt == "source" else int(fmt.split("bit")[0])))
    return Profile(
        name or f"plan-{plan['attention']}",
        hi_fraction=plan["promoted_fraction"],
        lo_bits=lo["bits"] + 32 / lo["group_size"],
        group_size=lo["group_size"],
        class_bits=tuple(classes),
        source=source or "plan",
    )


PROFILES = {
    "mxfp4": Profile("mxfp4"),
    "mxfp4-ne8": Profile("mxfp4-ne8", nonexpert_bits=8),
    "mxfp4-ne4": Profile("mxfp4-ne4", nonexpert_bits=4),
    # Assumed split (the published graded build's is not given here), sized to fit two
    # 512 GB boxes in every mode: 10% of experts mxfp4, the rest 2-bit affine at group
    # 128 (2.25 bits/weight; group 64's 2.5 does not fit beside 8-bit non-experts).
    "graded": Profile("graded", hi_fraction=0.1, lo_bits=2.25, nonexpert_bits=8),
}


# ---------------------------------------------------------------- model facts


@dataclass
class Layer:
    index: int
    attention: str  # "kda" | "mla"
    moe: bool
    bytes: dict[str, float]  # group -> bytes at the profile
    elems: dict[str, float]  # group -> weight elements in matmuls (FLOPs = 2x)
    state_bytes: float  # KDA recurrent + conv state (read and written each step)
    cache_bytes_per_token: float  # MLA latent cache per context token


@dataclass
class Facts:
    """The real model's sizes at a profile, from ``layout`` (no tensor is read)."""

    tc: dict
    profile: Profile
    layers: list[Layer]
    head: dict[str, float]  # embed (table), embed_row, lm_head, norms: bytes
    head_elems: float  # lm_head elements (the embedding is a lookup)
    vision_bytes: float
    expert_elems: int  # one routed expert (w1 + w2 + w3)
    num_experts: int
    top_k: int

    @property
    def moe_layers(self) -> list[int]:
        return [L.index for L in self.layers if L.moe]  # of these layers (layout's test)

    @property
    def expert_bytes(self) -> float:  # one expert, as stored (mean over banks)
        return self.expert_elems * self.profile.expert_store_bits / 8

    @property
    def pair_bytes(self) -> float:  # one routed pair, expected over banks
        return self.expert_elems * self.profile.expert_pair_bits / 8


# layout family -> the planner's non-expert class
_CLASS = {
    "kda": "attention",
    "mla": "attention",
    "shared_experts": "shared",
    "latent": "latent",
    "router": "router",
    "dense_mlp": "dense_mlp",
}


def _tensor_bytes(s: layout.TensorSpec, p: Profile) -> float:
    if (
        s.family in ("norm", "attn_res", "vision")
        or s.shape is None
        or len(s.shape) != 2
        or s.shape[-1] % p.group_size
        or s.shape[0] == 1
    ):
        return s.nbytes
    if p.class_bits is not None:
        cls = (
            ("lm_head" if s.name.endswith("lm_head.weight") else "embed")
            if s.family == "embed"
            else _CLASS.get(s.family)
        )
        bits = dict(p.class_bits).get(cls, 16)
    elif p.nonexpert_bits == 16:
        return s.nbytes
    else:
        bits = p.router_bits if s.family == "router" else p.nonexpert_bits
    return s.nbytes if bits == 16 else s.shape[0] * s.shape[1] * p.affine_bits(bits) / 8


def _group(s: layout.TensorSpec) -> str:
    if s.family in ("kda", "mla"):
        module = s.name.split("self_attn.")[1].split(".")[0]
        return "attn_heads" if module in _HEAD_SPLIT else "attn_rep"
    return {
        "norm": "norms",
        "attn_res": "norms",
        "dense_mlp": "dense_mlp",
        "router": "router",
        "latent": "latent",
        "shared_experts": "shared",
    }[s.family]


def facts(config: dict, profile: Profile) -> Facts:
    tc = layout.text_config(config)
    kda = layout.kda_layers(tc)
    # one request's per-layer cache and state: the arithmetic preflight and the planner
    # budget with (k3dist.format.kvmemory)
    kda_state = kvmemory.kda_layer_state_bytes(tc, ACT_BYTES)
    mla_cache = kvmemory.mla_layer_bytes_per_token(tc, ACT_BYTES)
    layers = []
    for i in range(tc["num_hidden_layers"]):
        b = dict.fromkeys(GROUPS, 0.0)
        e = dict.fromkeys(GROUPS, 0.0)
        for s in layout.layer_specs(tc, i, with_experts=False):
            g = _group(s)
            b[g] += _tensor_bytes(s, profile)
            if len(s.shape) == 2 and s.shape[0] > 1 and s.family not in ("norm", "attn_res"):
                e[g] += s.shape[0] * s.shape[1]
        if i in kda:
            state, cache = kda_state, 0.0
        else:
            state, cache = 0.0, mla_cache
        layers.append(
            Layer(i, "kda" if i in kda else "mla", layout.is_moe_layer(tc, i), b, e, state, cache)
        )
    head = {"embed": 0.0, "embed_row": 0.0, "lm_head": 0.0, "norms": 0.0}
    head_elems = 0.0
    for s in layout.head_specs(tc):
        nb = _tensor_bytes(s, profile)
        if s.name.endswith("embed_tokens.weight"):
            head["embed"] += nb
            head["embed_row"] += nb / s.shape[0]
        elif s.name.endswith("lm_head.weight"):
            head["lm_head"] += nb
            head_elems += s.shape[0] * s.shape[1]
        else:
            head["norms"] += nb
    if tc.get("tie_word_embeddings", False):  # lm_head reads the embedding table
        head["lm_head"] = head["embed"]
        head_elems = tc["vocab_size"] * tc["hidden_size"]
    vision = sum(s.nbytes for s in layout.vision_specs(config))
    moe = layout.moe_layers(tc)[0]
    elems = sum(
        s.shape[0] * s.shape[1] * (2 if s.name.endswith("weight_packed") else 0)
        for s in layout.expert_specs(tc, moe, 0)
    )
    return Facts(
        tc,
        profile,
        layers,
        head,
        head_elems,
        vision,
        elems,
        tc["num_experts"],
        tc["num_experts_per_token"],
    )


def footprint(config: dict, profile: Profile) -> dict:
    """Bytes of the whole build (as written: vision tower included) by family."""
    f = facts(config, profile)
    by = {g: sum(L.bytes[g] for L in f.layers) for g in GROUPS}
    by["routed_experts"] = len(f.moe_layers) * f.num_experts * f.expert_bytes
    by["embed"], by["lm_head"] = f.head["embed"], f.head["lm_head"]
    by["head_norms"] = f.head["norms"]
    by["vision"] = f.vision_bytes
    total = sum(by.values())
    return {
        "profile": asdict(profile),
        "build_bytes": total,
        "build_TB": round(total / 1e12, 4),
        "by_group": by,
        "one_expert_bytes": f.expert_bytes,
    }


# ---------------------------------------------------------------- routing loads


@dataclass(frozen=True)
class Load:
    """Routed experts per rank in one MoE layer, per step. At batch 1 a token's ``k``
    experts are distinct, so experts read = pairs computed; at batch B the step reads
    the union of the B tokens' experts and computes B k pairs."""

    mean: tuple[float, ...]  # expected experts read on each rank
    max: float  # expected experts read on the busiest rank (the step's critical path)
    pairs_max: float | None = None  # pairs computed on the busiest rank (None: ``max``)
    distinct: float | None = None  # experts read over all ranks (None: k)


def _uniform_load(owned: list[int], k: int) -> Load:
    """Exact under uniform routing: k distinct experts drawn at random; the number on
    each rank is multivariate hypergeometric. E[max] = sum_m P(max > m)."""
    E = sum(owned)
    total = math.comb(E, k)
    emax = 0.0
    for m in range(k):
        poly = [1]  # ways to pick j experts with every rank <= m
        for c in owned:
            term = [math.comb(c, j) for j in range(min(m, c) + 1)]
            out = [0] * min(len(poly) + len(term) - 1, k + 1)
            for a, x in enumerate(poly):
                for b, y in enumerate(term):
                    if a + b <= k:
                        out[a + b] += x * y
            poly = out
        le = poly[k] if len(poly) > k else 0
        emax += 1 - le / total
    return Load(tuple(k * c / E for c in owned), emax)


def _sampled_load(
    pl: Placement, layer: int, counts: np.ndarray, k: int, samples: int, seed: int
) -> Load:
    """Tokens drawn without replacement proportionally to routing counts (Gumbel top-k)."""
    rng = np.random.default_rng(seed + layer)
    p = np.asarray(counts, dtype=np.float64) + 1e-9
    keys = np.log(p / p.sum()) + rng.gumbel(size=(samples, len(p)))
    sel = np.argpartition(-keys, k - 1, axis=-1)[:, :k]
    owner = np.asarray(pl.owners[layer])[sel]
    mean = tuple(float((owner == r).sum(-1).mean()) for r in range(pl.size))
    return Load(mean, pl.expected_max_load(layer, sel))


def _batch_load(
    pl: Placement,
    layer: int,
    counts: np.ndarray | None,
    k: int,
    batch: int,
    samples: int,
    seed: int,
) -> Load:
    """B tokens per step, each drawing k experts without replacement (proportionally to
    routing counts, or uniformly): the union each rank reads, the pairs it computes."""
    rng = np.random.default_rng(seed + layer)
    E = pl.num_experts
    p = np.ones(E) if counts is None else np.asarray(counts, dtype=np.float64) + 1e-9
    keys = np.log(p / p.sum()) + rng.gumbel(size=(samples, batch, E))
    sel = np.argpartition(-keys, k - 1, axis=-1)[..., :k]  # [samples, B, k]
    touched = np.zeros((samples, E), dtype=bool)
    np.put_along_axis(touched, sel.reshape(samples, -1), True, axis=-1)
    owners = np.asarray(pl.owners[layer])
    read = np.stack([touched[:, owners == r].sum(-1) for r in range(pl.size)], -1)
    pairs = np.stack([(owners[sel] == r).sum((-1, -2)) for r in range(pl.size)], -1)
    return Load(
        tuple(float(x) for x in read.mean(0)),
        float(read.max(-1).mean()),
        float(pairs.max(-1).mean()),
        float(touched.sum(-1).mean()),
    )


def routed_loads(
    f: Facts,
    size: int,
    pl: Placement | None = None,
    counts: dict[int, np.ndarray] | None = None,
    samples: int = 2048,
    seed: int = 0,
    batch: int = 1,
    skew: dict[str, float] | None = None,
) -> dict[int, Load]:
    """Per MoE layer: experts per rank under EP. Uniform routing unless counts are
    given; batch > 1 is sampled (``samples`` steps). ``skew`` (``benchmarks/routing.py``:
    measured over uniform on real routing; keys ``skew``, ``skew_pairs``, ``skew_union``)
    scales the busiest rank's experts read, its pairs and the experts read in all."""
    out = _routed_loads(f, size, pl, counts, samples, seed, batch)
    if not skew:
        return out
    k = f.top_k
    return {
        i: Load(
            v.mean,
            min(v.max * skew["skew"], batch * k),
            min((v.max if v.pairs_max is None else v.pairs_max) * skew["skew_pairs"], batch * k),
            min((k if v.distinct is None else v.distinct) * skew["skew_union"], batch * k),
        )
        for i, v in out.items()
    }


def _routed_loads(
    f: Facts, size: int, pl: Placement | None, counts, samples: int, seed: int, batch: int
) -> dict[int, Load]:
    moe = f.moe_layers
    pl = pl or contiguous(f.num_experts, size, moe)
    if pl.size != size:
        raise ValueError(f"placement is for {pl.size} ranks, not {size}")
    out, cache = {}, {}
    if batch > 1:
        n = max(64, samples // batch)
        for i in moe:
            out[i] = _batch_load(
                pl, i, None if counts is None else counts[i], f.top_k, batch, n, seed
            )
        return out
    for i in moe:
        if counts is not None:
            out[i] = _sampled_load(pl, i, counts[i], f.top_k, samples, seed)
            continue
        owned = tuple(int(c) for c in np.bincount(pl.owners[i], minlength=size))
        if owned not in cache:
            cache[owned] = _uniform_load(list(owned), f.top_k)
        out[i] = cache[owned]
    return out


# ---------------------------------------------------------------- one step


def shared_splits(f: Facts, size: int) -> bool:
    """Whether EP splits the shared experts (model.experts.ExpertParallelMoE.shard_shared)."""
    inter = f.tc["moe_intermediate_size"] * (f.tc.get("num_shared_experts") or 0)
    if not inter or inter % size:
        return False
    return f.profile.nonexpert_bits == 16 or (inter // size) % f.profile.group_size == 0


def _split(mode: str, group: str, f: Facts, size: int) -> float:
    if group not in SPLIT[mode] or size == 1:
        return 1.0
    if group == "shared" and mode in EP_MODES and not shared_splits(f, size):
        return 1.0
    return 1.0 / size


def _layer_step(
    f: Facts,
    L: Layer,
    mode: str,
    size: int,
    load: Load | None,
    form: str,
    hw: Hardware,
    context: int,
    batch: int = 1,
) -> dict:
    """Bytes (by group) and FLOPs one rank spends on one layer, on the critical path.
    Weights are read once per step whatever the batch; caches, states and FLOPs scale
    with it."""
    by = {g: L.bytes[g] * _split(mode, g, f, size) for g in GROUPS}
    flops = batch * sum(2 * L.elems[g] * _split(mode, g, f, size) for g in GROUPS)
    heads = _split(mode, "attn_heads", f, size)
    by["state"] = batch * (2 * L.state_bytes * heads + L.cache_bytes_per_token * context)
    if L.attention == "mla":
        tc = f.tc
        lat = tc["kv_lora_rank"]
        flops += (
            batch
            * 2
            * tc["num_attention_heads"]
            * heads
            * context
            * (lat + tc["qk_rope_head_dim"] + lat)
        )
    else:
        lc = f.tc["linear_attn_config"]
        flops += batch * 8 * lc["num_heads"] * heads * lc["head_dim"] ** 2
    by["routed_experts"] = by["routed_experts_mean"] = by["placeholder"] = 0.0
    if L.moe:
        k, pair, expert_flops = f.top_k, f.pair_bytes, 2 * f.expert_elems
        distinct = k if load is None or load.distinct is None else load.distinct
        if mode in EP_MODES and size > 1:
            by["routed_experts"] = load.max * pair
            by["routed_experts_mean"] = max(load.mean) * pair
            if form == "placeholder":
                by["placeholder"] = hw.placeholder_reads * f.expert_bytes
                flops += batch * k * expert_flops
            else:
                pairs = load.max if load.pairs_max is None else load.pairs_max
                flops += pairs * expert_flops
        elif mode == "tp":
            by["routed_experts"] = by["routed_experts_mean"] = distinct * pair / size
            flops += batch * k * expert_flops / size
        else:  # pp, or a single rank
            by["routed_experts"] = by["routed_experts_mean"] = distinct * pair
            flops += batch * k * expert_flops
    return {"bytes": by, "flops": flops}


def _collective(op: str, count: int, size_bytes: float, n: int, hw: Hardware) -> dict:
    wire = {
        "all_sum": 2 * (n - 1) / n * size_bytes,
        "send": size_bytes,
        "all_gather": (n - 1) * size_bytes,
    }[op]
    each = hw.backend.latency_s + wire / hw.backend.bandwidth
    return {
        "op": op,
        "count": count,
        "bytes": size_bytes,
        "wire_bytes": wire,
        "each_s": each,
        "total_s": count * each,
    }


def collectives(f: Facts, mode: str, size: int, hw: Hardware, batch: int = 1) -> list[dict]:
    """Per step; payloads carry ``batch`` rows (the latency is paid once)."""
    if size == 1:
        return []
    tc = f.tc
    H, latent = tc["hidden_size"], tc.get("routed_expert_hidden_size") or tc["hidden_size"]
    H, latent = H * batch, latent * batch
    n_layers, n_moe = len(f.layers), len(f.moe_layers)
    n_dense = n_layers - n_moe
    shared = tc.get("num_shared_experts") and (mode == "tp" or shared_splits(f, size))
    moe_size = ACT_BYTES * (latent + (H if shared else 0))
    out = []
    if mode in ("ep-split", "tp"):
        out.append(
            _collective("all_sum", n_layers, ACT_BYTES * H, size, hw)
            | {"what": "attention o_proj partial sums"}
        )
    if mode in EP_MODES + ("tp",):
        out.append(
            _collective("all_sum", n_moe, moe_size, size, hw)
            | {"what": "MoE: routed latent" + (" + shared partial" if shared else "")}
        )
    if mode in ("tp", "ep-split") and n_dense:
        out.append(
            _collective("all_sum", n_dense, ACT_BYTES * H, size, hw)
            | {"what": "dense MLP down_proj partial sums"}
        )
    if mode == "pp":
        block = tc.get("attn_res_block_size")
        for start, _ in pp_stages(n_layers, size)[1:]:
            rows = 1 + (math.ceil(start / block) if block else 0)
            out.append(
                _collective("send", 1, ACT_BYTES * H * rows, size, hw)
                | {"what": f"hand-off into layer {start}: hidden + {rows - 1} AttnRes blocks"}
            )
        out.append(
            _collective("all_gather", 1, ACT_BYTES * H, size, hw)
            | {"what": "pipeline output to every rank"}
        )
    return out


def pp_stages(n_layers: int, size: int) -> list[tuple[int, int]]:
    """[start, end) per stage in layer order, as mlx-lm's kimi_k3 pipeline() splits."""
    base, extra = divmod(n_layers, size)
    out = []
    for seg in range(size):
        start = seg * base + min(seg, extra)
        out.append((start, start + base + (1 if seg < extra else 0)))
    return out


def _sum_bytes(parts: list[dict]) -> dict:
    out: dict[str, float] = {}
    for p in parts:
        for g, v in p["bytes"].items():
            out[g] = out.get(g, 0.0) + v
    return out


def _compute_time(nbytes: float, flops: float, hw: Hardware) -> dict:
    mem = nbytes / (hw.mem_bw * hw.bw_fraction)
    fl = flops / (hw.flops * hw.flops_fraction)
    return {"memory_s": mem, "flops_s": fl, "compute_s": max(mem, fl)}


def _critical(by: dict) -> float:
    return sum(v for g, v in by.items() if g != "routed_experts_mean")


def bytes_per_token(
    mode: str,
    f: Facts,
    size: int,
    hw: Hardware = Hardware(),
    form: str = "placeholder",
    loads: dict[int, Load] | None = None,
    context: int = 4096,
    batch: int = 1,
) -> dict:
    """Per rank per step of ``batch`` requests in lockstep: bytes by group, FLOPs,
    collectives and time; ``tok_s`` is the aggregate (``batch`` / step time),
    ``tok_s_per_request`` one request's. For PP the stages run one after the other
    and each is listed (no micro-batching: mlx-lm's pipeline has none)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, not {form!r}")
    if loads is None and (batch > 1 or (mode in EP_MODES and size > 1)):
        loads = routed_loads(f, size, batch=batch)
    head = {
        "embed_row": batch * f.head["embed_row"],
        "lm_head": f.head["lm_head"],
        "head_norms": f.head["norms"],
    }
    head_flops = batch * 2 * f.head_elems
    colls = collectives(f, mode, size, hw, batch)
    comm = sum(c["total_s"] for c in colls)
    sync = (
        hw.sync_s * len(f.moe_layers)
        if (mode in EP_MODES and form == "local" and size > 1)
        else 0.0
    )
    stage_ranges = pp_stages(len(f.layers), size) if mode == "pp" else [(0, len(f.layers))]
    stages = []
    for start, end in stage_ranges:
        parts = [
            _layer_step(f, L, mode, size, (loads or {}).get(L.index), form, hw, context, batch)
            for L in f.layers[start:end]
        ]
        by = _sum_bytes(parts)
        flops = sum(p["flops"] for p in parts)
        stages.append(
            {
                "layers": [start, end],
                "bytes": by,
                "flops": flops,
                **_compute_time(_critical(by), flops, hw),
            }
        )
    # The head (embedding row, final norm, lm_head) runs on every rank, in parallel.
    head_time = _compute_time(sum(head.values()), head_flops, hw)
    compute = sum(s["compute_s"] for s in stages) + head_time["compute_s"]
    total = compute + comm + sync
    crit = _critical(_sum_bytes(stages)) + sum(head.values())
    out = {
        "mode": mode,
        "form": form if mode in EP_MODES and size > 1 else None,
        "size": size,
        "batch": batch,
        "bytes": {k: round(v) for k, v in (_sum_bytes(stages) | head).items()},
        "bytes_critical_path": round(crit),
        "flops": sum(s["flops"] for s in stages) + head_flops,
        "collectives": colls,
        "n_collectives": sum(c["count"] for c in colls),
        "time_s": {
            "memory": sum(s["memory_s"] for s in stages) + head_time["memory_s"],
            "flops": sum(s["flops_s"] for s in stages) + head_time["flops_s"],
            "compute": compute,
            "comm": comm,
            "sync": sync,
            "total": total,
        },
        "tok_s": batch / total,
        "tok_s_per_request": 1 / total,
        "achieved_GBps": crit / total / 1e9,
    }
    if mode == "pp":
        out["stages"] = [
            {
                "layers": s["layers"],
                "bytes": round(_critical(s["bytes"])),
                "routed_experts": round(s["bytes"]["routed_experts"]),
                "compute_s": s["compute_s"],
            }
            for s in stages
        ]
        out["head_compute_s"] = head_time["compute_s"]
    return out


def box_footprint(mode: str, f: Facts, size: int, context: int = 4096, batch: int = 1) -> dict:
    """Resident bytes per box (the largest rank): weights as loaded (mlx-lm drops the
    vision tower), MLA latent cache at ``context`` and KDA state."""
    head = f.head["embed"] + f.head["lm_head"] + f.head["norms"]
    experts_per_layer = f.num_experts * f.expert_bytes
    if mode in EP_MODES or mode == "tp":
        layers = f.layers
        experts = len(f.moe_layers) * experts_per_layer / size
    else:
        lo, hi = max(pp_stages(len(f.layers), size), key=lambda r: r[1] - r[0])
        layers = f.layers[lo:hi]
        experts = sum(L.moe for L in layers) * experts_per_layer
    weights = sum(L.bytes[g] * _split(mode, g, f, size) for L in layers for g in GROUPS)
    heads = _split(mode, "attn_heads", f, size)
    cache = batch * sum(L.state_bytes * heads + L.cache_bytes_per_token * context for L in layers)
    total = weights + experts + head + cache
    return {
        "weights_nonexpert": round(weights + head),
        "routed_experts": round(experts),
        "cache": round(cache),
        "total": round(total),
        "total_GB": round(total / 1e9, 1),
    }


def attention_bytes(config: dict, profile: Profile, size: int = 2) -> dict:
    """Attention weight bytes one rank holds, and reads every decode token, with
    attention replicated and split over ``size`` ranks (heads split in the layers whose
    heads divide evenly, as ``layout.split_layers``; the rest replicated), and each
    box's resident total in both EP modes."""
    f = facts(config, profile)
    rep = split = 0.0
    for L in f.layers:
        divides = layout.attention_heads(f.tc, L.index) % size == 0
        rep += L.bytes["attn_heads"] + L.bytes["attn_rep"]
        split += L.bytes["attn_heads"] / (size if divides else 1) + L.bytes["attn_rep"]
    return {
        "size": size,
        "profile": profile.name,
        "attention_replicated": round(rep),
        "attention_split": round(split),
        "saved_bytes": round(rep - split),
        "saved_fraction_of_attention": round((rep - split) / rep, 4),
        "box_total": {m: box_footprint(m, f, size)["total"] for m in EP_MODES},
    }


# ---------------------------------------------------------------- projection

ANCHORS = (
    {
        "name": "Alis two-box EP (attention TP + jaccl)",
        "tok_s": 8.8,
        "mode": "ep-split",
        "backends": ("jaccl",),
        "size": 2,
    },
    {
        "name": "PipeNetwork TP",
        "tok_s": 3.6,
        "mode": "tp",
        "backends": ("ring", "jaccl"),
        "size": 2,
    },
    {
        "name": "PipeNetwork PP",
        "tok_s": 2.13,
        "mode": "pp",
        "backends": ("ring", "jaccl"),
        "size": 2,
    },
)


GRADED_LOCAL_LOSS = 2.06  # decode slowdown of the local form on Metal (published graded build)


def implied(step: dict, tok_s: float, hw: Hardware) -> dict:
    """What the anchor's speed implies, holding everything else: the achieved
    bandwidth fraction (memory-bound), or the per-collective latency."""
    t = 1 / tok_s
    other = step["time_s"]["comm"] + step["time_s"]["sync"]
    mem = t - other
    frac = step["bytes_critical_path"] / (hw.mem_bw * mem) if mem > 0 else None
    n = step["n_collectives"]
    wire = sum(c["count"] * c["wire_bytes"] for c in step["collectives"]) / hw.backend.bandwidth
    lat = (t - step["time_s"]["compute"] - step["time_s"]["sync"] - wire) / n if n else None
    return {
        "bw_fraction": None if frac is None else round(frac, 3),
        "latency_us": None if lat is None else round(lat * 1e6, 1),
    }


def project(
    config: dict,
    profile: Profile,
    hw: Hardware,
    size: int = 2,
    modes: tuple[str, ...] = MODES,
    form: str = "placeholder",
    context: int = 4096,
    placement: Placement | None = None,
    counts: dict[int, np.ndarray] | None = None,
    batch: int = 1,
    skew: dict[str, float] | None = None,
) -> dict:
    """Projected decode speed per mode (``batch`` requests in lockstep), with its
    breakdown and per-box footprint (the MLA cache of every request)."""
    f = facts(config, profile)
    loads = (
        routed_loads(f, size, placement, counts, batch=batch, skew=skew)
        if (size > 1 or batch > 1)
        else None
    )
    out = {}
    for mode in modes:
        forms = FORMS if mode in EP_MODES and size > 1 else (form,)
        res = {fm: bytes_per_token(mode, f, size, hw, fm, loads, context, batch) for fm in forms}
        head = res[form] if form in res else next(iter(res.values()))
        fp = box_footprint(mode, f, size, context, batch)
        fp["fits"] = fp["total"] <= hw.usable_memory
        out[mode] = {**head, "footprint_per_box": fp}
        if len(res) > 1:
            out[mode]["forms"] = {
                fm: {
                    "tok_s": r["tok_s"],
                    "time_s": r["time_s"],
                    "bytes_critical_path": r["bytes_critical_path"],
                    "flops": r["flops"],
                }
                for fm, r in res.items()
            }
            # The host-sync cost per layer at which local would run 2.06x slower than
            # placeholder (the published graded build's loss on Metal).
            ph, lo = res["placeholder"]["time_s"], res["local"]["time_s"]
            sync = (GRADED_LOCAL_LOSS * ph["total"] - (lo["total"] - lo["sync"])) / len(
                f.moe_layers
            )
            out[mode]["forms"]["local"]["sync_ms_implied_by_2.06x"] = round(sync * 1e3, 3)
    routed = {
        "mean_pairs_heaviest_rank": (
            float(np.mean([max(v.mean) for v in loads.values()])) if loads else f.top_k
        ),
        "expected_max_pairs_per_token": (
            float(np.mean([v.max for v in loads.values()])) if loads else f.top_k
        ),
        "placement": (placement.kind if placement else "contiguous"),
        "routing": "counts (sampled)" if counts else "uniform (exact)",
        "skew": skew,
    }
    return {
        "size": size,
        "batch": batch,
        "profile": asdict(profile),
        "hardware": hardware_json(hw),
        "context": context,
        "form": form,
        "routed": routed,
        "modes": out,
    }


def hardware_json(hw: Hardware) -> dict:
    d = asdict(hw)
    d["backend"] = asdict(hw.backend)
    d["box"]["usable_bytes"] = hw.usable_memory
    return d


def with_backend(
    hw: Hardware, name: str, latency_s: float | None = None, bandwidth: float | None = None
) -> Hardware:
    b = BACKENDS[name]
    if latency_s is not None:
        b = replace(b, latency_s=latency_s, source="flag")
    if bandwidth is not None:
        b = replace(b, bandwidth=bandwidth)
    return replace(hw, backend=b)


def compare_anchors(
    config: dict,
    profile: Profile,
    hws: dict[str, Hardware],
    context: int = 4096,
    form: str = "placeholder",
) -> list[dict]:
    """The model next to the published two-box numbers, for each backend in ``hws``
    that the anchor may have used, with what the anchor implies about the constants
    the model assumes."""
    f = facts(config, profile)
    out = []
    steps = {}
    for a in ANCHORS:
        for b in a["backends"]:
            if b not in hws:
                continue
            step = bytes_per_token(a["mode"], f, a["size"], hws[b], form, None, context)
            steps[a["name"], b] = step
            out.append(
                {
                    "anchor": a["name"],
                    "anchor_tok_s": a["tok_s"],
                    "mode": a["mode"],
                    "backend": b,
                    "model_tok_s": round(step["tok_s"], 2),
                    "anchor_over_model": round(a["tok_s"] / step["tok_s"], 3),
                    "implied": implied(step, a["tok_s"], hws[b]),
                }
            )
    tp, pp = ANCHORS[1], ANCHORS[2]  # one setup: fit both constants to both numbers
    for b in tp["backends"]:
        if (tp["name"], b) in steps:
            fit = joint_fit(
                [steps[tp["name"], b], steps[pp["name"], b]], [tp["tok_s"], pp["tok_s"]], hws[b]
            )
            out.append({"anchor": "PipeNetwork TP + PP jointly", "backend": b, "implied": fit})
    return out


def joint_fit(steps: list[dict], tok_s: list[float], hw: Hardware) -> dict:
    """The (bandwidth fraction, per-collective latency) that reproduce two measured
    speeds at once, memory-bound: 1/tok_s = B / (BW eta) + n lambda + wire + sync."""
    A, y = [], []
    for st, t in zip(steps, tok_s, strict=True):
        wire = sum(c["count"] * c["wire_bytes"] for c in st["collectives"]) / (hw.backend.bandwidth)
        A.append([st["bytes_critical_path"] / hw.mem_bw, st["n_collectives"]])
        y.append(1 / t - wire - st["time_s"]["sync"])
    inv_eta, lam = np.linalg.solve(np.array(A), np.array(y))
    return {
        "bw_fraction": round(float(1 / inv_eta), 3) if inv_eta > 0 else None,
        "latency_us": round(float(lam) * 1e6, 1),
    }


# ---------------------------------------------------------------- prefill

# Prefill efficiency of MLX on an M3 Ultra: what share of ``Hardware.flops`` a prompt's
# matmuls reach. Dense models come close to the peak; MoE prefill (gathered expert
# matmuls over few tokens per expert) far from it.
PREFILL_FLOPS_FRACTION = 0.2
PREFILL_SOURCES = {
    "prefill_flops_fraction": (
        "derived, not K3: DeepSeek-R1 671B Q4 under MLX on one M3 Ultra 512 GB prefilled a "
        "13,140-token prompt at 59.6 tok/s (getop.com forum report): 37B active x 2 FLOP x "
        "59.6 = 4.4 TFLOPS, 0.15 of 28.7 (0.2 with its MLA attention at 13K); a dense 70B "
        "4-bit under mlx-lm 0.31.2 on the same box prefills 4K at ~170 tok/s = 23.8 TFLOPS, "
        "0.83 (abhiramsalammagari.com, dense-70b-mlx-m3-ultra, 2026-05-03). 0.5 is reported "
        "beside it as the optimistic case"
    ),
    "mla_prefill": "mlx-lm 0.32.2 kimi_k3 MLA at L > 1: the cached latent (T tokens) is "
    "expanded to per-head keys and values every chunk (embed_q, unembed_out: "
    "2 x T x 512 x 256 FLOP a head), then full masked attention C x T over "
    "128 + 64 (q/k) and 128 (v) dims; absorbed (mla='absorbed'): "
    "2 x C x (128 x 512 + T x (2 x 512 + 64) + 512 x 128) FLOP a head",
    "kda_prefill": "8 x head_dim^2 FLOP per token and head (the decode model's), no growth "
    "with context",
    "experts_touched": "a chunk of C tokens reads every expert one of its C x k routes "
    "lands on: E_r (1 - (1 - k/E)^C) of a rank's E_r experts, uniform "
    "routing",
    "lm_head": "computed for the prompt's last token only (MLX evaluates the caches, not "
    "the chunk's logits)",
}


def _busiest_pairs(f: Facts, size: int, chunk: int) -> float:
    """Expected routed pairs on the busiest rank for ``chunk`` tokens (uniform routing,
    contiguous equal ranges): the mean plus the normal approximation of the spread."""
    k, E = f.top_k, f.num_experts
    p = 1 / size
    var = chunk * k * p * (1 - p) * (E - k) / (E - 1)
    spread = math.sqrt(2 / math.pi) if size == 2 else math.sqrt(2 * math.log(size))
    return chunk * k * p + spread * math.sqrt(var)


def prefill_chunk(
    f: Facts,
    mode: str,
    size: int,
    hw: Hardware,
    chunk: int,
    start: int,
    form: str = "local",
    flops_fraction: float = PREFILL_FLOPS_FRACTION,
    mla: str = "expanded",
) -> dict:
    """One rank's time for one prefill chunk of ``chunk`` tokens after ``start`` cached
    ones: weights read once, the experts the chunk touches read once, FLOPs of every
    matmul (routed pairs: the busiest rank's under EP; every pair under the placeholder
    form), MLA's growth with the context, collectives with ``chunk`` rows, and one host
    sync per MoE layer (EP local form). Roofline: max(memory, FLOPs) + comm + sync.
    ``mla``: "expanded" (mlx-lm 0.32.2 at L > 1: the cached latent expanded to per-head
    keys and values) or "absorbed" (the decode form: queries and output projected into
    the latent, attention over the T latents: what a short chunk after a long cache
    would cost without the expansion)."""
    if mode not in ("ep-split", "ep-replicated", "tp"):
        raise ValueError(f"prefill is modelled for ep-split, ep-replicated and tp, not {mode!r}")
    tc = f.tc
    T = start + chunk
    nbytes = flops = 0.0
    attn_flops = expand_flops = 0.0
    E_r = f.num_experts / size
    touched = E_r * (1 - (1 - f.top_k / f.num_experts) ** chunk)
    for L in f.layers:
        nbytes += sum(L.bytes[g] * _split(mode, g, f, size) for g in GROUPS)
        flops += 2 * chunk * sum(L.elems[g] * _split(mode, g, f, size) for g in GROUPS)
        heads = tc["num_attention_heads"] * _split(mode, "attn_heads", f, size)
        if L.attention == "mla":
            lat, nope = tc["kv_lora_rank"], tc["qk_nope_head_dim"]
            v, rope = tc["v_head_dim"], tc["qk_rope_head_dim"]
            if mla == "absorbed":
                a = heads * 2 * chunk * (nope * lat + T * (2 * lat + rope) + lat * v)
            else:
                expand = heads * 2 * T * lat * (nope + v)
                expand_flops += expand
                a = expand + heads * 2 * chunk * T * (nope + rope + v)
            nbytes += T * L.cache_bytes_per_token
        else:
            lc = tc["linear_attn_config"]
            a = (
                chunk
                * 8
                * lc["num_heads"]
                * _split(mode, "attn_heads", f, size)
                * lc["head_dim"] ** 2
            )
            nbytes += 2 * L.state_bytes * _split(mode, "attn_heads", f, size)
        attn_flops += a
        if L.moe:
            nbytes += touched * f.expert_bytes  # TP: half of every touched expert, as many
            if mode == "tp" or size == 1:
                pairs = chunk * f.top_k / size
            elif form == "placeholder":
                pairs = chunk * f.top_k  # non-owned pairs run on the placeholder expert
            else:
                pairs = _busiest_pairs(f, size, chunk)
            flops += 2 * pairs * f.expert_elems
    flops += attn_flops
    colls = collectives(f, mode, size, hw, chunk)
    comm = sum(c["total_s"] for c in colls)
    sync = (
        hw.sync_s * len(f.moe_layers)
        if (mode in EP_MODES and form == "local" and size > 1)
        else 0.0
    )
    mem_s = nbytes / (hw.mem_bw * hw.bw_fraction)
    flops_s = flops / (hw.flops * flops_fraction)
    return {
        "chunk": chunk,
        "start": start,
        "bytes": nbytes,
        "flops": flops,
        "attention_flops": attn_flops,
        "mla_expand_flops": expand_flops,
        "experts_touched_per_layer": touched,
        "n_collectives": sum(c["count"] for c in colls),
        "time_s": {
            "memory": mem_s,
            "flops": flops_s,
            "comm": comm,
            "sync": sync,
            "total": max(mem_s, flops_s) + comm + sync,
        },
    }


def prefill(
    f: Facts,
    mode: str,
    size: int,
    hw: Hardware,
    prompt: int,
    chunk: int,
    start: int = 0,
    form: str = "local",
    flops_fraction: float = PREFILL_FLOPS_FRACTION,
) -> dict:
    """Time to first token of a ``prompt``-token prompt whose first ``start`` tokens are
    cached: its chunks (``chunk`` tokens, the rest last) one after another, then the
    first token (one decode step: lm_head and sampling)."""
    total = comm = attn = flops = 0.0
    n = 0
    pos = start
    while pos < prompt:
        c = min(chunk, prompt - pos)
        step = prefill_chunk(f, mode, size, hw, c, pos, form, flops_fraction)
        total += step["time_s"]["total"]
        comm += step["time_s"]["comm"]
        attn += step["attention_flops"]
        flops += step["flops"]
        pos += c
        n += 1
    first = bytes_per_token(
        mode, f, size, hw, "local" if form == "local" else "placeholder", None, prompt
    )["time_s"]["total"]
    return {
        "mode": mode,
        "form": form if mode in EP_MODES else None,
        "prompt": prompt,
        "cached": start,
        "chunk": chunk,
        "chunks": n,
        "prefill_s": total,
        "comm_s": comm,
        "flops": flops,
        "attention_flops": attn,
        "first_token_s": first,
        "ttft_s": total + first,
        "prefill_tok_s": (prompt - start) / total if total else None,
    }


def chunk_tradeoff(
    f: Facts,
    mode: str,
    size: int,
    hw: Hardware,
    chunks: tuple[int, ...],
    prompt: int,
    batch: int,
    context: int,
    form: str = "local",
    flops_fraction: float = PREFILL_FLOPS_FRACTION,
) -> list[dict]:
    """Per prefill chunk size: the prompt's time to first token, and the inter-token latency
    of ``batch`` requests decoding beside it (mlx-lm's BatchGenerator runs one chunk
    between decode steps: each step waits for a chunk), mean and worst over the prompt."""
    step = bytes_per_token(
        mode, f, size, hw, form if mode in EP_MODES else "placeholder", None, context, batch
    )["time_s"]["total"]
    out = []
    for c in chunks:
        p = prefill(f, mode, size, hw, prompt, c, 0, form, flops_fraction)
        last = prefill_chunk(f, mode, size, hw, c, max(prompt - c, 0), form, flops_fraction)
        out.append(
            {
                "chunk": c,
                "ttft_s": round(p["ttft_s"], 2),
                "decode_step_alone_s": round(step, 4),
                "itl_mean_s": round(step + p["prefill_s"] / p["chunks"], 3),
                "itl_worst_s": round(step + last["time_s"]["total"], 3),
                "decode_steps_stalled": p["chunks"],
            }
        )
    return out
