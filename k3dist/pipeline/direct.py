"""A graded build written straight into per-rank folders, with one graded file of scratch.

``grade`` then ``slicing`` write the whole graded build (real K3: 855 GB) and then the rank
folders (863 GB) beside it. Here the same two tools run a file at a time: the graded
build's small files (config, index, tokenizer, a manifest naming its ``build_hash``) go to
``scratch`` first, each tensor file is made there by ``GradedBuilder.grade_file`` when the
rank slicers (``slicing.BuildSlicer``, one per rank) first read it, sliced into every rank
folder, and deleted before the next is made. The rank folders are the ones ``slice_all`` of
the written graded build gives (``tests/pipeline/test_view.py``: every file's sha256), and resume
like it (each rank folder's journal; a file not yet in every rank's journal is made again).
Disk: the rank folders plus the largest graded file (a decoder layer: ~14 GB for the real
K3).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from k3dist.format.folder import CONFIG_NAME, INDEX_NAME
from k3dist.format.journal import write_json_atomic
from k3dist.format.manifest import MANIFEST
from k3dist.format.placement import Placement
from k3dist.format.sfile import Header, TensorInfo, nbytes_of, read_bytes, read_header, sha256_file
from k3dist.pipeline import promote, slicing

from tqdm import tqdm


class GradedFiles:
    """The graded build's tensor files as the slicers read them: headers from the
    builder's entries (nothing made), bytes from the file made in scratch on first read
    (the previous one deleted)."""

    def __init__(self, gb: promote.GradedBuilder):
        self.gb = gb
        self.current: str | None = None
        self.real: Header | None = None
        self._headers: dict[str, Header] = {}
        for f in gb.files:
            tensors, at = {}, 0
            for name, dtype, shape, _ in gb._entries(gb.headers[f]):
                n = nbytes_of(dtype, shape)
                tensors[name] = TensorInfo(name, dtype, tuple(shape), at, at + n, gb.out / f)
                at += n
            self._headers[f] = Header(gb.out / f, tensors, gb.headers[f].metadata, 0, at)

    def header(self, fname: str) -> Header:
        return self._headers[fname]

    def read(self, t: TensorInfo, start: int, length: int) -> bytes:
        fname = t.path.name
        if self.current != fname:
            self.drop()
            self.gb.grade_file(fname, digests=False)  # scratch: the rank files are hashed
            self.current, self.real = fname, read_header(self.gb.out / fname)
        return read_bytes(self.real.tensors[t.name], start, length)

    def drop(self) -> None:
        if self.current is not None:
            (self.gb.out / self.current).unlink(missing_ok=True)
            self.current = self.real = None

    def max_bytes(self) -> int:
        return max(h.file_size for h in self._headers.values())


def write_small(gb: promote.GradedBuilder) -> None:
    """The graded build's small files into scratch: what the slicers read besides the
    tensor files (config, index in the written build's order, tokenizer files, and a
    manifest with its build hash and identity that lists only these files)."""
    out = gb.out
    out.mkdir(parents=True, exist_ok=True)
    files = GradedFiles(gb)
    weight_map = {n: f for f in gb.files for n in files.header(f).tensors}
    write_json_atomic(out / INDEX_NAME, {"metadata": {}, "weight_map": weight_map})
    write_json_atomic(out / CONFIG_NAME, gb.config_out())
    small = [*gb.src.write_small(out), INDEX_NAME, CONFIG_NAME]
    write_json_atomic(
        out / MANIFEST,
        {
            "kind": "build",
            "identity": gb.ident,
            "build_hash": gb.build_hash,
            "from_build": gb.src.describe,
            "direct": "tensor files made one at a time and sliced into rank folders",
            "plan": gb.plan,
            "files": {
                n: {"sha256": sha256_file(out / n), "bytes": (out / n).stat().st_size}
                for n in small
            },
        },
    )


def grade_into_ranks(
    gb: promote.GradedBuilder,
    out_pattern: str,
    size: int,
    progress: bool = True,
    keep: bool = False,
    placement: Placement | None = None,
) -> list[Path]:
    """The rank folders ``out_pattern.format(rank=r)`` of the graded build ``gb`` would
    write (module doc); ``gb.out`` is the scratch folder, deleted at the end unless
    ``keep``. ``placement``: which rank owns which expert (a plan's for boxes of
    different memory, ``rank_files.plan_placement``); None: ``placement_for``'s."""
    if size > 1 and "{rank}" not in out_pattern:
        raise ValueError(f"{out_pattern!r} has no {{rank}}; every rank needs its own folder")
    write_small(gb)
    scratch = gb.out
    tensors = GradedFiles(gb)
    if placement is None:
        placement = slicing.placement_for(scratch, size)
    elif placement.size != size:
        raise ValueError(f"a placement for {placement.size} ranks, not {size}")
    slicers = [
        slicing.BuildSlicer(
            scratch, Path(out_pattern.format(rank=r)), r, size, placement, tensors=tensors
        )
        for r in range(size)
    ]
    todo = [s for s in slicers if not s.open()]
    bar = tqdm(gb.files, desc="graded -> ranks", disable=not progress)
    try:
        for f in bar:
            for s in todo:
                if f in s.files and s.pending(f):
                    s.slice(f)
            tensors.drop()
        for s in todo:
            s.finish()
    finally:
        tensors.drop()
    if not keep:
        shutil.rmtree(scratch)
    return [s.out for s in slicers]
