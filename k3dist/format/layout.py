"""The tensors a Moonshot-format K3 checkpoint holds, as implied by its config.

One source of truth for names, shapes, dtypes and families, shared by the
synthesizer (what to write), the audit (what must be there) and the converter
(what to read, layer by layer). Shapes are the checkpoint's (PyTorch layout).

Dtypes: the router's ``e_score_correction_bias`` and KDA ``o_norm`` are F32 next
to the known F32 KDA tensors; with that (and the vision shapes below) the sizes
add up to the real index's ``total_size`` exactly (1,560,860,324,864 bytes).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from k3dist.format.sfile import nbytes_of

LM = "language_model."
LAYER_PREFIX = "language_model.model.layers."
_LAYER_RE = re.compile(r"^language_model\.model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(
    r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\."
    r"(w[123])\.(weight_packed|weight_scale)$"
)
# the vision tower's and projector's names (carried in a build, never in the text model)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# mlx-lm's projections of a gated MLP (SwitchGLU, the dense MLP, shared experts), its order
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
# Moonshot's routed-expert projections -> mlx-lm's SwitchGLU names
EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

FAMILIES = (
    "experts",
    "router",
    "shared_experts",
    "latent",
    "kda",
    "mla",
    "attn_res",
    "norm",
    "dense_mlp",
    "embed",
    "vision",
)


class TensorSpec(NamedTuple):
    """A tensor the config implies (a named tuple: K3 implies 497,220)."""

    name: str
    shape: tuple[int, ...] | None  # None: not enforced (vision tower, carried as-is)
    dtype: str  # safetensors dtype string: "BF16", "F32", "U8"
    family: str
    layer: int | None  # 0-based decoder layer, None for non-layer tensors
    group: str  # the converter's unit: "layer.L", "head" or "vision"

    @property
    def nbytes(self) -> int:
        return 0 if self.shape is None else nbytes_of(self.dtype, self.shape)


def text_config(config: dict) -> dict:
    """The text part of a top-level K3 config (or the config itself if flat)."""
    return config.get("text_config", config)


def kda_layers(tc: dict) -> set[int]:
    """0-based indices of KDA layers (the config's lists are 1-based)."""
    return {i - 1 for i in tc["linear_attn_config"]["kda_layers"]}


def is_moe_layer(tc: dict, layer: int) -> bool:
    return (
        (tc.get("num_experts") or 0) > 0
        and layer >= tc.get("first_k_dense_replace", 0)
        and layer % tc.get("moe_layer_freq", 1) == 0
    )


def moe_layers(tc: dict) -> list[int]:
    """0-based indices of the MoE layers, ascending."""
    return [i for i in range(tc["num_hidden_layers"]) if is_moe_layer(tc, i)]


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def parse_expert_key(name: str) -> tuple[int, int, str, str] | None:
    """(layer, expert, w1|w2|w3, weight_packed|weight_scale) or None."""
    m = _EXPERT_RE.match(name)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)


