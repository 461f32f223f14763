"""The manifest (``k3dist.json``) every k3dist output folder ends with, and its one check.

Written last, so its presence means the folder is complete. One schema for every kind:

- ``tool``: the k3dist that wrote it; ``kind``: ``"build"`` (``k3dist.pipeline.convert``)
  or ``"rank"`` (``k3dist.pipeline.slicing``); ``identity``: what makes two folders the same
  (a re-run with another identity is refused); ``build_hash``: the build it is or was
  sliced from;
- ``files``: ``{name: {"sha256", "bytes"}}`` for every file the folder holds (``bytes``
  may be absent for small copied files of a build);
- ``seconds``; kind-specific keys: a build's ``source``, ``profile``, ``files_by_group``;
  a rank folder's ``rank``, ``size``, ``placement``, ``placement_hash``, ``build``,
  ``input``, ``expert_bytes``, ``attention`` (``mode``: ``split`` or ``replicated``,
  ``split_layers``: the layers whose attention the rank holds a share of).
"""

from __future__ import annotations

import json
from pathlib import Path

from k3dist.format.folder import CONFIG_NAME, INDEX_NAME
from k3dist.format.sfile import CheckpointError, sha256_file

MANIFEST = "k3dist.json"
JOURNAL = ".k3dist-progress.json"
# Each kind's format version, stamped in ``identity`` by its writer; a folder of another
# version is another identity (a cache of an older k3dist is remade, never served).
BUILD_FORMAT_VERSION = 2  # 2: HF tokenizer files, no auto_map
# 2: per-tensor sha256 in the manifest (k3dist.format.verify); 3: attention split/replicated
RANK_FORMAT_VERSION = 3
_MAKE = {
    "rank": "make rank folders with python slicing/rank_split.py",
    "build": "make a build with python -m k3dist.pipeline.convert",
}
_NOUN = {"rank": "a rank folder", "build": "a build"}
_OTHER_KIND = {
    "rank": "make one with python slicing/rank_split.py",
    "build": "slice the build it came from, not a rank folder",
}
_FIX = {
    "rank": "slice it again into a new folder or copy it again",
    "build": "copy the build again or convert it again into a new folder",
}


def verify(path: str | Path, kind: str, sha256: bool = False) -> dict:
    """The manifest of a complete folder of ``kind``, after checking every file's size
    (and sha256 when asked); CheckpointError naming what is wrong and the fix."""
    path = Path(path)
    mp = path / MANIFEST
    if not mp.exists():
        run = "slicing" if kind == "rank" else "conversion"
        hint = f" (an unfinished {run}: run it again)" if (path / JOURNAL).exists() else ""
        raise CheckpointError(f"{path}: no {MANIFEST}{hint}; {_MAKE[kind]}")
    m = json.loads(mp.read_text())
    if m.get("kind") != kind:
        raise CheckpointError(
            f"{mp}: kind {m.get('kind')!r}, not {_NOUN[kind]}; {_OTHER_KIND[kind]}"
        )
    bad = []
    for name, meta in m["files"].items():
        f = path / name
        if not f.exists():
            bad.append(f"{name} missing")
        elif "bytes" in meta and f.stat().st_size != meta["bytes"]:
            bad.append(f"{name} has {f.stat().st_size} bytes, manifest {meta['bytes']}")
        elif sha256 and sha256_file(f) != meta["sha256"]:
            bad.append(f"{name} sha256 differs from the manifest")
    if bad:
        more = "; ..." if len(bad) > 5 else ""
        what = f"rank {m.get('rank')} folder" if kind == "rank" else "build"
        raise CheckpointError(
            f"{path}: {what} is damaged ({'; '.join(bad[:5])}{more}); {_FIX[kind]}"
        )
    return m


def slices_current_build(folder: str | Path, source: str | Path) -> bool:
    """Whether ``folder`` is a complete rank folder of this k3dist's format, sliced from
    the current build of the Moonshot checkpoint ``source`` (by the source's index and
    config digests): how a cached embedded default is trusted without importing the
    build pipeline."""
    try:
        m = verify(folder, "rank")
        b = json.loads((Path(m["build"]) / MANIFEST).read_text())
        src = Path(source)
        ident = b["identity"]
        return (
            m["identity"].get("format_version") == RANK_FORMAT_VERSION
            and ident.get("format_version") == BUILD_FORMAT_VERSION
            and m["build_hash"] == b.get("build_hash")
            and ident.get("source_index_sha256") == sha256_file(src / INDEX_NAME)
            and ident.get("source_config_sha256") == sha256_file(src / CONFIG_NAME)
        )
    except (CheckpointError, OSError, KeyError, ValueError):
        return False


def attention_of(m: dict) -> dict:
    """A rank manifest's attention mode and split layers (a folder from before the
    split existed holds attention replicated)."""
    return m.get("attention") or {"mode": "replicated", "split_layers": []}
