"""Generation on a (possibly expert-parallel) K3: mlx-lm's ``generate_step`` drives
prefill and decode; every rank runs the same steps in lockstep because every rank
computes the same logits and samples the same token."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step


def greedy(
    model, prompt: list[int], steps: int, prefill_step_size: int = 2048
) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the raw logits behind each of them ([steps, vocab], float32)."""
    seen: list[mx.array] = []

    def capture(_tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(logits)
        return logits

    tokens = [
        int(tok)
        for tok, _ in generate_step(
            mx.array(prompt),
            model,
            max_tokens=steps,
            logits_processors=[capture],
            prefill_step_size=prefill_step_size,
        )
    ]
    logits = np.stack([np.array(x.reshape(-1), dtype=np.float32) for x in seen[:steps]])
    return tokens, logits


@dataclass
class BatchDecode:
    """What :func:`batch_decode` returns: each prompt's greedy tokens (``steps`` or more)
    and the seconds of each of the ``steps`` decode steps run with the whole batch."""

    tokens: list[list[int]]
    step_seconds: list[float]


def batch_decode(
    model, prompts: list[list[int]], steps: int, prefill_step_size: int = 2048
) -> BatchDecode:
    """Decode ``prompts`` together, greedy, through mlx-lm's BatchGenerator as the server
    runs it (prefill one prompt at a time, decode all of them in one batch). Every rank
    of an expert-parallel model calls it with the same prompts and runs the same steps
    in lockstep. Steps that still prefill a prompt are not timed: ``step_seconds`` holds
    ``steps`` steps that decode the whole batch and nothing else."""
    from mlx_lm.generate import BatchGenerator

    B = len(prompts)
    if B < 1 or steps < 1:
        raise ValueError(f"batch_decode needs at least one prompt and one step, not {B}, {steps}")
    gen = BatchGenerator(
        model, completion_batch_size=B, prefill_batch_size=1, prefill_step_size=prefill_step_size
    )
    # Enough tokens that no prompt ends before ``steps`` whole-batch steps were timed:
    # the first prompt decodes while the others are prefilled.
    limit = steps + sum(len(p) // prefill_step_size + 2 for p in prompts)
    uids = gen.insert(prompts, max_tokens=[limit] * B)
    out: dict[int, list[int]] = {u: [] for u in uids}
    times: list[float] = []
    try:
        while len(times) < steps:
            t0 = time.perf_counter()
            prompt_responses, responses = gen.next()
            dt = time.perf_counter() - t0
            for r in responses:
                out[r.uid].append(r.token)
            if len(responses) == B and not prompt_responses:
                times.append(dt)
            if not responses and not prompt_responses:
                raise RuntimeError(
                    f"batch_decode: the batch ended before {steps} whole-batch steps"
                )
    finally:
        gen.close()
    return BatchDecode([out[u] for u in uids], times)
