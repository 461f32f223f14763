"""Attention heads (and the dense layer's MLP) split across ranks by mlx-lm's own
``kimi_k3.Model.shard``; the input-split projections (``o_proj``, ``down_proj``)
become :class:`SumLinear`, whose ``all_sum`` obeys ``set_collectives`` like the MoE's."""

from __future__ import annotations

from types import SimpleNamespace

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

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", quantize_input: bool = False):
        q = QuantizedSumLinear.from_linear(self, group_size, bits, mode)
        q.group, q.collectives = self.group, True
        return q


class QuantizedSumLinear(nn.QuantizedLinear):
    """:class:`SumLinear` quantized (mlx-lm's loader quantizes after the split, so the
    group size is inferred from this rank's slice of the scales)."""

    def __call__(self, x: mx.array) -> mx.array:
        x = super().__call__(x)
        return mx.distributed.all_sum(x, group=self.group) if self.collectives else x


class _NoMLP(nn.Module):
    """What ``kimi_k3.Model.shard`` sees as the MLP of an MoE layer: its dense branch
    shards these throwaway projections, leaving the expert-parallel MoE alone."""

    def __init__(self, n: int):
        super().__init__()
        self.gate_proj = nn.Linear(n, n, bias=False)
        self.up_proj = nn.Linear(n, n, bias=False)
        self.down_proj = nn.Linear(n, n, bias=False)


def split_attention(layers: list, split: list[int], group: mx.distributed.Group) -> None:
    """Divide the attention (and a dense layer's MLP) of ``layers[i]`` for ``i`` in
    ``split`` across ``group`` with mlx-lm's ``kimi_k3.Model.shard``, without its MoE
    half; then swap its distributed linears for plain ones (row splits: no collective
    in the forward pass) and :class:`SumLinear` (input splits). Call on an unquantized,
    unloaded model: mlx-lm's loader then quantizes and loads the per-rank slices."""
    n = group.size()
    if n == 1 or not split:
        return
    view = SimpleNamespace(layers=[
        SimpleNamespace(self_attn=layers[i].self_attn, is_linear=layers[i].is_linear,
                        mlp=(_NoMLP(n) if isinstance(layers[i].mlp, kimi_k3.KimiK3SparseMoE)
                             else layers[i].mlp))
        for i in split])
    kimi_k3.Model.shard(view, group)
    for v in view.layers:
        for module in (v.self_attn, v.mlp):
            for name, child in list(module.children().items()):
                if isinstance(child, AllToShardedLinear):
                    plain = nn.Linear(child.weight.shape[1], child.weight.shape[0], bias=False)
                    plain.weight = child.weight
                    setattr(module, name, plain)
                elif isinstance(child, ShardedToAllLinear):
                    setattr(module, name, SumLinear(child.weight, group))
