"""The memory a K3 config implies beside its weights, on one rank: the KV cache and
recurrent state (per request and per serving load) and the activations of a prefill chunk.

One arithmetic for the planner (``k3dist.pipeline.byte_budget``: what a build must leave room for)
and the server's preflight (``k3dist.serve.preflight``: whether a deployment's
``memory_headroom_gib`` covers it). What mlx-lm's ``kimi_k3`` keeps for a request
(``Model.make_cache``):

- an MLA layer: a ``KVCache`` of the latent, ``kv_lora_rank + qk_rope_head_dim`` values per
  token in the activation dtype, grown in steps of 256 tokens. Never divided across ranks:
  the latent projection (``kv_a_proj_with_mqa``) is whole on every rank, split or not;
- a KDA layer: an ``ArraysCache`` of the conv state (``(kernel - 1) x 3 x heads x head_dim``,
  activation dtype) and the recurrent state (``heads x head_dim^2``, F32), whatever the
  context. A rank that holds a share of the layer's heads (attention split) holds that
  share of its state.

Serving (mlx-lm's ``BatchGenerator`` under ``k3dist.serve.server``) holds at once:

- up to ``max_batch`` requests (the prompt batch and the decode batch together never exceed
  ``decode_concurrency``), each up to ``max_context`` tokens: a batch's caches are
  right-aligned and trimmed to the longest row;
- the prompt cache (``k3dist.serve.prompt_cache.K3PromptCache``): at most
  :data:`PROMPT_CACHE_ENTRIES` entries, evicted by the tokens they hold after each insert
  (``prompt_cache_tokens``, default 4 x ``max_context``), but the newest entry is always
  kept, so the entries hold at most ``max(prompt_cache_tokens, max_context)`` tokens; while
  an entry is inserted (before the eviction runs) one more entry of up to ``max_context``
  tokens. Every entry carries a whole KDA state, however short it is, and up to 255 tokens
  of cache-step slack per MLA layer (a copy of a growing ``KVCache``).

Prefill (:func:`prefill_activation_bytes`; one prompt at a time, ``prompt_concurrency`` 1,
in chunks of ``prefill_chunk`` tokens): the peak of one chunk at full context, a model, not
a measurement: an MLA layer decompresses k and v for the whole context
(``heads x context x (qk_nope_head_dim + v_head_dim)``) and builds the rope scores and the
attention scores (``2 x heads x chunk x context``: mlx-lm's fallback path materialises
both), in the activation dtype, over the heads the rank holds; plus the chunk's logits
(F32), the hidden states of the AttnRes block stack (``chunk x hidden x (2 x blocks + 4)``)
and the MoE intermediates (``chunk x top_k x moe_intermediate x 3``).

Joining (:func:`need_bytes`): when a prefilled prompt joins the decode batch, mlx-lm's
``BatchKVCache.extend`` concatenates the batch's caches, so for a moment a second copy of
them exists (at most the requests' bytes). It never coincides with a prefill chunk (the
prompt is prefilled and evaluated first), so the peak beside what serving holds is the
larger of the two.

Not counted here: the decode step's own (small) activations and MLX's allocator cache;
the deployment's headroom (and the plan's ``headroom`` beyond every modelled need) must
hold those too.
"""

from __future__ import annotations

from k3dist.format.layout import kda_layers
from k3dist.format.sfile import COMPUTE_DTYPES, itemsize

GiB = 1 << 30
CACHE_STEP = 256  # mlx-lm KVCache growth step (tokens)
PROMPT_CACHE_ENTRIES = 8  # mlx-lm server's prompt_cache_size (k3dist.serve.server.cli_args)
PROMPT_CACHE_CONTEXTS = 4  # the prompt cache's default bound, in max_context's


def prompt_cache_bound(prompt_cache_tokens: int | None, context: int) -> int:
    """Tokens the prompt cache may hold: the deployment's ``prompt_cache_tokens``, or
    (None or 0) :data:`PROMPT_CACHE_CONTEXTS` x ``context``."""
    return prompt_cache_tokens or PROMPT_CACHE_CONTEXTS * context


STATE_BYTES = 4  # the KDA recurrent state is F32 whatever the compute dtype


def act_bytes(dtype: str) -> int:
    """Bytes per value of the caches in a compute dtype (MLX name)."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(COMPUTE_DTYPES)}, not {dtype!r}")
    return itemsize(dtype)


def mla_layers(tc: dict) -> list[int]:
    """0-based indices of the MLA (full attention) layers: every layer that is not KDA."""
    kda = kda_layers(tc)
    return [i for i in range(tc["num_hidden_layers"]) if i not in kda]


def mla_layer_bytes_per_token(tc: dict, act: int = 2) -> int:
    """One token's latent cache in one MLA layer (``kv_lora_rank + qk_rope_head_dim``
    values; the same on every rank)."""
    return (tc["kv_lora_rank"] + tc["qk_rope_head_dim"]) * act


def latent_bytes_per_token(tc: dict, act: int = 2) -> int:
    """One token's MLA latent cache over all MLA layers (the same on every rank)."""
    return len(mla_layers(tc)) * mla_layer_bytes_per_token(tc, act)


def kda_layer_state_bytes(tc: dict, act: int = 2) -> int:
    """One request's state in one KDA layer, all its heads: the F32 recurrent state
    ``heads x head_dim^2`` + the conv state ``(kernel - 1) x 3 x heads x head_dim``."""
    lc = tc["linear_attn_config"]
    heads, dim = lc["num_heads"], lc["head_dim"]
    return (
        STATE_BYTES * heads * dim * dim + act * (lc["short_conv_kernel_size"] - 1) * 3 * heads * dim
    )


