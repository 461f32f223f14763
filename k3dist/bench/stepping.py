"""Greedy prefill and decode steps as the benchmarks time them: synchronous (forward,
argmax, ``.item()``), without mlx-lm's ``async_eval`` overlap, so a step is what one
token costs end to end; and a mode that runs them with expert parallelism's MoE
``all_sum`` bypassed (the same work, wrong numbers: compute alone)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    """``n`` ids from the base vocabulary (no control tokens), seeded."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab - 256, size=n)]


def prefill(model, prompts: list[int] | list[list[int]]) -> tuple[list, int | list[int], float]:
    """A fresh cache filled with ``prompts`` (one forward; a list of equal-length prompts
    is one batch), the greedy next token (a list for a batch), and the seconds it took."""
    batch = bool(prompts) and isinstance(prompts[0], list)
    rows = prompts if batch else [prompts]
    cache = model.make_cache()
    t = time.perf_counter()
    logits = model(mx.array(rows), cache=cache)
    toks = mx.argmax(logits[:, -1], axis=-1).tolist()
    return cache, (toks if batch else toks[0]), time.perf_counter() - t


def decode_steps(model, cache, token: int | list[int], n: int) -> tuple[list, list[float]]:
    """``n`` greedy decode steps from ``token`` (one per row for a batch, every row one
    step per forward, in lockstep): tokens (per step: an int, or a list for a batch) and
    ms per step."""
    batch = isinstance(token, list)
    cur = token if batch else [token]
    toks, ms = [], []
    for _ in range(n):
        t = time.perf_counter()
        logits = model(mx.array(cur)[:, None], cache=cache)
        cur = mx.argmax(logits[:, -1], axis=-1).tolist()
        ms.append((time.perf_counter() - t) * 1e3)
        toks.append(cur if batch else cur[0])
    return toks, ms


@dataclass
class Mode:
    name: str
    model: object
    collectives: bool = True  # False: EP with the MoE all_sum bypassed (compute only)
    batch: int = 1  # prompts decoded together in lockstep
    prefill_s: list[float] = field(default_factory=list)
    decode_ms: list[list[float]] = field(default_factory=list)  # per round
    tokens: list[int] = field(default_factory=list)
    cache: list | None = None
    next_token: int = 0

    def run(self, fn):
        if self.collectives:
            return fn()
        self.model.set_collectives(False)
        try:
            return fn()
        finally:
            self.model.set_collectives(True)
