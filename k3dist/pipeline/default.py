"""The embedded default: the trained mini-K3 shipped in ``k3dist/data/mini-k3`` (Moonshot's
source format, MXFP4 experts; issue 6), converted and sliced on first use and cached
under ``runs/``."""

from __future__ import annotations

from pathlib import Path

from k3dist import MINI_K3
from k3dist.format.folder import INDEX_NAME
from k3dist.format.journal import locked, remake_stale
from k3dist.pipeline import convert

DEFAULT_SRC = MINI_K3  # committed; made by train/train.py (data/README.md)
DEFAULT_BUILD = Path("runs/mini-build")


def ensure_default_build(progress: bool = False) -> Path:
    """runs/mini-build, converted from the shipped k3dist/data/mini-k3. Idempotent: a
    complete build is reused, a partial one resumed; a cached build of another source
    or an older k3dist (another identity) is a cache miss."""
    if not (DEFAULT_SRC / INDEX_NAME).exists():
        raise FileNotFoundError(
            f"{DEFAULT_SRC}: the shipped mini-K3 is missing (it is committed: restore it "
            "with `git checkout -- k3dist/data/mini-k3`, or retrain it as data/README.md shows)"
        )
    return remake_stale(
        DEFAULT_BUILD, lambda: convert.convert(DEFAULT_SRC, DEFAULT_BUILD, progress=progress)
    )


def ensure_default_rank(rank: int, size: int, rank_dir: Path) -> Path:
    """This rank's folder of the default build. Ranks sharing one machine take a
    file lock so only one writes the shared build at a time; on separate machines
    each makes its own (deterministic: the same build hash everywhere)."""
    from k3dist.pipeline import slicing

    with locked(DEFAULT_BUILD.parent / ".default.lock"):
        build = ensure_default_build()
        return remake_stale(
            rank_dir, lambda: slicing.slice_rank(build, rank_dir, rank, size, None, progress=False)
        )
