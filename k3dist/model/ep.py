"""Kimi K3 from mlx-lm's ``kimi_k3`` with expert-parallel MoE layers
(:class:`k3dist.model.experts.ExpertParallelMoE`) and, on ``split_layers``, attention
heads split across ranks (:func:`k3dist.model.attention.split_attention`). Everything
else is mlx-lm's own module and forward."""

from __future__ import annotations

from k3dist.format.placement import Placement
from k3dist.model.attention import QuantizedSumLinear, SumLinear, split_attention
from k3dist.model.experts import ExpertParallelMoE
from k3dist.model.forms import split_length

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import kimi_k3


class _Given(nn.Module):
    """Stands in for the embedding table for one call: returns given embeddings."""

    def __init__(self, h: mx.array):
        super().__init__()
        object.__setattr__(self, "_h", h)

    def __call__(self, inputs: mx.array) -> mx.array:
        return self._h


def make_model_class(
    placement: Placement,
    rank: int,
    group: mx.distributed.Group | None,
    form: str = "placeholder",
    split_layers: list[int] | tuple = (),
) -> type[kimi_k3.Model]:
    """A ``kimi_k3.Model`` subclass whose MoE layers hold only ``rank``'s experts and
    whose ``split_layers`` hold only its share of the attention heads (the rank
    folder's ``attention.split_layers``); pass it to ``mlx_lm.utils.load_model``
    through ``get_model_classes``."""

    class ExpertParallelK3(kimi_k3.Model):
        def __init__(self, args: kimi_k3.ModelArgs):
            super().__init__(args)
            self.chunk_sizes: list[int] | None = None
            self.shapes_seen: set[tuple[int, int]] = set()
            # k3dist.serve.vision.Vision once a deployment turns images on
            self.vision = None
            tc = args.text_config
            for i, layer in enumerate(self.language_model.model.layers):
                if isinstance(layer.mlp, kimi_k3.KimiK3SparseMoE):
                    if i not in placement.owners:
                        raise ValueError(f"placement has no owners for MoE layer {i}")
                    layer.mlp = ExpertParallelMoE(tc, placement.local_table(i, rank), group, form)
            if split_layers and group is not None:
                split_attention(self, list(split_layers), group)

        def __call__(
            self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None
        ) -> mx.array:
            # With a fixed list of chunk sizes, any length runs as a sum of them, so
            # only warmed-up shapes ever reach the compiled graph (k3dist.serve.warmup).
            # Every (batch, tokens) shape run is recorded in ``shapes_seen``.
            B, T = inputs.shape[:2]
            if self.chunk_sizes is None or cache is None or T in self.chunk_sizes:
                self.shapes_seen.add((B, T))
                return self._forward(inputs, cache, input_embeddings)
            outs, start = [], 0
            for n in split_length(T, self.chunk_sizes):
                self.shapes_seen.add((B, n))
                emb = None if input_embeddings is None else input_embeddings[:, start : start + n]
                outs.append(self._forward(inputs[:, start : start + n], cache, emb))
                start += n
            return mx.concatenate(outs, axis=1)

        def _forward(self, inputs: mx.array, cache, input_embeddings: mx.array | None):
            """mlx-lm's forward; with ``input_embeddings`` (images) they stand in for
            the token embeddings (mlx-lm 0.32.2's kimi_k3 takes no embeddings)."""
            if input_embeddings is None:
                return super().__call__(inputs, cache)
            tm = self.language_model.model
            table = tm.embed_tokens
            tm.embed_tokens = _Given(input_embeddings)
            try:
                return super().__call__(inputs, cache)
            finally:
                tm.embed_tokens = table

        def embed_inputs(self, inputs: mx.array, *, pixel_values=None) -> mx.array:
            """Token embeddings with the image features at the pad rows (mlx-lm's
            server calls this for chat requests with images)."""
            h = self.language_model.model.embed_tokens(inputs)
            if pixel_values:
                if self.vision is None:
                    raise ValueError("this deployment serves text only (vision is off)")
                h = self.vision.inject(h, inputs, pixel_values)
            return h

        def set_collectives(self, on: bool) -> None:
            for layer in self.layers:
                if isinstance(layer.mlp, ExpertParallelMoE):
                    layer.mlp.set_collectives(on)
                for _, m in layer.named_modules():
                    if isinstance(m, (SumLinear, QuantizedSumLinear)):
                        m.collectives = on
                # KDA's compiled decode step (Metal) traced with the other setting
                if getattr(layer.self_attn, "_step", None) is not None:
                    layer.self_attn._step = None

        def load_weights(self, file_or_weights, strict: bool = True):
            """mlx-lm's, then each shared expert split by its intermediate dimension
            (``ExpertParallelMoE.shard_shared``): rank folders hold them whole, and the
            parent's forward sums their partial outputs in its all_sum, so a model with
            a group is correct once loaded, with no call left to the loader."""
            out = super().load_weights(file_or_weights, strict=strict)
            for layer in self.layers:
                if isinstance(layer.mlp, ExpertParallelMoE):
                    layer.mlp.shard_shared()
            return out

    return ExpertParallelK3
