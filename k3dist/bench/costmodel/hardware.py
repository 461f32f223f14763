"""The modes, the link backends, the box's decode efficiencies (``Hardware``) and the
build profiles (bits per weight) the cost model projects."""

from __future__ import annotations

from dataclasses import dataclass

from k3dist.config.box import SOURCES as BOX_SOURCES
from k3dist.config.box import Box
from k3dist.format.placement import MOE_FORMS

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
HEAD_SPLIT = {
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
