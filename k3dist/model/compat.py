"""Every private mlx-lm name k3dist relies on, in one place (mlx-lm 0.32.2, pinned).

k3dist's server subclasses mlx_lm.server and overrides or reads a few of its private
names; the EP model calls kimi_k3's router. ``missing()`` names whichever of them a
new mlx-lm no longer has (tests/model/test_compat.py fails with that list).
"""

from __future__ import annotations

import importlib
import inspect
import types

from mlx_lm.models import kimi_k3

# "module:Class.name" or "module:name" -> how k3dist uses it
PRIVATE = {
    "mlx_lm.server:ResponseGenerator._share_request": "overridden (k3dist.serve.lockstep): wraps the shared request to log each rank's tokens",
    "mlx_lm.server:ResponseGenerator._serve_single": "overridden (k3dist.serve.lockstep): the system segment prefilled first and kept, as the batch path does",
    "mlx_lm.server:ResponseGenerator._is_batchable": "overridden (k3dist.serve.lockstep): batched only when max_batch > 1",
    "mlx_lm.server:ResponseGenerator._rank": "read by holds_request",
    "mlx_lm.server:ResponseGenerator._is_distributed": "read by holds_request",
    "mlx_lm.server:APIHandler._set_stream_headers": "overridden (k3dist.serve.server): open SSE streams are tracked for abort_streams",
    "mlx_lm.server:APIHandler._set_completion_headers": "overridden (k3dist.serve.server): a failure after acceptance is 500/503, not 404",
    "mlx_lm.server:GenerationContext._should_stop": "set by stop_generation: the ranks stop a request together (client gone)",
    "mlx_lm.server:ResponseGenerator._next_request": "overridden (k3dist.serve.lockstep): idle ranks wait on the watchdog, not a collective",
    "mlx_lm.server:ResponseGenerator._stop": "read by the idle wait (k3dist.serve.lockstep)",
    "mlx_lm.server:ResponseGenerator._tokenize": "called once per request by rank 0's handler (k3dist.serve.lockstep.tokenize) and "
    "overridden: every rank takes the tokens the request carries",
    "mlx_lm.server:_image_parts": "called by has_images",
    "mlx_lm.server:ResponseGenerator._generate": "run by k3dist.serve.lockstep through with_names: its "
    "BatchGenerator keeps an abandoned prefill",
    "mlx_lm.server:BatchGenerator": "the global name mlx-lm's _generate builds its batch with (with_names)",
    "mlx_lm.generate:GenerationBatch._step": "run by k3dist.serve.lockstep through with_names: its "
    "mx.eval (the wait for a decode step's tokens) is timed for /metrics",
    "mlx_lm.generate:BatchGenerator._next": "overridden (k3dist.serve.lockstep): gives the decode batch "
    "the timed step",
    "mlx_lm.generate:BatchGenerator._generation_batch": "read by k3dist.serve.lockstep (the decode batch)",
    "mlx_lm.generate:BatchGenerator._find_uids": "read by k3dist.serve.lockstep: which removed requests "
    "are still in their prefill",
    "mlx_lm.server:ResponseGenerator._await_response": "overridden (k3dist.serve.lockstep): the handler "
    "is called back while it waits (timed keep-alives)",
    "mlx_lm.server:ResponseGenerator._time_budget": "replaced (k3dist.serve.lockstep): a stopped request ends the batch loop's pass",
    "mlx_lm.models.kimi_k3:_group_expert_select": "called by group_expert_select",
    "mlx_lm.models.kimi_k3:_attn_res_mix": "called by attn_res_mix (k3dist.pipeline.stream)",
    "mlx_lm.server:APIHandler._set_cors_headers": "overridden (k3dist.serve.server): CORS headers only for cors_origins",
    "mlx_lm.models.cache:LRUPromptCache._trie": "read by k3dist.serve.prompt_cache: the prefix copy is looked up in mlx-lm's trie",
    "mlx_lm.models.cache:LRUPromptCache._lru": "read by k3dist.serve.prompt_cache: tokens held, for the prompt_cache_tokens bound",
    "mlx_lm.models.cache:LRUPromptCache.CacheOrder._lrus": "read with _lru (tokens held)",
    "mlx_lm.models.cache:LRUPromptCache._n_bytes": "kept by k3dist.serve.prompt_cache when it drops "
    "a superseded abandoned prefill (as mlx-lm's eviction does)",
    "mlx_lm.models.cache:LRUPromptCache._n_bytes_by_type": "kept with _n_bytes",
    "mlx_lm.server:_image_url": "called by k3dist.serve.vision: an image part's URL",
    "mlx_lm.models.kimi_k3:KimiK3DeltaAttention._step": "reset by k3dist.model.ep / k3dist.serve.introspect: the compiled KDA decode core "
    "is dropped so warm-up and kernel counts start clean",
    "mlx_lm.models.kimi_k3:KimiK3DecoderLayer._attn_res_w_eff": "reset by k3dist.factory.train after an update (cached AttnRes weights)",
    "mlx_lm.models.kimi_k3:KimiK3DecoderLayer._mlp_res_w_eff": "reset with _attn_res_w_eff",
    "mlx_lm.models.kimi_k3:KimiK3TextModel._output_res_w_eff": "reset with _attn_res_w_eff",
}


def _has(path: str) -> bool:
    module, _, name = path.partition(":")
    obj = importlib.import_module(module)
    *owners, attr = name.split(".")
    for o in owners:
        obj = getattr(obj, o, None)
        if obj is None:
            return False
    if hasattr(obj, attr):
        return True
    # an attribute set on the instance: the class's code must assign or read it
    return inspect.isclass(obj) and f"self.{attr}" in inspect.getsource(obj)


def missing() -> list[str]:
    """The names of ``PRIVATE`` this mlx-lm does not have, with what k3dist uses each for."""
    return [f"{p} ({why})" for p, why in PRIVATE.items() if not _has(p)]


def with_names(fn, **names):
    """mlx-lm's function ``fn`` with some of its module's global names replaced, for the
    calls of the returned function only: mlx-lm's own code, no copy of it, and no
    change to its module that another user of it would see."""
    missing_names = [n for n in names if n not in fn.__code__.co_names]
    if missing_names:
        raise RuntimeError(f"{fn.__qualname__} no longer reads {missing_names} (mlx-lm changed)")
    return types.FunctionType(
        fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__
    )


def holds_request(generator) -> bool:
    """Whether this rank of an mlx_lm.server ResponseGenerator holds the real request
    (rank 0, or the only process); the others get a placeholder from ``_share_request``."""
    return generator._rank == 0 or not generator._is_distributed


def has_images(request) -> bool:
    """Whether a shared mlx-lm request carries images (mlx-lm serves those one at a time,
    outside its batch)."""
    from mlx_lm import server as mlx_server

    return any(mlx_server._image_parts(request.messages or []))


def stop_generation(ctx) -> None:
    """Make mlx-lm's generation loop end the request of ``ctx`` at its next token
    (``ctx.stop()`` is replaced per request by k3dist's lockstep stop)."""
    ctx._should_stop = True


def group_expert_select(*args, **kwargs):
    """kimi_k3's sigmoid router with grouped top-k: (expert ids, weights)."""
    return kimi_k3._group_expert_select(*args, **kwargs)


def attn_res_mix(blocks, partial_sum, w_eff, eps: float):
    """kimi_k3's Attention Residuals mix of the block stack and the partial sum."""
    return kimi_k3._attn_res_mix(blocks, partial_sum, w_eff, eps, True)
