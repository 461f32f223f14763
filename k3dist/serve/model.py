"""Kimi K3 from mlx-lm's ``kimi_k3`` with expert-parallel MoE layers.

Everything but the routed experts is mlx-lm's own module. Each
``KimiK3SparseMoE`` is replaced by ``ExpertParallelMoE``: the router, latent
down-projection and (a slice of) the shared experts run on every rank on the same
input; the routed experts are only the ones this rank owns; one ``all_sum`` joins
the routed latent output and the shared-expert partial output; the routed norm
and up-projection run after the sum, as in the single-process model.

Pairs (token, expert) a rank does not own are handled in one of two forms:

- ``placeholder`` (sync-free): redirected to local expert 0 with weight 0. The
  graph stays lazy (no host sync), at the cost of computing those pairs on a
  cheap, cache-resident expert.
- ``local``: the routing is evaluated on the host, only owned pairs are gathered
  and computed, their outputs scattered back. One host sync per MoE layer.

With attention split (``split_layers``), those layers' attention heads (and the dense
layer's MLP) are divided across ranks by mlx-lm's own ``kimi_k3.Model.shard`` applied
to the freshly built model before its (per-rank) weights load; the input-split
projections (``o_proj``, ``down_proj``) become :class:`SumLinear`, whose ``all_sum``
obeys ``set_collectives`` like the MoE's.
"""

from __future__ import annotations

from types import SimpleNamespace

from k3dist.format.deployment import MOE_FORMS
from k3dist.format.placement import Placement
from k3dist.serve import compat
from k3dist.serve.warmup import split_length

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear, shard_inplace
from mlx_lm.models import kimi_k3
from mlx_lm.models.switch_layers import SwitchGLU


def resolve_form(form: str) -> str:
    """``auto``: sync-free on Metal (a host sync per layer cost the published graded
    build 2.06x decode there), local-only on CPU (benchmarks/moe_step.py)."""
    if form != "auto":
        return form
    return "placeholder" if mx.metal.is_available() else "local"


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


class ExpertParallelMoE(kimi_k3.KimiK3SparseMoE):
    def __init__(self, args: kimi_k3.TextArgs, local_table: np.ndarray,
                 group: mx.distributed.Group | None, form: str = "placeholder"):
        super().__init__(args)
        if form not in MOE_FORMS:
            raise ValueError(f"moe form must be one of {MOE_FORMS}, not {form!r}")
        n_local = int((local_table >= 0).sum())
        self.switch_mlp = SwitchGLU(
            self.latent_size or args.hidden_size, args.moe_intermediate_size, n_local,
            activation=kimi_k3.SiTU(args.activation_situ_beta or 1.0,
                                    args.activation_situ_linear_beta))
        self.group = group if group is not None and group.size() > 1 else None
        self.form = form
        # Underscored: kept out of parameters(). -1 marks another rank's expert.
        self._table_np = np.asarray(local_table, dtype=np.int32)
        self._table = mx.array(self._table_np)
        self._owns_all = n_local == len(local_table)
        # True once the shared experts are split across ranks: their partial output
        # then rides in the all_sum; a replicated shared expert is added after it.
        self._shared_split = False
        # Off only during warm-up: shapes compile on each rank without a peer.
        self.collectives = True

    def _route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        a = self.args
        return compat.group_expert_select(
            self.gate(x), self.e_score_correction_bias, a.num_experts_per_token,
            a.num_expert_group, a.topk_group, a.routed_scaling_factor, a.moe_renormalize)

    def _routed_placeholder(self, y: mx.array, inds: mx.array, w: mx.array) -> mx.array:
        if not self._owns_all:
            local = self._table[inds]
            owned = local >= 0
            inds = mx.where(owned, local, 0)
            w = mx.where(owned, w, mx.zeros_like(w))
        return (self.switch_mlp(y, inds) * w[..., None]).sum(axis=-2)

    def _routed_local(self, y: mx.array, inds: mx.array, w: mx.array) -> mx.array:
        k = inds.shape[-1]
        local = self._table_np[np.array(inds).reshape(-1)]  # host sync
        pos = np.flatnonzero(local >= 0)
        flat = y.reshape(-1, y.shape[-1])
        out = mx.zeros_like(flat)
        if pos.size:
            tok = mx.array(pos // k)
            idx = mx.array(local[pos])[:, None]
            wsel = w.reshape(-1)[mx.array(pos)]
            ysel = self.switch_mlp(flat[tok], idx).squeeze(-2) * wsel[:, None].astype(y.dtype)
            out = out.at[tok].add(ysel)
        return out.reshape(y.shape)

    def __call__(self, x: mx.array) -> mx.array:
        inds, w = self._route(x)
        y = self.routed_expert_down_proj(x) if self.latent_size is not None else x
        if self.form == "local" and not self._owns_all:
            y = self._routed_local(y, inds, w)
        else:
            y = self._routed_placeholder(y, inds, w)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.group is not None and self.collectives:
            # One collective for routed + shared partial sums.
            if shared is not None and self._shared_split:
                split = y.shape[-1]
                both = mx.distributed.all_sum(mx.concatenate([y, shared], axis=-1),
                                              group=self.group)
                y, shared = mx.split(both, [split], axis=-1)
            else:
                y = mx.distributed.all_sum(y, group=self.group)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.latent_size is not None:
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared
        return y


class _Given(nn.Module):
    """Stands in for the embedding table for one call: returns given embeddings."""

    def __init__(self, h: mx.array):
        super().__init__()
        object.__setattr__(self, "_h", h)

    def __call__(self, inputs: mx.array) -> mx.array:
        return self._h


def make_model_class(placement: Placement, rank: int, group: mx.distributed.Group | None,
                     form: str = "placeholder", split_layers: list[int] | tuple = ()
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
                    layer.mlp = ExpertParallelMoE(
                        tc, placement.local_table(i, rank), group, form)
            if split_layers and group is not None:
                split_attention(self.layers, list(split_layers), group)

        def __call__(self, inputs: mx.array, cache=None,
                     input_embeddings: mx.array | None = None) -> mx.array:
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
                emb = None if input_embeddings is None else input_embeddings[:, start:start + n]
                outs.append(self._forward(inputs[:, start:start + n], cache, emb))
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
                    layer.mlp.collectives = on
                for _, m in layer.named_modules():
                    if isinstance(m, (SumLinear, QuantizedSumLinear)):
                        m.collectives = on
                # KDA's compiled decode step (Metal) traced with the other setting
                if getattr(layer.self_attn, "_step", None) is not None:
                    layer.self_attn._step = None

        def shard_shared_experts(self) -> None:
            """Split each shared expert by its intermediate dimension (what mlx's
            shard_inplace does); the partial outputs ride in the MoE all_sum."""
            if group is None or group.size() == 1:
                return
            n = group.size()
            for layer in self.layers:
                m = layer.mlp
                if isinstance(m, ExpertParallelMoE) and m.shared_experts is not None:
                    se = m.shared_experts
                    # A quantized down_proj splits along its input only at whole groups.
                    cols = [a.shape[-1] for a in se.down_proj.parameters().values()]
                    if se.gate_proj.weight.shape[0] % n or any(c % n for c in cols):
                        continue  # stays replicated, added after the all_sum
                    m._shared_split = True
                    shard_inplace(se.gate_proj, "all-to-sharded",
                                                        group=group)
                    shard_inplace(se.up_proj, "all-to-sharded",
                                                        group=group)
                    shard_inplace(se.down_proj, "sharded-to-all",
                                                        group=group)

    return ExpertParallelK3
