"""The embedded default: the mini-K3 every command falls back to when no model is
configured, made on first use and cached under ``runs/``."""

from __future__ import annotations

from pathlib import Path

from k3dist import convert, synth

DEFAULT_SRC = Path("runs/mini-src")
DEFAULT_BUILD = Path("runs/mini-build")


def ensure_default_build(progress: bool = False) -> Path:
    """runs/mini-build, converted from runs/mini-src (synthesized if missing).
    Both steps are idempotent: a complete folder is reused, a partial one resumed."""
    if not (DEFAULT_SRC / "model.safetensors.index.json").exists():
        synth.synthesize(DEFAULT_SRC, "mini", seed=0, progress=progress)
    return convert.convert(DEFAULT_SRC, DEFAULT_BUILD, progress=progress)
