"""The builds a benchmark runs on: a preset synthesized and converted once under
``runs/`` (shared by ranks on one machine through a file lock), and this rank's folder
of a build."""

from __future__ import annotations

from pathlib import Path

from k3dist.factory import synth
from k3dist.format import placement
from k3dist.format.folder import INDEX_NAME
from k3dist.format.journal import locked, remake_stale
from k3dist.pipeline import convert, slicing

import mlx.core as mx


def ensure_preset_build(preset: str, cache: str | Path = "runs", progress: bool = False) -> Path:
    """``<cache>/<preset>-build``, converted from ``<cache>/<preset>-src`` (synthesized
    with seed 0 if missing); both reused when complete. Ranks sharing a machine take a
    file lock, so one writes while the others wait; on separate machines each makes
    its own (deterministic: the same build hash everywhere)."""
    if preset not in synth.PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(synth.PRESETS)}")
    cache = Path(cache)
    src, build = cache / f"{preset}-src", cache / f"{preset}-build"
    with locked(cache / f".{preset}.lock"):
        if not (src / INDEX_NAME).exists():
            synth.synthesize(src, preset, seed=0, progress=progress)
        return remake_stale(build, lambda: convert.convert(src, build, progress=progress))


def slice_for_rank(
    build: str | Path,
    out: str | Path,
    group: mx.distributed.Group,
    plc: placement.Placement | None,
    attention: str = "split",
) -> Path:
    """This rank's folder of ``build`` under ``out`` (each rank writes its own, so
    this works on one machine or several)."""
    return slicing.slice_rank(
        build,
        Path(out) / f"rank{group.rank()}",
        group.rank(),
        group.size(),
        plc,
        progress=False,
        attention=attention,
    )
