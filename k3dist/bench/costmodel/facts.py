"""Model facts: a config's tensors grouped per layer at a profile's bits (``facts``), and
the build's size (``footprint``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from k3dist.bench.costmodel.hardware import ACT_BYTES, GROUPS, HEAD_SPLIT, Profile
from k3dist.format import kvmemory, layout
from k3dist.format.classes import tensor_class

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
        bits = dict(p.class_bits).get(tensor_class(s), 16)
    elif p.nonexpert_bits == 16:
        return s.nbytes
    else:
        bits = p.router_bits if s.family == "router" else p.nonexpert_bits
    return s.nbytes if bits == 16 else s.shape[0] * s.shape[1] * p.affine_bits(bits) / 8


def _group(s: layout.TensorSpec) -> str:
    if s.family in ("kda", "mla"):
        module = s.name.split("self_attn.")[1].split(".")[0]
        return "attn_heads" if module in HEAD_SPLIT else "attn_rep"
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
