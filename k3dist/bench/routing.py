"""Which experts the router picks: a calibration pass through mlx-lm's own kimi_k3
with each MoE module's gate recorded, the counts per expert (the input of
``placement.load_aware``) and how evenly a placement spreads them."""

from __future__ import annotations

from k3dist.format import placement
from k3dist.model import compat

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import kimi_k3


class _RouteRecorder(nn.Module):
    """Stands in for one MoE module during a calibration pass: routes its input with
    the module's own gate and kimi_k3's router (``compat.group_expert_select``), keeps the
    selections, then runs the module unchanged."""

    def __init__(self, moe: kimi_k3.KimiK3SparseMoE):
        super().__init__()
        self.moe = moe
        self.selected: list[mx.array] = []

    def __call__(self, x: mx.array) -> mx.array:
        m, a = self.moe, self.moe.args
        inds, _ = compat.group_expert_select(
            m.gate(x),
            m.e_score_correction_bias,
            a.num_experts_per_token,
            a.num_expert_group,
            a.topk_group,
            a.routed_scaling_factor,
            a.moe_renormalize,
        )
        self.selected.append(inds)
        return m(x)


def router_selections(model, prompt: list[int]) -> dict[int, np.ndarray]:
    """Per MoE layer (model layer index): the experts the router picks for each token
    of ``prompt`` in one forward pass of ``model`` (single-process, all experts);
    ``[tokens, top_k]`` global ids."""
    layers = model.layers
    swapped = {}
    for i, layer in enumerate(layers):
        if isinstance(layer.mlp, kimi_k3.KimiK3SparseMoE):
            swapped[i] = layer.mlp
            layer.mlp = _RouteRecorder(layer.mlp)
    try:
        mx.eval(model(mx.array([prompt]), cache=model.make_cache()))
        return {
            i: np.concatenate(
                [np.array(s).reshape(-1, s.shape[-1]) for s in layers[i].mlp.selected]
            )
            for i in swapped
        }
    finally:
        for i, moe in swapped.items():
            layers[i].mlp = moe


def selection_counts(selections: dict[int, np.ndarray], num_experts: int) -> dict[int, np.ndarray]:
    return {
        i: np.bincount(s.reshape(-1), minlength=num_experts).astype(np.int64)
        for i, s in selections.items()
    }


def routing_counts(model, prompt: list[int]) -> dict[int, np.ndarray]:
    """How often each expert is selected per MoE layer over ``prompt`` (the input of
    ``placement.load_aware``)."""
    return selection_counts(router_selections(model, prompt), model.args.text_config.num_experts)


def balance(plc: placement.Placement, selections: dict[int, np.ndarray]) -> dict:
    """Mean over MoE layers of the expected largest per-rank (token, expert) pair
    count per token (the decode critical path); perfect balance is top_k / size."""
    per = [plc.expected_max_load(i, s) for i, s in selections.items()]
    k = next(iter(selections.values())).shape[-1]
    return {
        "expected_max_pairs_per_token": round(float(np.mean(per)), 4),
        "ideal": round(k / plc.size, 4),
    }
