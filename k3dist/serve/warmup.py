"""Warm-up: every graph shape the server will run, compiled before the first
collective, so no rank ever JIT-compiles while its peers wait inside an all_sum.

Prefill is split into a fixed list of chunk sizes (powers of two up to
``prefill_chunk``): any prompt length is a sum of them, so the list below is every
prefill shape the server ever runs. Prefill runs one request at a time (batch 1);
decode runs concurrent requests together at any batch size from 1 to ``max_batch``
(mlx-lm's BatchGenerator). Every one of those sizes is warmed, through the same
BatchGenerator the server runs, rather than padding batches to a few buckets: a
padded row costs a full row of expert work on every step, a warmed size costs one
decode step at start-up.
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


def jit_kernels_loaded() -> list[str] | None:
    """The compiled-kernel libraries this process has loaded (Linux: from
    ``/proc/self/maps``), by name; None where that cannot be read (macOS).

    Per process, unlike ``jit_kernel_count`` (a directory every MLX process on the
    machine shares, so another process's compiles count there too): a graph first run
    after warm-up loads a library here even when another process compiled it first.
    """
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    d = str(jit_cache_dir())
    names = set()
    for line in maps.read_text().splitlines():
        path = line.rsplit(None, 1)[-1] if line.count(" ") >= 5 else ""
        if path.startswith(d) and path.endswith(".so"):
            names.add(Path(path).name)
    return sorted(names)


# Samplers the server builds from request parameters. mlx-lm compiles each sampler
# chain with its parameters as constants: a request with a temperature (or top_p,
# min_p) value not warmed here compiles one small kernel, on every rank at the same
# step (after that step's collectives), so the ranks stay in lockstep.
SAMPLERS = (
    {"temp": 0.0},
    {"temp": 0.7},
    {"temp": 1.0},
    {"temp": 0.7, "top_p": 0.9},
    {"temp": 0.7, "top_k": 20},
    {"temp": 0.7, "min_p": 0.05},
)


def warm_batches(model, prefill_chunk: int, vocab_size: int, max_batch: int) -> None:
    """Run mlx-lm's BatchGenerator as the server runs it (prefill one request at a
    time, decode up to ``max_batch`` together): every prefill chunk shape through the
    batch caches, then ``max_batch`` requests that join one by one and finish one by
    one, so decode runs at every batch size 1..max_batch, greedy (one batched argmax)
    and sampled (per-row samplers, the batch-1 shapes)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    ids = vocab_size - 256
    for t in chunk_sizes(prefill_chunk):
        gen = BatchGenerator(
            model, completion_batch_size=max_batch, prefill_batch_size=1, prefill_step_size=t
        )
        # Two chunks of t: the second on a non-empty cache (other mask shapes).
        gen.insert([[j % ids for j in range(2 * t + 1)]], max_tokens=[2])
        _drain(gen)
    for samplers in (None, [make_sampler(temp=0.7) for _ in range(max_batch)]):
        gen = BatchGenerator(
            model,
            completion_batch_size=max_batch,
            prefill_batch_size=1,
            prefill_step_size=prefill_chunk,
        )
        # Prompts of 2..4 tokens (left padding in the merged caches); each joins about
        # two steps after the last, so the batch grows to max_batch before the first ends.
        gen.insert(
            [[(7 * i + j) % ids for j in range(2 + i % 3)] for i in range(max_batch)],
            max_tokens=[2 * max_batch + 2] * max_batch,
            samplers=samplers,
        )
        _drain(gen)


def _drain(gen) -> None:
    while gen.next() != ([], []):
        pass
    gen.close()


def warm_up(
    model,
    prefill_chunk: int,
    vocab_size: int,
    samplers: tuple[dict, ...] = SAMPLERS,
    max_batch: int = 1,
) -> dict:
    """Run mlx-lm's own generation loops (what the server runs) over every prefill
    chunk shape and decode, with each default sampler, collectives bypassed on this
    rank (results are discarded); with ``max_batch`` > 1 also the batched loop at
    every batch size; then one decode step with collectives on, in lockstep with the
    other ranks."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    t0 = time.perf_counter()
    before = jit_kernel_count()
    loaded_before = jit_kernels_loaded()
    model.set_collectives(False)
    try:
        sizes = chunk_sizes(prefill_chunk)
        for i, t in enumerate(sizes):
            # Two chunks of t (the second on a non-empty cache: other mask shapes),
            # +1: generate_step prefills all but the last prompt token.
            prompt = mx.array([j % (vocab_size - 256) for j in range(2 * t + 1)])
            sampler = make_sampler(**samplers[i % len(samplers)])
            for _ in generate_step(
                prompt, model, max_tokens=2, sampler=sampler, prefill_step_size=t
            ):
                pass
        for kw in samplers:
            for _ in generate_step(
                mx.array([1, 2]), model, max_tokens=2, sampler=make_sampler(**kw)
            ):
                pass
        if max_batch > 1:
            warm_batches(model, prefill_chunk, vocab_size, max_batch)
    finally:
        model.set_collectives(True)
    cache = model.make_cache()
    mx.eval(model(mx.array([[1]]), cache=cache))  # the real collective warm-up
    seen = set(getattr(model, "shapes_seen", ()))
    if hasattr(model, "shapes_seen"):
        model.shapes_seen.clear()  # from here on: the shapes served
    decode = sorted({b for b, t in seen if t == 1}) or [1]
    loaded = jit_kernels_loaded()
    return {
        "prefill_chunks": sizes,
        "decode": decode,
        "shapes": sorted(seen),
        "seconds": round(time.perf_counter() - t0, 2),
        "jit_kernels_compiled": jit_kernel_count() - before,
        "jit_kernels_total": jit_kernel_count(),
        # this process's own: what warm-up loaded (compiled, or found compiled)
        "jit_kernels_loaded": None if loaded is None else len(loaded),
        "jit_kernels_loaded_by_warmup": None
        if loaded is None
        else len(set(loaded) - set(loaded_before or ())),
    }
