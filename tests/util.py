"""Shared test helpers: model loading in float32 and greedy decoding with caches."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model


def load_f32(path: str | Path):
    model, config = load_model(Path(path))
    model.set_dtype(mx.float32)
    return model, config


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill the prompt, then `steps` greedy tokens through the KV/KDA caches.
    Returns the tokens and the last-position logits of every step (float32)."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    tokens, out = [], []
    for _ in range(steps):
        out.append(np.array(logits[0], dtype=np.float32))
        tok = int(mx.argmax(logits, axis=-1).item())
        tokens.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[:, -1]
    return tokens, out


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab - 256, size=n)]
