"""Decode cost model for the real K3 on N boxes: per step (one token per request) and rank,
the bytes read, the FLOPs and the collectives of each way to split the model.

Modes (what each rank holds and computes; counts follow the code, not a sketch):

- ``ep-replicated`` (``k3dist.model``): attention, router, latent projections, norms
  and layer 0's dense MLP on every rank; shared experts split by their intermediate
  dimension; routed experts by a placement. One ``all_sum`` per MoE layer of the
  routed latent output (3584) + the shared partial output (7168).
- ``ep-split``: ``ep-replicated`` with attention split by heads as mlx-lm's
  ``kimi_k3.Model.shard`` splits it (KDA q/k/v/g/b/f_b/o projections, convs,
  ``A_log``, ``dt_bias``; MLA q_b/kv_b/g/o) and one more ``all_sum`` (7168) per
  layer after ``o_proj``. Replicated: KDA ``f_a_proj``, ``o_norm``; MLA ``q_a``,
  ``kv_a`` and their norms. Layer 0's dense MLP splits too (gate/up by rows, down_proj
  by its input, one more ``all_sum``): 186 collectives per step, as TP, counted from
  the running model by ``k3dist.serve.introspect`` (mini-K3: 12 = 6 + 5 + 1).
- ``tp`` (mlx-lm ``shard()``): attention as above, shared experts, every routed expert
  (intermediate 3072/N) and the dense MLP split; router, latent projections, norms,
  embedding and ``lm_head`` replicated. Collectives per step: one ``all_sum`` (7168)
  after every attention ``o_proj`` (93: the 69 KDA layers and 24 MLA layers alike),
  one per MoE layer (3584 + 7168, 92), one after the dense MLP (7168, 1): 186.
- ``pp`` (mlx-lm ``KimiK3TextModel.pipeline``): contiguous layer ranges (93 = 47 + 46
  for N = 2, the first range the larger), each rank all experts of its layers.
  Per step: one send/recv per boundary of the hidden state plus the AttnRes blocks
  done so far, then one ``all_gather`` of the output; every rank then runs the final
  norm and ``lm_head`` (in parallel). Decode runs the ranges one after the other.

Equations (per step; ``b`` = bytes at the build profile, ``N`` ranks):

    B_rank   = sum_layers( sum_groups s_g(mode) b_g + R_layer ) + state + head
    R_layer  = EP: E[max_r n_r] b_pair (+ rho b_expert, placeholder form)   [critical path]
               TP: k b_pair / N        PP: k b_pair (on the owning stage)
    F_rank   = 2 x (weight elements multiplied) + attention (MLA over the context, KDA state)
    t_comp   = max(B_rank / (BW eta), F_rank / (P phi))
    t_comm   = sum_c count_c (lambda + wire_c / beta),  wire = 2(N-1)/N size (all_sum),
               size (send), (N-1) size (all_gather)
    t_sync   = n_moe sigma (local form only: one host sync per MoE layer)
    t_step   = t_comp + t_comm + t_sync          (PP: sum over stages + hand-offs + head)
    tok/s    = 1 / t_step

``state`` is the KDA recurrent state (96 x 128 x 128 F32 per layer, split by heads
where attention is) read and written, plus the MLA latent cache (``context`` x 576 x
2 B per MLA layer, whole on every rank). ``s_g`` is 1 (replicated) or 1/N (split) per
tensor group and mode; ``n_r`` is the
number of the step's ``k`` routed pairs rank ``r`` owns: each MoE layer ends in an
``all_sum``, so a step waits for the busiest rank of every layer, E[max_r n_r] (exact
under uniform routing, sampled from routing counts when given). The mean per rank,
``k f_r b_pair`` with ``f_r`` the rank's owned (load-weighted) fraction, is reported
beside it. Placeholder form: every rank computes all ``k`` pairs (FLOPs), the
non-owned ones on one local expert; its weights are read from memory ``rho`` times per
layer (default 1: the redirected pairs run in the same gather kernel over the same
weights, so repeats hit the cache; the expert (17.5 MB) is re-read per layer because
92 of them do not stay cache-resident across a step). Local form: only owned pairs
are computed, after one host sync per MoE layer.

Per-box footprint: the largest rank's resident weights (mlx-lm drops the vision
tower at load) + cache (``batch`` requests at ``context``, not rounded to the cache step,
no prompt cache: what a server must budget is ``k3dist.format.kvmemory.serving_bytes``),
against the box's usable (wired less reserve) bytes. The build's size (``footprint``)
is the sum of every tensor at the profile's bits; for ``mxfp4`` (experts as shipped,
non-experts in their source dtypes) it is the source's 1,560,860,324,864 bytes.

Batch (``batch`` requests decoded in lockstep, one step each): weights are read once
per step, the routed experts read are the union of the batch's (sampled: B tokens, k
experts each, uniformly or from routing counts), FLOPs, caches, states and collective
payloads scale with B (latency is paid once); ``tok_s`` is then the aggregate.

Nothing overlaps in this model: collectives sit between dependent layers, and memory
and compute time are a roofline maximum. Prefill and the KV growth during a step are
not modelled; ``context`` sets the MLA latent cache read per step (per request).
"""

from __future__ import annotations

from k3dist.bench.costmodel.facts import (
    Facts,
    Layer,
    facts,
    footprint,
)
from k3dist.bench.costmodel.hardware import (
    ACT_BYTES,
    BACKENDS,
    EP_MODES,
    FORMS,
    GROUPS,
    HEAD_SPLIT,
    MODES,
    PROFILES,
    SOURCES,
    SPLIT,
    Backend,
    Hardware,
    Profile,
    plan_profile,
)
from k3dist.bench.costmodel.loads import (
    Load,
    routed_loads,
)
from k3dist.bench.costmodel.prefill import (
    PREFILL_FLOPS_FRACTION,
    PREFILL_SOURCES,
    chunk_tradeoff,
    prefill,
    prefill_chunk,
)
from k3dist.bench.costmodel.projection import (
    ANCHORS,
    GRADED_LOCAL_LOSS,
    compare_anchors,
    hardware_json,
    implied,
    joint_fit,
    project,
    with_backend,
)
from k3dist.bench.costmodel.step import (
    attention_bytes,
    box_footprint,
    bytes_per_token,
    collectives,
    pp_stages,
    shared_splits,
    split_fraction,
)

__all__ = [
    "ACT_BYTES",
    "BACKENDS",
    "Backend",
    "EP_MODES",
    "FORMS",
    "GROUPS",
    "HEAD_SPLIT",
    "Hardware",
    "MODES",
    "PROFILES",
    "Profile",
    "SOURCES",
    "SPLIT",
    "plan_profile",
    "Facts",
    "Layer",
    "facts",
    "footprint",
    "Load",
    "routed_loads",
    "attention_bytes",
    "box_footprint",
    "bytes_per_token",
    "collectives",
    "pp_stages",
    "shared_splits",
    "split_fraction",
    "ANCHORS",
    "GRADED_LOCAL_LOSS",
    "compare_anchors",
    "hardware_json",
    "implied",
    "joint_fit",
    "project",
    "with_backend",
    "PREFILL_FLOPS_FRACTION",
    "PREFILL_SOURCES",
    "chunk_tradeoff",
    "prefill",
    "prefill_chunk",
]
