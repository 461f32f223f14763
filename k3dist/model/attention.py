"""Attention heads (and the dense layer's MLP) split across ranks by mlx-lm's own
``kimi_k3.Model.shard``; the input-split projections (``o_proj``, ``down_proj``)
become :class:`SumLinear`, whose ``all_sum`` obeys ``set_collectives`` like the MoE's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear
from mlx_lm.models import kimi_k3


class SumLinear(nn.Linear):
    """A linear layer on a slice of its input whose partial outputs are summed across
    ranks (mlx's ``ShardedToAllLinear``), with the sum switchable for warm-up."""

    def __init__(self, weight: mx.array, group: mx.distributed.Group):
        super().__init__(weight.shape[1], weight.shape[0], bias=False)
        self.weight = weight
        self.group = group
        self.collectives = True

    def __call__(self, x: mx.array) -> mx.array:
        x = super().__call__(x)
        return mx.distributed.all_sum(x, group=self.group) if self.collectives else x

    def to_quantized(
        self,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        quantize_input: bool = False,
    ):
        q = QuantizedSumLinear.from_linear(self, group_size, bits, mode)
        q.group, q.collectives = self.group, True
        return q


class QuantizedSumLinear(nn.QuantizedLinear):
    """:class:`SumLinear` quantized (mlx-lm's loader quantizes after the split, so the
    group size is inferred from this rank's slice of the scales)."""

    def __call__(self, x: mx.array) -> mx.array:
        x = super().__call__(x)
        return mx.distributed.all_sum(x, group=self.group) if self.collectives else x


class _Whole(nn.Module):
    """Stands in for an EP MoE's ``switch_mlp`` while ``shard()`` runs: its MoE branch
    would split every expert's intermediate dimension, and EP keeps experts whole, so
    the projections it shards in place hold no parameters."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Module(), nn.Module(), nn.Module()


def split_attention(model: kimi_k3.Model, split: list[int], group: mx.distributed.Group) -> None:
    """Divide the attention (and a dense layer's MLP) of ``model.layers[i]`` for ``i`` in
    ``split`` across ``group`` with mlx-lm's ``kimi_k3.Model.shard`` on ``model``, its
    layer list narrowed to ``split``; then swap its distributed linears for plain ones
    (row splits: no collective in the forward pass) and :class:`SumLinear` (input
    splits, switchable for warm-up). Of shard's MoE branch only ``sharding_group`` (the
    EP group already) stays: routed experts are held whole (:class:`_Whole`) and shared
    experts split after their weights load (``ExpertParallelMoE.shard_shared``). Call on
    an unquantized, unloaded model: mlx-lm's loader then quantizes and loads the slices."""
    n = group.size()
    if n == 1 or not split:
        return
    tm = model.language_model.model
    every = tm.layers
    chosen = [every[i] for i in split]
    moes = [
        (m, m.switch_mlp, m.shared_experts)
        for m in (layer.mlp for layer in chosen)
        if isinstance(m, kimi_k3.KimiK3SparseMoE)
    ]
    for m, _, _ in moes:
        m.switch_mlp, m.shared_experts = _Whole(), None
    tm.layers = chosen  # shard() iterates self.layers
    try:
        model.shard(group)
    finally:
        tm.layers = every
        for m, switch, shared in moes:
            m.switch_mlp, m.shared_experts = switch, shared
    for layer in chosen:
        for module in (layer.self_attn, layer.mlp):
            for name, child in list(module.children().items()):
                if isinstance(child, AllToShardedLinear):
                    plain = nn.Linear(child.weight.shape[1], child.weight.shape[0], bias=False)
                    plain.weight = child.weight
                    setattr(module, name, plain)
                elif isinstance(child, ShardedToAllLinear):
                    setattr(module, name, SumLinear(child.weight, group))