def expert_specs(tc: dict, layer: int, expert: int) -> list[TensorSpec]:
    """MXFP4 (compressed-tensors mxfp4-pack-quantized): 2 codes per byte, one
    E8M0 scale byte per 32 values along the input dimension."""
    inter = tc["moe_intermediate_size"]
    dim = tc.get("routed_expert_hidden_size") or tc["hidden_size"]
    p = f"{LAYER_PREFIX}{layer}.block_sparse_moe.experts.{expert}."
    out = []
    for w, (rows, cols) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
        out.append(
            TensorSpec(
                p + f"{w}.weight_packed",
                (rows, cols // 2),
                "U8",
                "experts",
                layer,
                f"layer.{layer}",
            )
        )
        out.append(
            TensorSpec(
                p + f"{w}.weight_scale",
                (rows, cols // 32),
                "U8",
                "experts",
                layer,
                f"layer.{layer}",
            )
        )
    return out


def layer_specs(tc: dict, layer: int, with_experts: bool = True) -> list[TensorSpec]:
    H = tc["hidden_size"]
    g = f"layer.{layer}"
    p = f"{LAYER_PREFIX}{layer}."
    specs: list[TensorSpec] = []

    def add(name, shape, family, dtype="BF16"):
        specs.append(TensorSpec(p + name, tuple(shape), dtype, family, layer, g))

    add("input_layernorm.weight", (H,), "norm")
    add("post_attention_layernorm.weight", (H,), "norm")
    if tc.get("attn_res_block_size") is not None:
        add("self_attention_res_norm.weight", (H,), "attn_res")
        add("self_attention_res_proj.weight", (1, H), "attn_res")
        add("mlp_res_norm.weight", (H,), "attn_res")
        add("mlp_res_proj.weight", (1, H), "attn_res")

    a = "self_attn."
    if layer in kda_layers(tc):
        lc = tc["linear_attn_config"]
        nh, hd, ks = lc["num_heads"], lc["head_dim"], lc["short_conv_kernel_size"]
        P = nh * hd
        for x in "qkv":
            add(f"{a}{x}_proj.weight", (P, H), "kda")
            add(f"{a}{x}_conv1d.weight", (P, 1, ks), "kda", "F32")
        # Per head, padded with zeros to head_dim (the audit checks the tail).
        add(f"{a}A_log", (max(hd, nh),), "kda", "F32")
        add(f"{a}dt_bias", (P,), "kda", "F32")
        add(f"{a}b_proj.weight", (nh, H), "kda")
        add(f"{a}f_a_proj.weight", (hd, H), "kda")
        add(f"{a}f_b_proj.weight", (P, hd), "kda")
        if lc.get("use_full_rank_gate", False):
            add(f"{a}g_proj.weight", (P, H), "kda")
        else:
            add(f"{a}g_a_proj.weight", (hd, H), "kda")
            add(f"{a}g_b_proj.weight", (P, hd), "kda")
        add(f"{a}o_norm.weight", (hd,), "kda", "F32")
        add(f"{a}o_proj.weight", (H, P), "kda")
    else:
        nh = tc["num_attention_heads"]
        nope, rope, vd = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
        ql, kvl = tc.get("q_lora_rank"), tc["kv_lora_rank"]
        if ql is not None:
            add(f"{a}q_a_proj.weight", (ql, H), "mla")
            add(f"{a}q_a_layernorm.weight", (ql,), "mla")
            add(f"{a}q_b_proj.weight", (nh * (nope + rope), ql), "mla")
        else:
            add(f"{a}q_proj.weight", (nh * (nope + rope), H), "mla")
        add(f"{a}kv_a_proj_with_mqa.weight", (kvl + rope, H), "mla")
        add(f"{a}kv_a_layernorm.weight", (kvl,), "mla")
        add(f"{a}kv_b_proj.weight", (nh * (nope + vd), kvl), "mla")
        add(f"{a}o_proj.weight", (H, nh * vd), "mla")
        if tc.get("mla_use_output_gate", False):
            add(f"{a}g_proj.weight", (nh * vd, H), "mla")

    if is_moe_layer(tc, layer):
        m = "block_sparse_moe."
        E = tc["num_experts"]
        latent = tc.get("routed_expert_hidden_size")
        add(f"{m}gate.weight", (E, H), "router")
        add(f"{m}gate.e_score_correction_bias", (E,), "router", "F32")
        if latent is not None:
            add(f"{m}routed_expert_down_proj.weight", (latent, H), "latent")
            add(f"{m}routed_expert_up_proj.weight", (H, latent), "latent")
            if tc.get("latent_moe_use_norm", False):
                add(f"{m}routed_expert_norm.weight", (latent,), "latent")
        if tc.get("num_shared_experts"):
            si = tc["moe_intermediate_size"] * tc["num_shared_experts"]
            add(f"{m}shared_experts.gate_proj.weight", (si, H), "shared_experts")
            add(f"{m}shared_experts.up_proj.weight", (si, H), "shared_experts")
            add(f"{m}shared_experts.down_proj.weight", (H, si), "shared_experts")
        if with_experts:
            for e in range(E):
                specs.extend(expert_specs(tc, layer, e))
    else:
        inter = tc["intermediate_size"]
        add("mlp.gate_proj.weight", (inter, H), "dense_mlp")
        add("mlp.up_proj.weight", (inter, H), "dense_mlp")
        add("mlp.down_proj.weight", (H, inter), "dense_mlp")
    return specs


def head_specs(tc: dict) -> list[TensorSpec]:
    H, V = tc["hidden_size"], tc["vocab_size"]
    specs = [
        TensorSpec(LM + "model.embed_tokens.weight", (V, H), "BF16", "embed", None, "head"),
        TensorSpec(LM + "model.norm.weight", (H,), "BF16", "norm", None, "head"),
    ]
    if tc.get("attn_res_block_size") is not None:
        specs.append(
            TensorSpec(
                LM + "model.output_attn_res_norm.weight", (H,), "BF16", "attn_res", None, "head"
            )
        )
        specs.append(
            TensorSpec(
                LM + "model.output_attn_res_proj.weight", (1, H), "BF16", "attn_res", None, "head"
            )
        )
    if not tc.get("tie_word_embeddings", False):
        specs.append(TensorSpec(LM + "lm_head.weight", (V, H), "BF16", "embed", None, "head"))
    return specs


def vision_specs(config: dict) -> list[TensorSpec]:
    """MoonViT + projector. Carried through as-is; shapes are written by the
    synthesizer but not enforced by the audit (the reference has names only)."""
    vc = config.get("vision_config")
    if not vc:
        return []
    tc = text_config(config)
    vt, vi, ps = vc["vt_hidden_size"], vc["vt_intermediate_size"], vc["patch_size"]
    qkv = vc.get("qkv_hidden_size") or vt
    mk = vc.get("merge_kernel_size", [2, 2])
    mm = vc["mm_hidden_size"] * mk[0] * mk[1]
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("vision_tower.patch_embed.proj.weight", (vt, 3, ps, ps)),
        (
            "vision_tower.patch_embed.pos_emb.weight",
            (vc["init_pos_emb_height"], vc["init_pos_emb_width"], vt),
        ),
    ]
    for b in range(vc["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}."
        shapes += [
            (p + "norm0.weight", (vt,)),
            (p + "norm1.weight", (vt,)),
            (p + "wqkv.weight", (3 * qkv, vt)),
            (p + "wo.weight", (vt, qkv)),
            (p + "mlp.fc0.weight", (vi, vt)),
            (p + "mlp.fc1.weight", (vt, vi)),
        ]
    shapes += [
        ("vision_tower.encoder.final_layernorm.weight", (vt,)),
        ("mm_projector.proj.0.weight", (mm, mm)),
        ("mm_projector.proj.2.weight", (tc["hidden_size"], mm)),
        ("mm_projector.post_norm.weight", (tc["hidden_size"],)),
    ]
    return [TensorSpec(n, s, "BF16", "vision", None, "vision") for n, s in shapes]


def source_specs(config: dict, with_experts: bool = True) -> list[TensorSpec]:
    """Every tensor the config implies, in checkpoint order (layers, head, vision)."""
    tc = text_config(config)
    specs: list[TensorSpec] = []
    for layer in range(tc["num_hidden_layers"]):
        specs.extend(layer_specs(tc, layer, with_experts))
    specs.extend(head_specs(tc))
    specs.extend(vision_specs(config))
    return specs


def groups(config: dict) -> list[str]:
    """Conversion units in order: one per decoder layer, then head, then vision."""
    tc = text_config(config)
    out = [f"layer.{i}" for i in range(tc["num_hidden_layers"])] + ["head"]
    if config.get("vision_config"):
        out.append("vision")
    return out


# ----------------------------------------------------------------------------- attention split

ATTENTION_MODES = ("split", "replicated")
# How mlx-lm's ``kimi_k3.Model.shard`` divides a layer's tensors across ranks, by the
# tensor's path inside its layer (MLX build names): (axis, segments). Axis 0 splits
# output rows (heads), -1 the input (o_proj, down_proj: their outputs are summed).
# A quantized weight's ``scales``/``biases`` split with it.
_SPLIT_KDA = {
    "qkv_proj": (0, 3),
    "qkv_conv.conv": (0, 3),
    "f_b_proj": (0, 1),
    "g_proj": (0, 1),
    "g_b_proj": (0, 1),
    "b_proj": (0, 1),
    "o_proj": (-1, 1),
    "A_log": (0, 1),
    "dt_bias": (0, 1),
}
_SPLIT_MLA = {
    "q_b_proj": (0, 1),
    "q_proj": (0, 1),
    "g_proj": (0, 1),
    "o_proj": (-1, 1),
    "embed_q": (0, 1),
    "unembed_out": (0, 1),
}
_SPLIT_DENSE = {"gate_proj": (0, 1), "up_proj": (0, 1), "down_proj": (-1, 1)}
_PARTS = ("weight", "scales", "biases")


def split_rule(tc: dict, name: str) -> tuple[int, int] | None:
    """(axis, segments) along which tensor ``name`` (an MLX build name) is divided when
    its layer's attention is split across ranks; None: every rank holds all of it."""
    layer = layer_of(name)
    if layer is None:
        return None
    rest = name[len(f"{LAYER_PREFIX}{layer}.") :]
    for prefix, table in (
        ("self_attn.", _SPLIT_KDA if layer in kda_layers(tc) else _SPLIT_MLA),
        ("mlp.", {} if is_moe_layer(tc, layer) else _SPLIT_DENSE),
    ):
        if not rest.startswith(prefix):
            continue
        module, _, part = rest[len(prefix) :].rpartition(".")
        if module and part in _PARTS and module in table:
            return table[module]
        if rest[len(prefix) :] in table:  # bare arrays: A_log, dt_bias
            return table[rest[len(prefix) :]]
    return None


def attention_heads(tc: dict, layer: int) -> int:
    if layer in kda_layers(tc):
        return tc["linear_attn_config"]["num_heads"]
    return tc["num_attention_heads"]


def split_layers(tc: dict, size: int, shapes: dict[str, tuple[int, ...]]) -> list[int]:
    """Layers whose attention (and dense MLP) divide evenly across ``size`` ranks: heads
    a multiple of ``size`` and every divided tensor in ``shapes`` (name -> shape, a
    quantized input-dim split only at whole groups: its ``scales`` columns) too.
    The others stay replicated on every rank."""
    if size <= 1:
        return []
    ok = {i: attention_heads(tc, i) % size == 0 for i in range(tc["num_hidden_layers"])}
    for name, shape in shapes.items():
        rule = split_rule(tc, name)
        if rule is not None:
            axis, segments = rule
            if not shape or shape[axis] % (segments * size):
                ok[layer_of(name)] = False
    return [i for i, good in ok.items() if good]


def split_slice(
    shape: tuple[int, ...], rule: tuple[int, int], rank: int, size: int
) -> list[tuple[int, int]]:
    """(start, stop) index ranges along the rule's axis that rank ``rank`` holds, in
    order (one per segment)."""
    axis, segments = rule
    n = shape[axis] // segments
    per = n // size
    return [(s * n + rank * per, s * n + (rank + 1) * per) for s in range(segments)]
