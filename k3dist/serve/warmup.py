"""Warm-up: every graph shape the server will run, compiled before the first
collective, so no rank ever JIT-compiles while its peers wait inside an all_sum.

Prefill is split into a fixed list of chunk sizes (powers of two up to
``prefill_chunk``): any prompt length is a sum of them, so the list below is every
shape the server ever runs (batch 1; the server serves requests one at a time).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlx.core as mx


def chunk_sizes(prefill_chunk: int) -> list[int]:
    """Powers of two from ``prefill_chunk`` down to 1 (``prefill_chunk`` must be one)."""
    if prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1):
        raise ValueError(f"prefill_chunk must be a power of two, not {prefill_chunk}")
    out, n = [], prefill_chunk
    while n >= 1:
        out.append(n)
        n //= 2
    return out


def split_length(n: int, sizes: list[int]) -> list[int]:
    """``n`` as a sum of the allowed sizes, largest first."""
    parts = []
    for s in sizes:
        while n >= s:
            parts.append(s)
            n -= s
    return parts


def jit_cache_dir() -> Path:
    """Where MLX's CPU backend keeps the kernels it compiles (one shared library
    per fused graph): counting them counts compilations."""
    import tempfile

    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def jit_kernel_count() -> int:
    d = jit_cache_dir()
    if not d.exists():
        return 0
    # finished kernel libraries only (tmp_* are compiles in progress)
    return sum(1 for f in os.listdir(d) if f.startswith("lib") and f.endswith(".so"))


# Samplers the server builds from request parameters. mlx-lm compiles each sampler
# chain with its parameters as constants: a request with a temperature (or top_p,
# min_p) value not warmed here compiles one small kernel, on every rank at the same
# step (after that step's collectives), so the ranks stay in lockstep.
SAMPLERS = ({"temp": 0.0}, {"temp": 0.7}, {"temp": 1.0}, {"temp": 0.7, "top_p": 0.9},
            {"temp": 0.7, "top_k": 20}, {"temp": 0.7, "min_p": 0.05})


def warm_up(model, prefill_chunk: int, vocab_size: int,
            samplers: tuple[dict, ...] = SAMPLERS) -> dict:
    """Run mlx-lm's own generation loop (what the server runs) over every prefill
    chunk shape and decode, with each default sampler, collectives bypassed on this
    rank (results are discarded); then one decode step with collectives on, in
    lockstep with the other ranks."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    t0 = time.perf_counter()
    before = jit_kernel_count()
    model.set_collectives(False)
    try:
        sizes = chunk_sizes(prefill_chunk)
        for i, t in enumerate(sizes):
            # Two chunks of t (the second on a non-empty cache: other mask shapes),
            # +1: generate_step prefills all but the last prompt token.
            prompt = mx.array([j % (vocab_size - 256) for j in range(2 * t + 1)])
            sampler = make_sampler(**samplers[i % len(samplers)])
            for _ in generate_step(prompt, model, max_tokens=2, sampler=sampler,
                                   prefill_step_size=t):
                pass
        for kw in samplers:
            for _ in generate_step(mx.array([1, 2]), model, max_tokens=2,
                                   sampler=make_sampler(**kw)):
                pass
    finally:
        model.set_collectives(True)
    cache = model.make_cache()
    mx.eval(model(mx.array([[1]]), cache=cache))  # the real collective warm-up
    shapes = sizes
    return {"prefill_chunks": shapes, "decode": [1], "seconds": round(time.perf_counter() - t0, 2),
            "jit_kernels_compiled": jit_kernel_count() - before,
            "jit_kernels_total": jit_kernel_count()}
