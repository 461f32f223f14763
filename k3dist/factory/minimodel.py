"""The mini-K3 as a model to train: its sizes (presets of ``k3dist.factory.synth``), mlx-lm's
own ``kimi_k3`` built at those sizes, router load bookkeeping and bias updates, and the
MXFP4 freeze of the routed experts (``k3dist.factory.train`` runs them)."""

from __future__ import annotations

import math
from pathlib import Path

from k3dist.factory import synth
from k3dist.format import layout, mxfp4
from k3dist.format.folder import CONFIG_NAME, load_config

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3
from mlx_lm.models.switch_layers import SwitchGLU

# ----------------------------------------------------------------------------- sizes

# The trainable sizes: presets of the one table, ``k3dist.factory.synth.PRESETS`` (K3's
# ratios, scaled; parameter counts: `describe(config)`).
SIZES = ("s", "m", "sparse", "sparse256", "tiny")
PRETRAINED_FILE = "pretrained.safetensors"  # the run's float weights at the freeze


def model_config(size: str | synth.Preset, vocab_size: int) -> dict:
    """K3's real config.json with the size's dimensions (``synth.make_config``)."""
    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    p = synth.PRESETS[size] if isinstance(size, str) else size
    return synth.make_config(p, vocab_size)


def describe(config: dict) -> dict:
    """Parameter counts (total, routed experts, active per token) and source bytes."""
    tc = layout.text_config(config)
    specs = [s for s in layout.source_specs(config) if s.family != "vision"]
    n_expert = sum(math.prod(s.shape) * 2 for s in specs if s.name.endswith("weight_packed"))
    n_all = sum(math.prod(s.shape) for s in specs if s.family != "experts") + n_expert
    frac = tc["num_experts_per_token"] / tc["num_experts"]
    return {
        "params": n_all,
        "expert_params": n_expert,
        "active_params": int(n_all - n_expert * (1 - frac)),
        "source_bytes": sum(s.nbytes for s in layout.source_specs(config)),
    }


# ----------------------------------------------------------------------------- model


class CountingSwitchGLU(SwitchGLU):
    """mlx-lm's SwitchGLU that keeps its last call's expert ids (the router's load,
    for aux-loss-free balancing). Same parameters, same maths."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self._indices = indices  # leading underscore: not a parameter
        return super().__call__(x, indices)


def moe_layers(model: nn.Module) -> list[kimi_k3.KimiK3SparseMoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, kimi_k3.KimiK3SparseMoE)]


def build_model(config: dict, seed: int = 0) -> kimi_k3.Model:
    """mlx-lm's kimi_k3 in float32, deterministic per seed; routers count their load and
    ``e_score_correction_bias`` is frozen (moved by ``update_router_bias``, not Adam)."""
    mx.random.seed(seed)
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(config))
    for moe in moe_layers(model):
        old = moe.switch_mlp
        new = CountingSwitchGLU(
            old.gate_proj.input_dims,
            old.gate_proj.output_dims,
            old.gate_proj.num_experts,
            activation=old.activation,
        )
        new.update(old.parameters())
        moe.switch_mlp = new
        moe.freeze(keys=["e_score_correction_bias"], recurse=False)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def reset_caches(model: nn.Module) -> None:
    """Drop the AttnRes effective-weight caches mlx-lm keeps in eval mode (stale after
    any weight change) and the recorded router ids."""
    for layer in model.layers:
        if getattr(layer, "use_attn_res", False):
            layer._attn_res_w_eff = layer._mlp_res_w_eff = None
    if getattr(model.model, "use_attn_res", False):
        model.model._output_res_w_eff = None
    for moe in moe_layers(model):
        moe.switch_mlp._indices = None


def expert_loads(model: nn.Module) -> mx.array:
    """[moe_layers, num_experts] token-expert assignments of the last forward."""
    rows = []
    for moe in moe_layers(model):
        inds = moe.switch_mlp._indices.reshape(-1)
        e = moe.e_score_correction_bias.shape[0]
        rows.append(mx.zeros((e,), mx.float32).at[inds].add(1.0))
    return mx.stop_gradient(mx.stack(rows))


def update_router_bias(model: nn.Module, loads: mx.array, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): an overloaded expert's bias drops by
    ``rate``, an underloaded one's rises; only top-k *selection* sees the bias."""
    for moe, load in zip(moe_layers(model), loads, strict=True):
        step = rate * mx.sign(load.mean() - load)
        moe.e_score_correction_bias = moe.e_score_correction_bias + step


def init_from_source(model: nn.Module, config: dict, folder: str | Path) -> None:
    """Warm start: load an exported Moonshot-format folder (``export_source``'s) into the
    float model through mlx-lm's ``load_model`` (its ``sanitize``), the MXFP4 experts
    decoded to float32 (``mxfp4.decode``) so pretraining can move them again."""
    from mlx_lm.utils import load_model

    folder = Path(folder)
    theirs = load_config(folder)
    if layout.text_config(theirs) != layout.text_config(config):
        raise ValueError(
            f"{folder / CONFIG_NAME}: its text config is not this run's "
            "size; pass the --size it was trained at (its training.json)"
        )
    src, _ = load_model(folder)
    flat = dict(tree_flatten(src.parameters()))
    weights = {}
    for k, v in flat.items():
        if k.endswith(".scales"):
            continue
        scales = k.removesuffix(".weight") + ".scales"
        if ".switch_mlp." in k and scales in flat:  # an MXFP4 routed-expert projection
            packed, e8m0 = mxfp4.from_mlx(v, flat[scales])
            v = mx.array(mxfp4.decode(np.array(packed), np.array(e8m0)))
        weights[k] = v.astype(mx.float32)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    reset_caches(model)


def freeze_experts_mxfp4(model: nn.Module) -> dict:
    """Routed experts -> mlx-lm ``QuantizedSwitchLinear`` (mode mxfp4), codes and scales
    from ``k3dist.format.mxfp4.encode`` (OCP), frozen. Returns relative RMS error per layer."""
    errors = {}
    for i, layer in enumerate(model.layers):
        moe = layer.mlp
        if not isinstance(moe, kimi_k3.KimiK3SparseMoE):
            continue
        num, den = 0.0, 0.0
        for name in layout.MLP_PROJS:
            lin = getattr(moe.switch_mlp, name)
            if not hasattr(lin, "to_quantized"):
                raise ValueError(f"layer {i} {name} is already quantized")
            w = np.array(lin.weight.astype(mx.float32))
            packed, scales = mxfp4.encode(w)
            q = lin.to_quantized(group_size=mxfp4.GROUP_SIZE, bits=4, mode="mxfp4")
            q.weight, q.scales = mxfp4.to_mlx(packed, scales)
            setattr(moe.switch_mlp, name, q)
            num += float(((mxfp4.decode(packed, scales) - w) ** 2).sum())
            den += float((w**2).sum())
        errors[i] = math.sqrt(num / den)
    mx.eval(model.parameters())
    return errors
