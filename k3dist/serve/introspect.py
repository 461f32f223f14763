"""What a loaded expert-parallel model costs per decode token, read from the model
itself: the collectives one decode step issues (counted as they are called, whatever
issues them) and the weight bytes this rank holds, by family."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
from mlx.utils import tree_flatten


@contextmanager
def counting_collectives() -> Iterator[list[int]]:
    """Count ``mx.distributed.all_sum`` calls made inside the block (they still run)."""
    real = mx.distributed.all_sum
    n = [0]

    def counted(*args, **kwargs):
        n[0] += 1
        return real(*args, **kwargs)

    mx.distributed.all_sum = counted
    try:
        yield n
    finally:
        mx.distributed.all_sum = real


def collectives_per_token(model, prompt: int = 4) -> int:
    """The collectives one single-token decode step issues (after a ``prompt``-token
    prefill). Every rank must call this together: the step runs its collectives."""
    cache = model.make_cache()
    mx.eval(model(mx.zeros((1, prompt), dtype=mx.int32), cache=cache))
    for layer in model.layers:  # a compiled KDA step (Metal) would hide its all_sum
        if getattr(layer.self_attn, "_step", None) is not None:
            layer.self_attn._step = None
    with counting_collectives() as n:
        mx.eval(model(mx.zeros((1, 1), dtype=mx.int32), cache=cache))
    return n[0]


def family(path: str) -> str:
    """The family of a parameter path (``k3dist.format.layout.FAMILIES`` names)."""
    if ".self_attn." in path:
        return "attention"
    if ".switch_mlp." in path or ".switch_hi." in path:
        return "experts"
    if ".shared_experts." in path:
        return "shared_experts"
    if ".mlp.gate." in path or "e_score_correction_bias" in path:
        return "router"
    if ".routed_expert_" in path:
        return "latent"
    if ".mlp." in path:
        return "dense_mlp"
    if "embed_tokens" in path or "lm_head" in path:
        return "embed"
    return "other"


def bytes_held(model) -> dict[str, int]:
    """Weight bytes this rank holds, by family, and ``total``."""
    out: dict[str, int] = {}
    for path, a in tree_flatten(model.parameters()):
        f = family(path)
        out[f] = out.get(f, 0) + a.nbytes
    out["total"] = sum(out.values())
    return dict(sorted(out.items()))
