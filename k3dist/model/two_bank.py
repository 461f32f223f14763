"""Two-bank routed experts (graded builds) inside expert parallelism.

A graded MoE layer holds two expert stacks: the **lo bank** (``mlp.switch_mlp``:
affine low-bit, every expert not promoted, plus the promoted ones when the build keeps
a fallback copy) and the **hi bank** (``mlp.switch_hi``: the promoted experts in their
original MXFP4 bytes). Each stack holds its experts in ascending global id; with
expert parallelism each rank holds the rows of both stacks it owns (placement).

Routing (static shapes, no host sync in the ``placeholder`` form):

- the router's top-k is unchanged; of a token's routes to promoted experts, the
  ``k_hi`` with the largest router weight go to the hi bank (``k_hi`` slots per token,
  a slot without a route computes expert 0 with weight 0);
- every route also runs through the lo bank (``k`` slots); a route that the lo bank
  does not serve (promoted and taken by the hi bank, not held in lo, or owned by another
  rank) computes lo expert 0 and is masked to weight 0;
- a promoted route beyond ``k_hi`` uses its lo fallback copy when the build has one,
  otherwise it is **dropped** (weight 0). ``count_routes`` (off by default, off the hot
  path: lazy sums read by :meth:`TwoBankMoE.route_stats`) counts overflows and drops.

The hi selection is made from the global routing, which is identical on every rank, so
a 2-rank run drops exactly the routes a single process drops. Per-route outputs of the
two banks are merged by position before the weighted sum over ``k``, in the same order
as mlx-lm's single-bank ``(y * w).sum(-2)``: with both banks holding the same weights
the two-bank layer equals the single-bank layer bit for bit.

On disk: ``config.json`` ``graded`` (:class:`GradedMap`): ``hi`` (promoted global ids
per MoE layer), ``k_hi`` per layer, ``lo_fallback``, ``lo`` (format name); the
``quantization`` block has a per-path entry for each bank's projections.
"""

from __future__ import annotations

from pathlib import Path

from k3dist.format import layout
from k3dist.format.folder import load_config
from k3dist.format.graded import GRADED_KEY, GradedError, GradedMap
from k3dist.format.placement import Placement, contiguous
from k3dist.format.sfile import mx_dtype
from k3dist.model import ep
from k3dist.model.experts import ExpertParallelMoE
from k3dist.model.forms import form_for

import mlx.core as mx
import numpy as np
from mlx_lm.models import kimi_k3
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import load_model


