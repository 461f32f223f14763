"""The expert-parallel MoE: mlx-lm's ``KimiK3SparseMoE`` with its routed experts and
their collective swapped, and its own forward run.

mlx-lm's forward computes the router, the latent down-projection,
``switch_mlp(y, inds)`` (one output per (token, route)), the router-weighted sum, the
shared experts, one ``all_sum`` of routed + shared when ``sharding_group`` is set,
the routed norm and the up-projection. Expert parallelism changes two things:

- ``switch_mlp`` is :class:`OwnedExperts`: it takes global expert ids and returns
  the outputs of the pairs whose expert this rank owns and zeros for the others, so
  the parent's weighted sum is this rank's partial sum;
- ``sharding_group`` is the EP group (the parent's one collective joins the partial
  sums), set to None while collectives are off (warm-up).

Pairs (token, expert) a rank does not own are handled in one of two forms:

- ``placeholder`` (sync-free): redirected to local expert 0, output zeroed. The graph
  stays lazy (no host sync), at the cost of computing those pairs on a cheap,
  cache-resident expert.
- ``local``: the routing is evaluated on the host, only owned pairs are gathered and
  computed, their outputs scattered into zeros. One host sync per MoE layer.
- ``phased``: placeholder for short calls (decode steps), local for prefill chunks
  (``k3dist.model.forms.form_for``).

The parent sums the shared experts inside its collective, so they must be split across
ranks (``shard_shared``: by their intermediate dimension, as mlx's ``shard_inplace``
does); one that does not divide stays replicated and is taken out of the parent's view
(``shared_experts = None``) and added after its forward instead.
"""

from __future__ import annotations

from k3dist.format.placement import MOE_FORMS
from k3dist.model import compat
from k3dist.model.forms import form_for

import mlx.core as mx
import numpy as np
from mlx.nn.layers.distributed import shard_inplace
from mlx_lm.models import kimi_k3
from mlx_lm.models.switch_layers import SwitchGLU


