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
    return len(os.listdir(d)) if d.exists() else 0


def warm_up(model, prefill_chunk: int, vocab_size: int) -> dict:
    """Run decode and every prefill chunk shape with collectives bypassed on this
    rank (results are discarded), then one decode step with collectives on, in
    lockstep with the other ranks."""
    t0 = time.perf_counter()
    before = jit_kernel_count()
    model.set_collectives(False)
    try:
        shapes = []
        for t in chunk_sizes(prefill_chunk):
            cache = model.make_cache()
            tokens = mx.array([[i % (vocab_size - 256) for i in range(t)]])
            mx.eval(model(tokens, cache=cache))
            mx.eval(model(mx.array([[1]]), cache=cache))  # decode after a prefill
            shapes.append(t)
    finally:
        model.set_collectives(True)
    cache = model.make_cache()
    mx.eval(model(mx.array([[1]]), cache=cache))  # the real collective warm-up
    return {"prefill_chunks": shapes, "decode": [1], "seconds": round(time.perf_counter() - t0, 2),
            "jit_kernels_compiled": jit_kernel_count() - before,
            "jit_kernels_total": jit_kernel_count()}