def _split(layers: set[int], size: int, split_layers: list[int] | set[int] | None) -> set[int]:
    """Which of ``layers`` have their heads divided over ``size`` ranks."""
    if size <= 1:
        return set()
    return set(layers) if split_layers is None else set(layers) & set(split_layers)


def kda_state_bytes(
    tc: dict, act: int = 2, size: int = 1, split_layers: list[int] | set[int] | None = None
) -> int:
    """One request's KDA conv + recurrent state on one rank. ``size``: ranks the attention
    is split over (1: replicated); ``split_layers``: the layers whose heads are divided
    (None: every KDA layer when ``size`` > 1)."""
    per_layer = kda_layer_state_bytes(tc, act)
    kda = kda_layers(tc)
    split = _split(kda, size, split_layers)
    return sum(per_layer // size if i in split else per_layer for i in kda)


def request_bytes(
    tc: dict,
    context: int,
    act: int = 2,
    *,
    size: int = 1,
    split_layers: list[int] | set[int] | None = None,
    step: int = CACHE_STEP,
) -> dict:
    """One request at ``context`` tokens on one rank: MLA latent cache (rounded up to
    the cache step) and KDA state."""
    ctx = -(-context // step) * step
    latent = ctx * latent_bytes_per_token(tc, act)
    state = kda_state_bytes(tc, act, size, split_layers)
    return {
        "mla_layers": len(mla_layers(tc)),
        "kda_layers": len(kda_layers(tc)),
        "context": context,
        "mla_latent_cache": latent,
        "kda_state": state,
        "per_request": latent + state,
    }


def serving_bytes(
    tc: dict,
    *,
    context: int,
    batch: int,
    prompt_cache_tokens: int | None = None,
    act: int = 2,
    size: int = 1,
    split_layers: list[int] | set[int] | None = None,
    entries: int = PROMPT_CACHE_ENTRIES,
    step: int = CACHE_STEP,
) -> dict:
    """What a server holds on one rank at most (module doc): ``batch`` requests at
    ``context`` tokens plus the prompt cache bound. ``prompt_cache_tokens`` None (or 0):
    4 x ``context``, the server's default. ``mla_latent_cache`` and ``kda_state`` are one
    request's; ``total`` is everything."""
    one = request_bytes(tc, context, act, size=size, split_layers=split_layers, step=step)
    per_token = latent_bytes_per_token(tc, act)
    bound = prompt_cache_bound(prompt_cache_tokens, context)
    held = max(bound, context) + context  # the entries + one being inserted
    n = entries + 1
    pc_latent = (held + n * (step - 1)) * per_token
    pc_state = n * one["kda_state"]
    requests = batch * one["per_request"]
    pc = pc_latent + pc_state
    return {
        **one,
        "latent_bytes_per_token": per_token,
        "batch": batch,
        "requests": requests,
        "prompt_cache": {
            "tokens": bound,
            "tokens_held_at_most": held,
            "entries_at_most": n,
            "mla_latent_cache": pc_latent,
            "kda_state": pc_state,
            "total": pc,
        },
        "total": requests + pc,
    }


def prefill_activation_bytes(
    tc: dict,
    *,
    context: int,
    chunk: int,
    act: int = 2,
    size: int = 1,
    split_layers: list[int] | set[int] | None = None,
) -> dict:
    """Peak transient bytes of one prefill chunk of ``chunk`` tokens at ``context`` tokens
    on one rank (module doc; a chunk longer than the context is a chunk of ``context``
    tokens). ``size``, ``split_layers``: as :func:`kda_state_bytes`; an MLA layer whose
    heads are divided holds ``heads // size`` of them, the peak is the layer that holds
    the most."""
    C, T, b = context, min(chunk, context), act
    mla = mla_layers(tc)
    split = _split(set(mla), size, split_layers)
    H = tc["num_attention_heads"]
    heads = max((H // size if i in split else H for i in mla), default=0)
    kv = heads * C * (tc["qk_nope_head_dim"] + tc["v_head_dim"]) * b
    scores = 2 * heads * T * C * b
    logits = T * tc["vocab_size"] * 4
    blocks = -(-tc["num_hidden_layers"] // (tc.get("attn_res_block_size") or 1))
    hidden = T * tc["hidden_size"] * b * (2 * blocks + 4)
    moe = T * tc["num_experts_per_token"] * tc["moe_intermediate_size"] * 3 * b
    return {
        "prefill_chunk": chunk,
        "chunk_tokens": T,
        "context": C,
        "attention_heads": heads,
        "mla_kv_decompressed": kv,
        "attention_scores": scores,
        "logits": logits,
        "hidden_and_attnres_stack": hidden,
        "moe": moe,
        "total": kv + scores + logits + hidden + moe,
    }


def need_bytes(serving: dict, activations: dict) -> dict:
    """The most serving needs beside the weights (module doc): what it holds
    (:func:`serving_bytes`) plus the larger transient, a prefill chunk's activations
    (:func:`prefill_activation_bytes`) or the copy of the decode batch's caches made when a
    prompt joins it."""
    joining = serving["requests"]
    transient = max(activations["total"], joining)
    return {
        "held": serving["total"],
        "prefill": activations["total"],
        "joining": joining,
        "transient": transient,
        "total": serving["total"] + transient,
    }
