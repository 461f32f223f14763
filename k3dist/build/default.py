"""The embedded default: the trained mini-K3 shipped in ``data/mini-k3`` (Moonshot's
source format, MXFP4 experts; issue 6), converted and sliced on first use and cached
under ``runs/``."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path

from k3dist.build import convert
from k3dist.factory.corpus import DATA_DIR
from k3dist.format.sfile import CheckpointError

DEFAULT_SRC = DATA_DIR / "mini-k3"  # committed; made by train/run.py (data/README.md)
DEFAULT_BUILD = Path("runs/mini-build")


def ensure_default_build(progress: bool = False) -> Path:
    """runs/mini-build, converted from the shipped data/mini-k3. Idempotent: a
    complete build is reused, a partial one resumed; a cached build of another source
    or an older k3dist (another identity) is a cache miss."""
    if not (DEFAULT_SRC / "model.safetensors.index.json").exists():
        raise FileNotFoundError(
            f"{DEFAULT_SRC}: the shipped mini-K3 is missing (it is committed: restore it "
            "with `git checkout -- data/mini-k3`, or retrain it as data/README.md shows)")
    try:
        return convert.convert(DEFAULT_SRC, DEFAULT_BUILD, progress=progress)
    except CheckpointError:  # a cache from an older k3dist: ours to replace
        shutil.rmtree(DEFAULT_BUILD)
        return convert.convert(DEFAULT_SRC, DEFAULT_BUILD, progress=progress)


def ensure_default_rank(rank: int, size: int, rank_dir: Path) -> Path:
    """This rank's folder of the default build. Ranks sharing one machine take a
    file lock so only one writes the shared build at a time; on separate machines
    each makes its own (deterministic: the same build hash everywhere)."""
    from k3dist.build import slicing

    DEFAULT_BUILD.parent.mkdir(parents=True, exist_ok=True)
    with open(DEFAULT_BUILD.parent / ".default.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = ensure_default_build()
        try:
            return slicing.slice_rank(build, rank_dir, rank, size, None, progress=False)
        except CheckpointError:  # a stale cached rank folder: ours to replace
            shutil.rmtree(rank_dir)
            return slicing.slice_rank(build, rank_dir, rank, size, None, progress=False)
