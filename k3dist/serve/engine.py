"""Generation on a (possibly expert-parallel) K3: mlx-lm's ``generate_step`` drives
prefill and decode; every rank runs the same steps in lockstep because every rank
computes the same logits and samples the same token."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step


def greedy(model, prompt: list[int], steps: int, prefill_step_size: int = 2048
           ) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the raw logits behind each of them ([steps, vocab], float32)."""
    seen: list[mx.array] = []

    def capture(_tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(logits)
        return logits

    tokens = [
        int(tok)
        for tok, _ in generate_step(mx.array(prompt), model, max_tokens=steps,
                                    logits_processors=[capture],
                                    prefill_step_size=prefill_step_size)
    ]
    logits = np.stack([np.array(x.reshape(-1), dtype=np.float32) for x in seen[:steps]])
    return tokens, logits
