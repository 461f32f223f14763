"""The classes a K3 tensor belongs to for storage: routed experts, the non-expert
classes a build gives a precision to (:data:`CLASSES`), small tensors kept in their
source dtype (norms, biases, convs, ``A_log``, ``dt_bias``, AttnRes projections) and the
vision tower. One mapping for the source's tensors (:func:`tensor_class`, the planner's
accounting) and for an MLX build's modules (:func:`module_class`, the converter's
per-class formats).
"""

from __future__ import annotations

from k3dist.format import layout
from k3dist.format.graded import HI, LO

# Non-expert classes the plan gives a precision to; "small" stays in its source dtype.
CLASSES = ("attention", "shared", "latent", "router", "dense_mlp", "embed", "lm_head")


def tensor_class(s: layout.TensorSpec) -> str:
    """experts | one of CLASSES | small | vision."""
    if s.family in ("experts", "vision"):
        return s.family
    if s.shape is None or len(s.shape) != 2 or min(s.shape) == 1:
        return "small"  # norms, biases, convs, A_log, dt_bias, AttnRes projections
    return {
        "kda": "attention",
        "mla": "attention",
        "shared_experts": "shared",
        "latent": "latent",
        "router": "router",
        "dense_mlp": "dense_mlp",
        "embed": "lm_head" if s.name.endswith("lm_head.weight") else "embed",
        "norm": "small",
        "attn_res": "small",
    }[s.family]


def module_class(path: str) -> str:
    """The class of a quantizable module of an MLX build by its mlx-lm path (after
    ``kimi_k3.Model.sanitize``: fused ``qkv_proj``, MLA ``embed_q`` / ``unembed_out``):
    experts | one of CLASSES | small (AttnRes projections, never quantized) | vision."""
    if path.startswith(layout.VISION_PREFIXES):
        return "vision"
    if path.endswith("lm_head"):
        return "lm_head"
    if path.endswith("embed_tokens"):
        return "embed"
    if ".self_attn." in path:
        return "attention"
    if path.endswith("res_proj"):
        return "small"
    if ".mlp." not in path:
        raise ValueError(f"{path}: not a module of a kimi_k3 build")
    tail = path.split(".mlp.", 1)[1]
    if tail.startswith((LO, HI)):
        return "experts"
    if tail.startswith("shared_experts."):
        return "shared"
    if tail.startswith("routed_expert_"):
        return "latent"
    if tail == "gate":
        return "router"
    if tail in layout.MLP_PROJS:
        return "dense_mlp"
    raise ValueError(f"{path}: not a module of a kimi_k3 build")