class TwoBankMoE(ExpertParallelMoE):
    """``ExpertParallelMoE`` with a lo and a hi expert stack (module doc).

    mlx-lm calls ``switch_mlp(y, inds)`` without the router weights, and the hi bank's
    choice needs them (the ``k_hi`` heaviest promoted routes), so this layer alone runs
    its own forward: mlx-lm's ``KimiK3SparseMoE.__call__`` with the routed step
    (``_routed_placeholder`` / ``_routed_local``) in place of ``switch_mlp`` and the
    weighted sum; tests/model/test_banks.py holds it equal to the single-bank layer.

    Letting the parent's forward run instead would need the weights inside
    ``switch_mlp``: ranking by what it sees (``inds``) is not the weights' order, and
    the alternative, a ``gate`` that keeps its output for ``switch_mlp`` to re-run
    ``_group_expert_select`` on, is a side channel between sibling modules (state
    carried across a call, wrong if anything calls ``gate`` or ``switch_mlp`` alone,
    as ``_route`` and build/calibrate.py do) plus a second top-k per layer; not done."""

    def __init__(
        self,
        args: kimi_k3.TextArgs,
        owners: np.ndarray,
        rank: int,
        group: mx.distributed.Group | None,
        form: str,
        hi_ids: list[int],
        k_hi: int,
        lo_fallback: bool,
    ):
        owners = np.asarray(owners)
        E = len(owners)
        promoted = np.zeros(E, dtype=bool)
        promoted[hi_ids] = True
        in_lo = np.ones(E, dtype=bool) if lo_fallback else ~promoted
        lo_table = _table(in_lo & (owners == rank))
        super().__init__(args, lo_table, group, form)
        # switch_mlp: this rank's lo rows, addressed by local row (the tables below)
        self.switch_mlp = SwitchGLU(
            self.latent_size or args.hidden_size,
            args.moe_intermediate_size,
            int((lo_table >= 0).sum()),
            activation=kimi_k3.SiTU(
                args.activation_situ_beta or 1.0, args.activation_situ_linear_beta
            ),
        )
        self._table_np = lo_table
        self._table = mx.array(lo_table)
        self._hi_table_np = _table(promoted & (owners == rank))
        self._hi_table = mx.array(self._hi_table_np)
        self._promoted = mx.array(promoted)
        self._in_lo = mx.array(in_lo)
        self._promoted_np, self._lo_fallback = promoted, bool(lo_fallback)
        self.k_hi = min(int(k_hi), args.num_experts_per_token) if promoted.any() else 0
        n_hi = int((self._hi_table_np >= 0).sum())
        if self.k_hi and n_hi == 0:
            raise GradedError(
                f"rank {rank} owns none of the {int(promoted.sum())} promoted "
                "experts of a layer: its hi bank would be empty; place with "
                "k3dist.format.graded.balance_hi (slicing does)"
            )
        self.switch_hi = None
        if self.k_hi:
            self.switch_hi = SwitchGLU(
                self.latent_size or args.hidden_size,
                args.moe_intermediate_size,
                n_hi,
                activation=kimi_k3.SiTU(
                    args.activation_situ_beta or 1.0, args.activation_situ_linear_beta
                ),
            )
        # Opt-in route counting (lazy; route_stats() reads it): overflowing promoted
        # routes, dropped routes, token-layers with an overflow, routes, tokens.
        self.count_routes = False
        self.record_routes = False  # keep the last ids (record_last_routes)
        self._counts = mx.zeros((5,), dtype=mx.int32)

    def _select_hi(self, inds: mx.array, w: mx.array):
        """Global choice (same on every rank): the ``k_hi`` promoted routes with the
        largest router weight. Returns (pos [.., k_hi]: the route each hi slot takes,
        hit [.., k_hi, k]: slot j took route i, taken [.., k], promoted [.., k])."""
        prom = self._promoted[inds]
        k = inds.shape[-1]
        if not self.k_hi:
            return None, None, mx.zeros(inds.shape, dtype=mx.bool_), prom
        score = mx.where(prom, w, mx.array(-1.0, dtype=w.dtype))  # router weights >= 0
        # indices carry no gradient (DWQ differentiates through this layer)
        pos = mx.stop_gradient(
            mx.argpartition(-score, kth=self.k_hi - 1, axis=-1)[..., : self.k_hi]
        )
        valid = mx.take_along_axis(prom, pos, axis=-1)
        hit = (pos[..., None] == mx.arange(k)) & valid[..., None]  # [.., k_hi, k]
        return pos, hit, hit.any(axis=-2), prom

    def _count(self, inds: mx.array, taken: mx.array, prom: mx.array) -> None:
        over = prom & ~taken
        drop = over & ~self._in_lo[inds]
        n_tok = inds.size // inds.shape[-1]
        self._counts = self._counts + mx.stack(
            [over.sum(), drop.sum(), over.any(axis=-1).sum(), mx.array(inds.size), mx.array(n_tok)]
        ).astype(mx.int32)

    def route_stats(self) -> dict:
        """Counts since the last reset (a host sync; call between steps, not in them)."""
        o, d, t, r, n = (int(x) for x in np.array(self._counts))
        return {
            "overflow_routes": o,
            "dropped_routes": d,
            "overflow_token_layers": t,
            "routes": r,
            "tokens": n,
            "drop_rate": d / r if r else 0.0,
            "overflow_token_rate": t / n if n else 0.0,
        }

    def reset_route_stats(self) -> None:
        self._counts = mx.zeros((5,), dtype=mx.int32)

    @property
    def last_routes(self) -> mx.array | None:
        return getattr(self, "_routes", None)

    def record_last_routes(self, on: bool = True) -> None:
        self.record_routes = on
        self.forget_routes()

    def forget_routes(self) -> None:
        object.__setattr__(self, "_routes", None)

    def sampled_overflow(self, ids: np.ndarray) -> tuple[int, int]:
        """A token's promoted routes beyond ``k_hi`` overflow (the hi bank takes the
        ``k_hi`` heaviest); with no lo fallback every one of them is dropped: both
        counts follow from the ids alone."""
        n_prom = self._promoted_np[ids].sum(axis=-1)
        over = int(np.maximum(n_prom - self.k_hi, 0).sum())
        return over, 0 if self._lo_fallback else over

    def __call__(self, x: mx.array) -> mx.array:
        inds, w = self._route(x)
        if self.record_routes:  # sampled by k3dist.serve.metrics (serving only)
            object.__setattr__(self, "_routes", inds)
        y = self.routed_expert_down_proj(x) if self.latent_size is not None else x
        local = form_for(self.form, inds.size // inds.shape[-1]) == "local"
        y = (self._routed_local if local else self._routed_placeholder)(y, inds, w)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.sharding_group is not None:
            # one collective for routed + shared partial sums, as mlx-lm's
            if shared is not None:
                both = mx.distributed.all_sum(
                    mx.concatenate([y, shared], axis=-1), group=self.sharding_group
                )
                y, shared = mx.split(both, [y.shape[-1]], axis=-1)
            else:
                y = mx.distributed.all_sum(y, group=self.sharding_group)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.latent_size is not None:
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared
        return y if self.replicated_shared is None else y + self.replicated_shared(x)

    def _routed_placeholder(self, y: mx.array, inds: mx.array, w: mx.array) -> mx.array:
        pos, hit, taken, prom = self._select_hi(inds, w)
        if self.count_routes:
            self._count(inds, taken, prom)
        lo = self._table[inds]
        lo_ok = lo >= 0
        out = self.switch_mlp(y, mx.where(lo_ok, lo, 0))  # [.., k, D]
        keep = lo_ok & ~taken
        if self.switch_hi is not None:
            hi = mx.take_along_axis(self._hi_table[inds], pos, axis=-1)  # [.., k_hi]
            hi_ok = hi >= 0
            hi_out = self.switch_hi(y, mx.where(hi_ok, hi, 0))  # [.., k_hi, D]
            slot = mx.stop_gradient(mx.argmax(hit, axis=-2))  # route -> the hi slot that took it
            on_hi = taken & mx.take_along_axis(hi_ok, slot, axis=-1)
            hi_route = mx.take_along_axis(hi_out, slot[..., None], axis=-2)
            out = mx.where(on_hi[..., None], hi_route, out)
            keep = keep | on_hi
        w = mx.where(keep, w, mx.zeros_like(w))
        return (out * w[..., None]).sum(axis=-2)

    def _routed_local(self, y: mx.array, inds: mx.array, w: mx.array) -> mx.array:
        _, _, taken, prom = self._select_hi(inds, w)
        if self.count_routes:
            self._count(inds, taken, prom)
        k = inds.shape[-1]
        mx.eval(inds, taken)  # the one host sync of this form
        flat_inds, flat_taken = np.array(inds).reshape(-1), np.array(taken).reshape(-1)
        flat = y.reshape(-1, y.shape[-1])
        wflat = w.reshape(-1)
        out = mx.zeros_like(flat)
        for bank, table, want in (
            (self.switch_mlp, self._table_np, ~flat_taken),
            (self.switch_hi, self._hi_table_np, flat_taken),
        ):
            if bank is None:
                continue
            local = table[flat_inds]
            pos = np.flatnonzero((local >= 0) & want)
            if pos.size:
                tok = mx.array(pos // k)
                idx = mx.array(local[pos])[:, None]
                ysel = bank(flat[tok], idx).squeeze(-2)
                out = out.at[tok].add(ysel * wflat[mx.array(pos)][:, None].astype(y.dtype))
        return out.reshape(y.shape)


def _table(mask: np.ndarray) -> np.ndarray:
    """global id -> row in the stack of the ids where ``mask`` holds, else -1."""
    t = np.full(len(mask), -1, dtype=np.int32)
    t[mask] = np.arange(int(mask.sum()), dtype=np.int32)
    return t


def make_model_class(
    placement: Placement,
    rank: int,
    group: mx.distributed.Group | None,
    form: str,
    gmap: GradedMap,
    split_layers: list[int] | tuple = (),
) -> type[kimi_k3.Model]:
    """``k3dist.model.ep.make_model_class`` with every MoE layer two-banked."""
    base = ep.make_model_class(placement, rank, group, form, split_layers)

    class GradedK3(base):
        def __init__(self, args: kimi_k3.ModelArgs):
            super().__init__(args)
            tc = args.text_config
            for i, layer in enumerate(self.language_model.model.layers):
                if isinstance(layer.mlp, ExpertParallelMoE):
                    layer.mlp = TwoBankMoE(
                        tc,
                        np.asarray(placement.owners[i]),
                        rank,
                        group,
                        form,
                        gmap.hi_ids(i),
                        gmap.k_hi.get(i, 0),
                        gmap.lo_fallback,
                    )

        def moe_layers(self) -> list[TwoBankMoE]:
            return [layer.mlp for layer in self.layers if isinstance(layer.mlp, TwoBankMoE)]

        def count_routes(self, on: bool = True) -> None:
            for m in self.moe_layers():
                m.count_routes = on
                m.reset_route_stats()

        def route_stats(self) -> dict:
            """Summed over layers (a host sync)."""
            per = [m.route_stats() for m in self.moe_layers()]
            tot = {
                k: sum(p[k] for p in per)
                for k in (
                    "overflow_routes",
                    "dropped_routes",
                    "overflow_token_layers",
                    "routes",
                    "tokens",
                )
            }
            tot["drop_rate"] = tot["dropped_routes"] / tot["routes"] if tot["routes"] else 0.0
            tot["overflow_token_layer_rate"] = (
                tot["overflow_token_layers"] / tot["tokens"] if tot["tokens"] else 0.0
            )
            return tot

    return GradedK3


def build_class(config: dict, form: str = "placeholder", where: str = "config"):
    """The one-process model class of a graded build's ``config`` (every expert local)."""
    gmap = GradedMap.from_config(config)
    if gmap is None:
        raise GradedError(
            f"{where}: no {GRADED_KEY!r} block; not a graded build "
            "(python -m k3dist.pipeline.promote makes one)"
        )
    moe = layout.moe_layers(layout.text_config(config))
    placement = contiguous(gmap.num_experts, 1, moe)
    return make_model_class(placement, 0, None, form, gmap)


def load_build(
    path: str | Path, dtype: str = "float32", form: str = "placeholder", lazy: bool = False
):
    """A graded build in one process (every expert local): (model, config); ``lazy``:
    nothing is read until used (k3dist.pipeline.stream runs it a layer at a time)."""
    path = Path(path)
    cls = build_class(load_config(path), form, where=f"{path}/config.json")
    model, config = load_model(
        path, lazy=True, strict=True, get_model_classes=lambda config: (cls, kimi_k3.ModelArgs)
    )
    model.set_dtype(mx_dtype(dtype))
    if not lazy:
        mx.eval(model.parameters())
    return model, config
