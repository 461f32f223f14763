"""MLX build (or Moonshot-format source) -> one folder per rank for expert parallelism.

A rank folder has the build's file names; each file holds every non-expert tensor of
that build file (byte copies) and, for each stacked expert tensor
(``...layers.L.mlp.switch_mlp.*``, leading dim = num_experts in global order), the
sub-stack of the experts the rank owns in local order (ascending global id), shape
``[E_local, ...]``. Expert ``e``'s slice of a stack is the contiguous byte range
``[e*n/E, (e+1)*n/E)`` of its data, so a rank folder is written by copying byte
ranges, expert run by expert run: nothing larger than a 64 MiB chunk is in memory.

Beside the tensors: the build's ``config.json`` unchanged (mlx-lm reads it), its
index (same weight map, this folder's ``total_size``), its tokenizer files, and
``k3dist.json`` naming ``rank``, ``size``, the placement and the ``build_hash`` of
the build, so a loader can refuse a folder from another build, rank or placement.

A Moonshot-format source folder is sliced without an intermediate build: the
converter runs with the rank's expert subset. Its ``build_hash`` is the one a full
(16-bit non-expert) conversion would have, and its files are byte-identical to
slicing that build, so the two routes are interchangeable.

Resumable like ``k3dist.build.convert``: a journal records each finished file; files appear
under their final names only when complete; ``k3dist.json`` is written last.

    python slicing/rank_split.py --rank 1          # or --all; see --help
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from k3dist import __version__
from k3dist.build import convert
from k3dist.format import graded, layout, manifest, verify
from k3dist.format.folder import CONFIG_NAME, INDEX_NAME, load_config, weight_map
from k3dist.format.journal import JournaledFolder, write_json_atomic
from k3dist.format.manifest import JOURNAL, MANIFEST
from k3dist.format.placement import (
    Placement,
    PlacementError,
    by_memory,
    for_config,
    split_by_memory,
)
from k3dist.format.sfile import (
    CHUNK_BYTES,
    CheckpointError,
    Header,
    StreamWriter,
    TensorInfo,
    iter_chunks,
    read_bytes,
    read_header,
    sha256_file,
)
from k3dist.format.source import Source

import mlx.core as mx
import numpy as np
from tqdm import tqdm

FORMAT_VERSION = manifest.RANK_FORMAT_VERSION
GIB = 1 << 30  # a box's memory as --boxes names it
# a stacked routed-expert tensor of an mlx-lm build: leading dim = num_experts (a graded
# build's two banks: the rows k3dist.format.graded.stack_rows names)
_STACK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.switch_(?:mlp|hi)\.")


def stacked_layer(name: str) -> int | None:
    """The layer of a stacked expert tensor, None for any other tensor."""
    m = _STACK_RE.search(name)
    return int(m.group(1)) if m else None


def is_source(path: str | Path) -> bool:
    """A Moonshot-format checkpoint rather than an mlx-lm build: per-expert keys
    (``...block_sparse_moe.experts.E.w1.weight_packed``) in the index; without an
    index, a compressed-tensors ``quantization_config``. (mlx-lm-converted builds
    may keep the source's config block in ``text_config``: the keys decide.)"""
    path = Path(path)
    cfg = load_config(path)
    index = path / INDEX_NAME
    if index.exists():
        names = json.loads(index.read_text()).get("weight_map", {})
        return any(layout.parse_expert_key(n) for n in names)
    blocks = (cfg.get("quantization_config"), layout.text_config(cfg).get("quantization_config"))
    return any(b and b.get("quant_method") == "compressed-tensors" for b in blocks)


def check_rank(rank: int, size: int) -> None:
    if size < 1:
        raise CheckpointError(f"--size {size} must be at least 1")
    if not 0 <= rank < size:
        raise CheckpointError(
            f"--rank {rank} must be in 0..{size - 1} (0..size-1 for --size {size})"
        )


def placement_for(
    build: str | Path,
    size: int,
    counts_path: str | Path | None = None,
    boxes: list[float] | None = None,
    attention: str | None = None,
) -> Placement:
    """The placement for a build or source folder: contiguous (equal counts within one
    where ``size`` does not divide the experts), or by each box's memory (``boxes``:
    GiB each box gives the weights, in rank order; :func:`rank_bytes` says what each
    rank holds besides routed experts, with ``attention`` as sliced); load-aware within
    those counts from routing counts. A graded build's promoted experts are then spread
    evenly (``graded.balance_hi``: counts per rank unchanged)."""
    config = load_config(build)
    tc = layout.text_config(config)
    capacity = None
    if boxes is not None:
        if len(boxes) != size:
            raise PlacementError(
                f"{len(boxes)} boxes ({', '.join(f'{b:g}' for b in boxes)} GiB) for {size} "
                f"ranks; name one box per rank (or --size {len(boxes)})"
            )
        nonexpert, per_expert = rank_bytes(build, size, attention)
        moe = layout.moe_layers(tc)
        split = split_by_memory(
            [int(b * GIB) for b in boxes], nonexpert, per_expert, tc["num_experts"], moe
        )
        capacity = by_memory(boxes, split, tc["num_experts"], moe)
    placement = for_config(tc, size, counts_path, capacity)
    gmap = graded.GradedMap.from_config(config)
    return placement if gmap is None else graded.balance_hi(placement, gmap)


def rank_bytes(
    build: str | Path, size: int, attention: str | None = None
) -> tuple[list[int], dict[int, int]]:
    """(bytes each of ``size`` rank folders holds besides routed experts, one routed
    expert's bytes per MoE layer), from the headers: replicated tensors on every rank,
    a split layer's attention (``layout.split_layers``) divided, the vision tower on
    rank 0 only. A graded layer's expert bytes are its two banks' mean; a
    Moonshot-format source counts its non-expert bytes as stored (a 16-bit slicing
    keeps them), attention replicated (how a source is sliced)."""
    build = Path(build)
    src = is_source(build)
    tc = layout.text_config(load_config(build))
    wm = weight_map(build)
    headers = {f: read_header(build / f) for f in dict.fromkeys(wm.values())}
    infos = {n: headers[f].tensors[n] for n, f in wm.items() if n in headers[f].tensors}

    def expert_layer(name: str) -> int | None:
        if src:
            key = layout.parse_expert_key(name)
            return key[0] if key else None
        return stacked_layer(name)

    mode = "replicated" if src else resolve_attention(attention, size)
    shapes = {n: t.shape for n, t in infos.items() if expert_layer(n) is None}
    split = set(layout.split_layers(tc, size, shapes)) if mode == "split" else set()
    nonexpert = [0] * size
    experts: dict[int, int] = {}
    for n, t in infos.items():
        layer = expert_layer(n)
        if layer is not None:
            experts[layer] = experts.get(layer, 0) + t.nbytes
        elif _is_vision(n):
            for r in vision_ranks(size):
                nonexpert[r] += t.nbytes
        elif layout.layer_of(n) in split and layout.split_rule(tc, n) is not None:
            nonexpert = [x + t.nbytes // size for x in nonexpert]
        else:
            nonexpert = [x + t.nbytes for x in nonexpert]
    E = tc.get("num_experts") or 1
    return nonexpert, {layer: -(-b // E) for layer, b in sorted(experts.items())}


def vision_ranks(size: int) -> set[int]:
    """Ranks whose folder holds the vision tower and projector: rank 0 only. It runs
    the tower and hands the features to the others in one all_sum (k3dist.serve.vision,
    ``TOWER_RANK``); the other ranks need no vision weights (real K3: 0.89 GB each)."""
    return {0} if size > 0 else set()


def _is_vision(name: str) -> bool:
    return name.startswith(layout.VISION_PREFIXES)


def _identity(
    build_hash: str, rank: int, size: int, placement: Placement, attention: str = "replicated"
) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "kind": "rank",
        "build_hash": build_hash,
        "rank": rank,
        "size": size,
        "placement_hash": placement.hash,
        "attention": attention,
    }


def resolve_attention(attention: str | None, size: int) -> str:
    """The mode a folder is sliced in: ``split`` by default; one rank has nothing to
    split, so it is always ``replicated``."""
    attention = attention or "split"
    if attention not in layout.ATTENTION_MODES:
        raise CheckpointError(
            f"--attention must be one of {layout.ATTENTION_MODES}, not {attention!r}"
        )
    return "replicated" if size <= 1 else attention


def _describe(ident: dict) -> str:
    return (
        f"rank {ident.get('rank')} of {ident.get('size')} of build "
        f"{ident.get('build_hash')} (placement {ident.get('placement_hash')})"
    )


def _copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _expert_bytes(header: Header) -> int:
    return sum(t.nbytes for n, t in header.tensors.items() if stacked_layer(n) is not None)


def _runs(ids: list[int], per: int) -> list[tuple[int, int]]:
    """(byte offset, length) ranges of experts ``ids`` in a stack of ``per``-byte
    experts: consecutive ids merged, split into chunks of at most 64 MiB."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        start, end = ids[i] * per, (ids[j] + 1) * per
        for s in range(start, end, CHUNK_BYTES):
            out.append((s, min(CHUNK_BYTES, end - s)))
        i = j + 1
    return out


def _split_reads(
    t: TensorInfo, rule: tuple[int, int], rank: int, size: int
) -> tuple[tuple[int, ...], list]:
    """(output shape, reads) of this rank's part of a non-expert tensor divided across
    ranks (``layout.split_rule``). A read is (offset, length, columns): ``columns``
    (row bytes, start, stop) keeps those bytes of every row of the block read."""
    axis = rule[0] % len(t.shape)
    spans = layout.split_slice(t.shape, rule, rank, size)
    shape = list(t.shape)
    shape[axis] = sum(b - a for a, b in spans)
    inner = t.nbytes // int(np.prod(t.shape[: axis + 1]))  # bytes per index along axis
    if axis == 0:
        reads = [(a * inner + s, n, None) for a, b in spans for s, n in _runs([0], (b - a) * inner)]
        return tuple(shape), reads
    if axis != len(t.shape) - 1:
        raise CheckpointError(
            f"{t.path}: {t.name!r} would split along axis {axis}; only "
            "the first or last axis can be divided across ranks"
        )
    row = t.shape[-1] * inner
    rows = t.nbytes // row
    per = max(1, CHUNK_BYTES // row)
    cols = [(a * inner, b * inner) for a, b in spans]
    reads = [
        (r * row, min(per, rows - r) * row, (row, c0, c1))
        for r in range(0, rows, per)
        for c0, c1 in cols
    ]
    return tuple(shape), reads


def _folder(out: Path, ident: dict, source_kind: str) -> JournaledFolder:
    return JournaledFolder(
        out, "rank", ident, source=source_kind, describe=_describe, hint=" (e.g. one with {rank})"
    )


def _write_manifest(
    folder: JournaledFolder,
    placement: Placement,
    build: Path,
    safetensors: dict[str, dict],
    small: list[str],
    seconds: float,
    split: list[int] | None = None,
) -> dict:
    """``k3dist.json``, last: sha256 of the tensor files from the journal (computed
    while writing; never a second read of the folder), of the small files here."""
    out, ident = folder.path, folder.identity
    files = {
        name: {
            "sha256": e["sha256"],
            "bytes": e["bytes"],
            "header_sha256": e["header_sha256"],
            "tensors": e["tensor_sha256"],
        }
        for name, e in safetensors.items()
    }
    for name in small:
        files[name] = {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size}
    manifest = {
        "tool": f"k3dist {__version__}",
        "kind": "rank",
        "identity": ident,
        "rank": ident["rank"],
        "size": ident["size"],
        "placement": placement.to_json(),
        "placement_hash": placement.hash,
        "build_hash": ident["build_hash"],
        "build": str(build.resolve()),
        "input": folder.source,
        "expert_bytes": sum(_expert_bytes(read_header(out / n)) for n in safetensors),
        # layers whose attention heads (and dense MLP) this rank holds a part of
        "attention": {"mode": ident["attention"], "split_layers": sorted(split or [])},
        "files": files,
        "seconds": round(seconds, 2),
    }
    folder.finish(manifest)
    verify.stamp_folder(out, manifest)  # hashed while written: the first start hashes nothing
    return manifest


def _check_placement(
    placement: Placement, size: int, num_experts: int, layers: set[int], where: str
) -> None:
    placement.validate()
    if placement.size != size:
        raise PlacementError(
            f"placement is for {placement.size} ranks but --size is {size}; "
            "make the placement for this size (or pass --size "
            f"{placement.size})"
        )
    if placement.num_experts != num_experts:
        raise PlacementError(
            f"placement maps {placement.num_experts} experts per layer but "
            f"{where} has {num_experts}; make the placement from its config"
        )
    missing, extra = sorted(layers - set(placement.owners)), sorted(set(placement.owners) - layers)
    if missing or extra:
        raise PlacementError(
            f"placement covers MoE layers {_short(placement.owners)} but {where} has expert "
            f"stacks for {_short(layers)} (missing {_short(missing)}, extra {_short(extra)}); "
            "make the placement from this model's config"
        )


def _short(xs, n: int = 8) -> str:
    xs = sorted(xs)
    return str(xs) if len(xs) <= n else f"{str(xs[:n])[:-1]}, ... ({len(xs)} in all)]"


# ----------------------------------------------------------------------------- build input


class BuildSlicer:
    """Slice an mlx-lm-format build (ours or a community one) for one rank."""

    def __init__(
        self,
        build: Path,
        out: Path,
        rank: int,
        size: int,
        placement: Placement,
        attention: str | None = None,
        tensors=None,
    ):
        """``tensors``: where the build's safetensors are read (``header(f)``,
        ``read(t, start, length)``); default the files in ``build``
        (``k3dist.build.direct`` passes graded files made one at a time)."""
        check_rank(rank, size)
        self.tensors = tensors
        self.size = size
        self.build, self.out, self.rank = build, out, rank
        self.config = load_config(build)
        self.config_bytes = (build / CONFIG_NAME).read_bytes()
        if not (build / INDEX_NAME).exists():
            raise CheckpointError(
                f"{build}: no {INDEX_NAME}; an MLX build folder has an "
                "index (python -m k3dist.build.convert writes one)"
            )
        self.index_bytes = (build / INDEX_NAME).read_bytes()
        self.manifest = self._build_manifest()
        self.index = json.loads(self.index_bytes)
        self.weight_map: dict[str, str] = {
            n: f
            for n, f in self.index["weight_map"].items()
            if rank in vision_ranks(size) or not _is_vision(n)
        }
        self.build_hash = (
            self.manifest["build_hash"]
            if self.manifest
            else hashlib.sha256(self.index_bytes + self.config_bytes).hexdigest()[:16]
        )
        self.files = list(dict.fromkeys(self.weight_map.values()))
        self.headers = {
            f: read_header(build / f) if tensors is None else tensors.header(f) for f in self.files
        }
        self._check_index()
        tc = layout.text_config(self.config)
        E = tc.get("num_experts")
        self.stacks = {
            n: layer
            for h in self.headers.values()
            for n in h.tensors
            if (layer := stacked_layer(n)) is not None
        }
        if self.stacks and not E:
            raise CheckpointError(
                f"{build}/config.json: no num_experts but the build has "
                "stacked experts; is config.json from this build?"
            )
        self.gmap = graded.GradedMap.from_config(self.config)
        for h in self.headers.values():
            for n, t in h.tensors.items():
                rows = len(graded.stack_rows(self.gmap, n, E) or ()) if n in self.stacks else 0
                if n in self.stacks and (not t.shape or t.shape[0] != rows):
                    raise CheckpointError(
                        f"{h.path}: stacked expert tensor {n!r} is {t.dtype}{list(t.shape)} "
                        f"but config.json implies {rows} experts (num_experts={E}, graded "
                        f"map {'yes' if self.gmap else 'no'}); the leading dim must match "
                        "(a rank folder cannot be sliced again)"
                    )
        _check_placement(placement, size, E, set(self.stacks.values()), str(build))
        if self.gmap is not None:
            for layer, ids in self.gmap.hi.items():
                held = {placement.owners[layer][e] for e in ids}
                if ids and len(held) < size:
                    raise PlacementError(
                        f"placement gives rank(s) {sorted(set(range(size)) - held)} none of "
                        f"layer {layer}'s {len(ids)} promoted experts (an empty hi bank); "
                        "use k3dist.format.graded.balance_hi(placement, "
                        "GradedMap.from_config(cfg))"
                    )
        self.placement = placement
        self.tc = tc
        self.attention = resolve_attention(attention, size)
        shapes = {
            n: t.shape
            for h in self.headers.values()
            for n, t in h.tensors.items()
            if n not in self.stacks
        }
        self.split_layers = (
            set(layout.split_layers(tc, size, shapes)) if self.attention == "split" else set()
        )
        self.ident = _identity(self.build_hash, rank, size, placement, self.attention)

    def _build_manifest(self) -> dict | None:
        p = self.build / MANIFEST
        if not p.exists():
            if (self.build / JOURNAL).exists():
                raise CheckpointError(
                    f"{self.build}: an unfinished conversion (journal, no "
                    f"{MANIFEST}); finish it with python -m k3dist.build.convert"
                )
            return None  # e.g. an mlx-community build
        return manifest.verify(self.build, "build")

    def _check_index(self) -> None:
        for name, f in self.weight_map.items():
            if name not in self.headers[f].tensors:
                raise CheckpointError(
                    f"{self.build / f}: the index places {name!r} here but "
                    "the file does not hold it; copy the build again"
                )

    def _plan(self, fname: str) -> list[tuple[TensorInfo, tuple[int, ...], list]]:
        """(tensor, output shape, byte ranges) in the file's data order."""
        plan = []
        for t in sorted(self.headers[fname].tensors.values(), key=lambda t: t.start):
            layer = self.stacks.get(t.name)
            rule = (
                layout.split_rule(self.tc, t.name)
                if layout.layer_of(t.name) in self.split_layers
                else None
            )
            if rule is not None:
                plan.append((t, *_split_reads(t, rule, self.rank, self.size)))
            elif layer is None:
                plan.append((t, t.shape, [(s, n, None) for s, n in _runs([0], t.nbytes)]))
            else:
                mine = graded.local_rows(
                    self.gmap, t.name, self.placement.num_experts, self.placement, self.rank
                )
                per = t.nbytes // t.shape[0]
                plan.append(
                    (t, (len(mine), *t.shape[1:]), [(s, n, None) for s, n in _runs(mine, per)])
                )
        return plan

    def _slice_file(self, fname: str, bar: tqdm, new: dict[str, bytes] | None = None) -> dict:
        """The rank's part of the build's file ``fname``. ``new`` (:meth:`reslice`): the
        build's bytes of some of its tensors; every other tensor's part is the one this
        rank folder's ``fname`` already holds."""
        plan = self._plan(fname)
        entries = [(t.name, t.dtype, shape) for t, shape, _ in plan]
        held = None if new is None else self._held(fname, entries)

        def chunks(t: TensorInfo, ranges) -> Iterator[bytes]:
            for start, length, cols in ranges:
                if new is not None:
                    data = new[t.name][start : start + length]
                elif self.tensors is None:
                    data = read_bytes(t, start, length)
                else:
                    data = self.tensors.read(t, start, length)
                bar.update(len(data))
                if cols is not None:
                    row, a, b = cols
                    data = np.frombuffer(data, np.uint8).reshape(-1, row)[:, a:b].tobytes()
                yield data

        with StreamWriter(self.out / fname, entries, self.headers[fname].metadata or None) as w:
            for t, _, ranges in plan:
                if held is not None and t.name not in new:
                    w.write(t.name, iter_chunks(held.tensors[t.name]))
                else:
                    w.write(t.name, chunks(t, ranges))
        return {
            "file": fname,
            "bytes": w.size,
            "sha256": w.sha256,
            "tensors": len(entries),
            "header_sha256": w.header_sha256,
            "tensor_sha256": w.tensor_sha256,
        }

    def _held(self, fname: str, entries: list[tuple[str, str, tuple]]) -> Header:
        """This rank folder's ``fname`` as it is now, checked to hold this rank's part of
        every tensor of the build's file (the layout a rewrite keeps)."""
        p = self.out / fname
        if not p.exists():
            raise CheckpointError(
                f"{p}: missing; a rewrite replaces tensors in a sliced rank folder (slice "
                "the build again into a new folder)"
            )
        h = read_header(p)
        order = sorted(h.tensors.values(), key=lambda t: t.start)
        got = [(t.name, t.dtype, tuple(t.shape)) for t in order]
        if got != [(n, d, tuple(s)) for n, d, s in entries]:
            raise CheckpointError(
                f"{p}: its tensors are not rank {self.rank}'s part of {self.build / fname} "
                "(another build or slicing); slice the build again into a new folder"
            )
        return h

    # -- rewriting a finished rank folder as another build of the same layout ----------
    def reopen(self, previous: str) -> bool:
        """Open this rank folder to rewrite it: it holds the finished rank folder of the
        build ``previous`` (its build hash) with this one's files, layout and placement
        (``k3dist.build.dwq``: the same build with some tensors' bytes new). Its manifest
        becomes a journal of this build naming the files as they were (:meth:`keep`
        takes one unchanged, :meth:`reslice` writes one with new tensors); resumes such
        a journal; True when the folder is already this build's, complete."""
        mp, old = self.out / MANIFEST, None
        if mp.exists():
            old = json.loads(mp.read_text())
            same = {k: v for k, v in self.ident.items() if k != "build_hash"}
            prev = old.get("identity", {})
            if prev != self.ident and (
                prev.get("build_hash") != previous
                or {k: v for k, v in prev.items() if k != "build_hash"} != same
            ):
                want = _describe({**self.ident, "build_hash": previous})
                raise CheckpointError(
                    f"{self.out}: holds {_describe(prev)}, not {want} to rewrite as build "
                    f"{self.build_hash}; slice the build it came from again into it, or "
                    "choose that build's rank folder"
                )
            if prev != self.ident:
                journal = {
                    "kind": "rank",
                    "identity": self.ident,
                    "done": {},
                    "input": "build",
                    "previous": {
                        n: {
                            "file": n,
                            "bytes": e["bytes"],
                            "sha256": e["sha256"],
                            "header_sha256": e["header_sha256"],
                            "tensor_sha256": e["tensors"],
                        }
                        for n, e in old["files"].items()
                        if n.endswith(".safetensors")
                    },
                }
                write_json_atomic(self.out / JOURNAL, journal)
                (self.out / verify.STAMP).unlink(missing_ok=True)
                mp.unlink()  # the journal first: a stop between the two resumes from it
        if not self.open():
            if "previous" not in self.folder.journal:
                raise CheckpointError(
                    f"{self.out}: a journal of build {self.build_hash} that is not a "
                    "rewrite of a finished rank folder; delete the folder and slice again"
                )
            return False
        return True

    def keep(self, fname: str) -> None:
        """File ``fname`` is this build's as it is (unchanged by the rewrite)."""
        if fname in self.folder.done:
            return
        e = self.folder.journal["previous"][fname]
        p = self.out / fname
        if not p.exists() or p.stat().st_size != e["bytes"]:
            raise CheckpointError(
                f"{p}: missing or not the {e['bytes']:,} bytes its manifest had; delete "
                "the folder and slice again"
            )
        self.folder.done[fname] = e
        write_json_atomic(self.out / JOURNAL, self.folder.journal)

    def reslice(self, fname: str, new: dict[str, bytes]) -> None:
        """File ``fname`` again, the tensors in ``new`` (name -> the build's bytes of the
        whole tensor) replaced by their part for this rank, every other tensor's bytes
        copied from the file as it is (skipped when journaled done)."""
        bar = tqdm(disable=True)
        self.folder.unit(fname, lambda: self._slice_file(fname, bar, new))

    def _small_files(self) -> list[str]:
        """Tokenizer and other files to carry: not tensors, index, manifest or journal."""
        skip = {INDEX_NAME, MANIFEST, JOURNAL, CONFIG_NAME}
        return sorted(
            p.name
            for p in self.build.iterdir()
            if p.is_file()
            and not p.name.startswith(".")
            and p.name not in skip
            and not p.name.endswith((".safetensors", ".partial", ".tmp"))
        )

    def run(self, progress: bool = True) -> Path:
        if self.open():
            return self.out
        total = sum(sum(r[1] for r in ranges) for f in self.files for _, _, ranges in self._plan(f))
        bar = tqdm(
            total=total, unit="B", unit_scale=True, disable=not progress, desc=f"rank {self.rank}"
        )
        for f in self.files:
            self.slice(f, bar)
        bar.close()
        return self.finish()

    def open(self) -> bool:
        """Open (or resume) the rank folder; True when it is already complete."""
        self.folder = _folder(self.out, self.ident, "build")
        self.t0 = time.perf_counter()
        return self.folder.open()

    def pending(self, fname: str) -> bool:
        return fname not in self.folder.done

    def slice(self, fname: str, bar: tqdm | None = None) -> None:
        """One file of the build into the rank folder (skipped when journaled done)."""
        bar = bar or tqdm(disable=True)
        if not self.folder.unit(fname, lambda: self._slice_file(fname, bar)):
            bar.update(sum(x[1] for _, _, r in self._plan(fname) for x in r))

    def finish(self) -> Path:
        """Index, config, small files and the manifest, once every file is sliced."""
        folder, t0 = self.folder, self.t0
        total_size = sum(folder.done[f]["bytes"] for f in self.files)
        meta = {**self.index.get("metadata", {}), "total_size": total_size}
        write_json_atomic(self.out / INDEX_NAME, {"metadata": meta, "weight_map": self.weight_map})
        small = self._small_files()
        _copy_file(self.build / CONFIG_NAME, self.out / CONFIG_NAME)
        for name in small:
            _copy_file(self.build / name, self.out / name)
        _write_manifest(
            folder,
            self.placement,
            self.build,
            {f: folder.done[f] for f in self.files},
            [INDEX_NAME, CONFIG_NAME, *small],
            time.perf_counter() - t0,
            sorted(self.split_layers),
        )
        return self.out


# ----------------------------------------------------------------------------- source input


class SourceSlicer:
    """Write a rank folder straight from a Moonshot-format source: the converter,
    unit by unit, with this rank's expert subset."""

    def __init__(
        self,
        src: Path,
        out: Path,
        rank: int,
        size: int,
        placement: Placement,
        nonexpert_bits: int = 16,
        group_size: int = 64,
        attention: str | None = "replicated",
    ):
        check_rank(rank, size)
        if resolve_attention(attention, size) == "split":
            raise CheckpointError(
                f"{src}: a Moonshot-format source slices with attention "
                "replicated; to split attention across ranks convert it "
                "first (python -m k3dist.build.convert) and slice the build, "
                "or slice with --attention replicated"
            )
        self.src = Source(src)
        tc = self.src.text_config
        moe = set(layout.moe_layers(tc))
        _check_placement(placement, size, tc.get("num_experts") or 0, moe, str(src))
        self.placement, self.rank, self.out, self.size = placement, rank, out, size
        self.conv = convert.Converter(
            self.src,
            out,
            nonexpert_bits,
            group_size,
            experts=lambda layer: placement.experts_of(layer, rank),
        )
        self.conv.preflight()  # every header and A_log tail before anything is written
        self.build_hash = convert.build_hash(self.conv.ident)
        self.ident = _identity(self.build_hash, rank, size, placement)

    def _unit_bytes(self, group: str) -> int:
        """Source bytes this rank reads for a unit (the progress bar's measure)."""
        n = 0
        for s in self.conv.specs.get(group, []):
            if s.family == "experts":
                layer = s.layer
                E = self.placement.num_experts
                n += s.nbytes * len(self.placement.experts_of(layer, self.rank)) // E
            else:
                n += s.nbytes
        return n

    def run(self, progress: bool = True) -> Path:
        folder = _folder(self.out, self.ident, "source")
        if folder.open():
            return self.out
        groups = [
            g for g in self.conv.units() if g != "vision" or self.rank in vision_ranks(self.size)
        ]
        bar = tqdm(
            total=sum(self._unit_bytes(g) for g in groups),
            unit="B",
            unit_scale=True,
            disable=not progress,
            desc=f"rank {self.rank}",
        )
        t0 = time.perf_counter()
        for g in groups:
            if folder.unit(g, lambda g=g: self.conv.convert_unit(g)):
                mx.clear_cache()
            bar.update(self._unit_bytes(g))
        bar.close()
        done = folder.done
        copied = self.conv.write_metadata(done, groups)
        _write_manifest(
            folder,
            self.placement,
            self.src.path,
            {done[g]["file"]: done[g] for g in groups},
            [INDEX_NAME, CONFIG_NAME, *copied],
            time.perf_counter() - t0,
        )
        return self.out


# ----------------------------------------------------------------------------- entry points


def slice_rank(
    build: str | Path,
    out: str | Path,
    rank: int,
    size: int,
    placement: Placement | None = None,
    progress: bool = True,
    *,
    nonexpert_bits: int = 16,
    group_size: int = 64,
    attention: str | None = None,
) -> Path:
    """Write rank ``rank`` of ``size``'s folder from an MLX build or a Moonshot-format
    source (``nonexpert_bits``/``group_size``: source input only, as in convert).
    ``attention``: ``split`` (a build's default: each rank holds its share of every
    layer whose heads divide evenly, ``layout.split_layers``) or ``replicated`` (a
    source's default and only mode).
    ``placement`` defaults to contiguous. Everything is checked before anything is
    written; a partial folder of the same slicing is resumed."""
    build, out = Path(build), Path(out)
    check_rank(rank, size)
    if not build.is_dir():
        raise CheckpointError(
            f"{build}: not a folder; --build names an MLX build (python -m "
            "k3dist.build.convert) or a Moonshot-format checkpoint"
        )
    if out.resolve() == build.resolve():
        raise CheckpointError(f"{out}: is the input folder itself; choose another --out")
    if placement is None:
        placement = placement_for(build, size)
    if is_source(build):
        slicer = SourceSlicer(
            build, out, rank, size, placement, nonexpert_bits, group_size, attention or "replicated"
        )
    else:
        slicer = BuildSlicer(build, out, rank, size, placement, attention)
    return slicer.run(progress)


def slice_all(
    build: str | Path,
    out_pattern: str,
    size: int,
    placement: Placement | None = None,
    progress: bool = True,
    attention: str | None = None,
) -> list[Path]:
    """Every rank's folder; ``out_pattern`` holds ``{rank}``."""
    if size > 1 and "{rank}" not in out_pattern:
        raise CheckpointError(
            f"--out {out_pattern!r} has no {{rank}}; every rank needs its "
            "own folder (e.g. runs/ranks/rank{rank})"
        )
    placement = placement or placement_for(build, size)
    return [
        slice_rank(
            build, out_pattern.format(rank=r), r, size, placement, progress, attention=attention
        )
        for r in range(size)
    ]