class OwnedExperts(SwitchGLU):
    """The routed experts this rank owns, addressed by global id: ``[.., k, D]`` outputs,
    zeros where another rank owns the expert. Parameters as mlx-lm's ``switch_mlp``
    (this rank's rows of each stack)."""

    def __init__(self, args: kimi_k3.TextArgs, local_table: np.ndarray, form: str):
        if form not in MOE_FORMS:
            raise ValueError(f"moe form must be one of {MOE_FORMS}, not {form!r}")
        self_dim = args.routed_expert_hidden_size or args.hidden_size
        n_local = int((np.asarray(local_table) >= 0).sum())
        super().__init__(
            self_dim,
            args.moe_intermediate_size,
            n_local,
            activation=kimi_k3.SiTU(
                args.activation_situ_beta or 1.0, args.activation_situ_linear_beta
            ),
        )
        self.form = form
        # Underscored: kept out of parameters(). -1 marks another rank's expert.
        self._table_np = np.asarray(local_table, dtype=np.int32)
        self._table = mx.array(self._table_np)
        self._owns_all = n_local == len(local_table)
        # keep the last call's ids (``ExpertParallelMoE.last_routes``): serving only, so
        # no traced call (calibration, DWQ) holds on to its graph through them
        self.record_routes = False

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        if self.record_routes:  # a plain attribute, not a module member
            object.__setattr__(self, "_routes", inds)
        if self._owns_all:
            return super().__call__(x, inds)
        if form_for(self.form, inds.size // inds.shape[-1]) == "local":
            return self._local(x, inds)
        local = self._table[inds]
        owned = local >= 0
        out = super().__call__(x, mx.where(owned, local, 0))
        return mx.where(owned[..., None], out, mx.zeros_like(out))

    def _local(self, x: mx.array, inds: mx.array) -> mx.array:
        k = inds.shape[-1]
        local = self._table_np[np.array(inds).reshape(-1)]  # host sync
        pos = np.flatnonzero(local >= 0)
        flat = x.reshape(-1, x.shape[-1])
        out = mx.zeros((local.size, x.shape[-1]), dtype=x.dtype)
        if pos.size:
            p = mx.array(pos)
            ysel = super().__call__(flat[mx.array(pos // k)], mx.array(local[pos])[:, None])
            out[p] = ysel.squeeze(-2).astype(out.dtype)
        return out.reshape(*inds.shape, x.shape[-1])


class ExpertParallelMoE(kimi_k3.KimiK3SparseMoE):
    """mlx-lm's MoE with :class:`OwnedExperts` as ``switch_mlp`` and the EP group as
    ``sharding_group`` (module doc)."""

    def __init__(
        self,
        args: kimi_k3.TextArgs,
        local_table: np.ndarray,
        group: mx.distributed.Group | None,
        form: str = "placeholder",
    ):
        super().__init__(args)
        self.switch_mlp = OwnedExperts(args, local_table, form)
        self.form = form
        self.group = group if group is not None and group.size() > 1 else None
        self.sharding_group = self.group
        # a shared expert that could not be split (shard_shared); None otherwise
        self.replicated_shared = None
        self._shared_is_split = False

    @property
    def _shared_split(self) -> bool:
        """Whether the shared experts' partial output rides in the all_sum."""
        return self.group is not None and self.shared_experts is not None

    def _route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The router mlx-lm's forward runs: (expert ids, weights), for callers that read
        the routing (calibration, DWQ, the two-bank forward, benchmarks)."""
        a = self.args
        return compat.group_expert_select(
            self.gate(x),
            self.e_score_correction_bias,
            a.num_experts_per_token,
            a.num_expert_group,
            a.topk_group,
            a.routed_scaling_factor,
            a.moe_renormalize,
        )

    @property
    def last_routes(self) -> mx.array | None:
        """The global expert ids ``[.., k]`` of this layer's last call: a reference to
        an array the step evaluates anyway, which ``k3dist.serve.metrics`` copies to the
        host now and then (off the hot path)."""
        return getattr(self.switch_mlp, "_routes", None)

    def record_last_routes(self, on: bool = True) -> None:
        """Keep (or stop keeping) the last call's expert ids for ``last_routes``."""
        self.switch_mlp.record_routes = on
        self.forget_routes()

    def forget_routes(self) -> None:
        object.__setattr__(self.switch_mlp, "_routes", None)

    def sampled_overflow(self, ids: np.ndarray) -> tuple[int, int]:
        """(promoted routes beyond ``k_hi``, those dropped) among routes ``ids``
        ``[tokens, k]``: none with a single bank (``TwoBankMoE`` counts them)."""
        return 0, 0

    def set_collectives(self, on: bool) -> None:
        """Off only during warm-up: shapes compile on each rank without a peer."""
        self.sharding_group = self.group if on else None

    def shard_shared(self) -> None:
        """Split the shared experts by their intermediate dimension across the group
        (mlx-lm's ``shard()`` does the same), once, after their weights load (the EP
        model's ``load_weights`` calls it). A quantized ``down_proj`` splits along its
        input only at whole groups: one that does not stays replicated, outside the
        parent's collective."""
        se = self.shared_experts
        if self.group is None or se is None or self._shared_is_split:
            return
        self._shared_is_split = True
        n = self.group.size()
        cols = [a.shape[-1] for a in se.down_proj.parameters().values()]
        if se.gate_proj.weight.shape[0] % n or any(c % n for c in cols):
            self.replicated_shared, self.shared_experts = se, None
            return
        shard_inplace(se.gate_proj, "all-to-sharded", group=self.group)
        shard_inplace(se.up_proj, "all-to-sharded", group=self.group)
        shard_inplace(se.down_proj, "sharded-to-all", group=self.group)

    def __call__(self, x: mx.array) -> mx.array:
        y = super().__call__(x)
        # mlx-lm adds its shared experts after the up-projection: the same order
        return y if self.replicated_shared is None else y + self.replicated_shared(x)
