"""The embedded default: the mini-K3 every command falls back to when no model is
configured, made on first use and cached under ``runs/``."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path

from k3dist import convert, synth
from k3dist.sfile import CheckpointError

DEFAULT_SRC = Path("runs/mini-src")
DEFAULT_BUILD = Path("runs/mini-build")


def ensure_default_build(progress: bool = False) -> Path:
    """runs/mini-build, converted from runs/mini-src (synthesized if missing).
    Both steps are idempotent: a complete folder is reused, a partial one resumed;
    a cached build from an older k3dist (another identity) is a cache miss."""
    if not (DEFAULT_SRC / "model.safetensors.index.json").exists():
        synth.synthesize(DEFAULT_SRC, "mini", seed=0, progress=progress)
    try:
        return convert.convert(DEFAULT_SRC, DEFAULT_BUILD, progress=progress)
    except CheckpointError:  # a cache from an older k3dist: ours to replace
        shutil.rmtree(DEFAULT_BUILD)
        return convert.convert(DEFAULT_SRC, DEFAULT_BUILD, progress=progress)


def ensure_default_rank(rank: int, size: int, rank_dir: Path) -> Path:
    """This rank's folder of the default build. Ranks sharing one machine take a
    file lock so only one writes the shared build at a time; on separate machines
    each makes its own (deterministic: the same build hash everywhere)."""
    from k3dist import slicing

    DEFAULT_BUILD.parent.mkdir(parents=True, exist_ok=True)
    with open(DEFAULT_BUILD.parent / ".default.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = ensure_default_build()
        try:
            return slicing.slice_rank(build, rank_dir, rank, size, None, progress=False)
        except CheckpointError:  # a stale cached rank folder: ours to replace
            shutil.rmtree(rank_dir)
            return slicing.slice_rank(build, rank_dir, rank, size, None, progress=False)
