"""Builds read the same way whether they are folders on disk or never written.

The streamed teacher, calibration and the graded build read a build through one
interface: its ``config``, ``manifest`` (its ``build_hash`` names it), ``index`` (tensor
name -> file), per file a safetensors ``header`` and its bytes (``chunks``, ``read``),
per prefix (or tuple of prefixes) arrays (``arrays``: a folder's lazy, read when
evaluated; a source view's read then and there, a unit at a time, which costs ~7x less
CPU at K3's 896 experts than a lazy load a part; a layer stream asks for a module's at
its first use and again after a release), the whole model (``model``; ``weights=False``:
its structure only) and its small files (``write_small``: tokenizer files).

- :class:`BuildFolder`: a k3dist build on disk (``k3dist.pipeline.convert``, ``grade``).
- :class:`SourceView`: the MXFP4 base build of a Moonshot source, in memory a layer at a
  time: each unit's tensors exactly as ``convert`` would store them (the converter's own
  :meth:`~k3dist.pipeline.convert.Converter.unit`: experts the source's MXFP4 bytes, stacked;
  non-experts sanitized and quantized to the plan's formats by mlx-lm's modules). Its
  ``build_hash`` is the written build's, so teacher and graded manifests name the same
  base either way (``tests/pipeline/test_view.py``: every tensor equal to the written build's
  bytes).
- ``k3dist.pipeline.student.LoView``: the uniform lo-bank student of either, in memory.
"""

from __future__ import annotations

import bisect
import itertools
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from k3dist.format.folder import CONFIG_NAME, INDEX_NAME, load_config, weight_map
from k3dist.format.graded import GRADED_KEY
from k3dist.format.manifest import JOURNAL, MANIFEST
from k3dist.format.sfile import (
    CHUNK_BYTES,
    Header,
    OpenFiles,
    TensorInfo,
    iter_chunks,
    mx_dtype,
    mx_dtype_name,
    mx_to_bytes,
    read_header,
    read_parts,
)
from k3dist.pipeline.convert import (
    Converter,
    ExpertStack,
    build_hash,
    output_file,
    shape_only,
)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model


def load_lazy(path: str | Path, dtype: str = "float32") -> nn.Module:
    """Any k3dist build (MXFP4 or graded) with nothing read yet; eval mode."""
    path = Path(path)
    config = load_config(path)
    if GRADED_KEY in config:
        from k3dist.model import two_bank

        model, _ = two_bank.load_build(path, dtype, lazy=True)
    else:
        model, _ = load_model(path, lazy=True)
        model.set_dtype(mx_dtype(dtype))
    model.eval()
    return model


def model_from(
    config: dict, weights: dict[str, mx.array] | None, dtype: str, classes=None
) -> nn.Module:
    """mlx-lm's ``load_model`` of a folder holding ``config`` and ``weights`` (lazy),
    without the folder: the model is made and quantized from the config alone (every
    quantized module has its own ``quantization`` entry in k3dist builds), then takes the
    weights through its own ``sanitize`` as ``load_model`` would, strictly. ``weights``
    None: the model as made, its weights unevaluated stand-ins (a layer stream loads
    each module before its use)."""
    with tempfile.TemporaryDirectory(prefix="k3dist-view-") as d:
        (Path(d) / CONFIG_NAME).write_text(json.dumps(config))
        kw = {} if classes is None else {"get_model_classes": lambda config: classes}
        model, _ = load_model(Path(d), lazy=True, strict=False, **kw)
    if weights is not None:
        if hasattr(model, "sanitize"):
            weights = model.sanitize(weights)
        model.load_weights(list(weights.items()), strict=True)
    model.set_dtype(mx_dtype(dtype))
    model.eval()
    return model


class BuildFolder:
    """A k3dist build on disk (module doc)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = load_config(self.path)
        mp = self.path / MANIFEST
        self.manifest = json.loads(mp.read_text()) if mp.exists() else None
        self.index = weight_map(self.path)
        self._files = OpenFiles()  # grade reads a stack an expert run at a time

    def __str__(self) -> str:
        return str(self.path)

    @property
    def describe(self) -> str:
        return str(self.path.resolve())

    def files(self) -> list[str]:
        return list(dict.fromkeys(self.index.values()))

    def header(self, fname: str) -> Header:
        return read_header(self.path / fname)

    def chunks(self, t: TensorInfo) -> Iterator[bytes]:
        return iter_chunks(t)

    def read(self, t: TensorInfo, start: int, length: int) -> bytes:
        return self._files.read(t, start, length)

    def arrays(self, prefix: str | tuple[str, ...]) -> dict[str, mx.array]:
        out = {}
        for f in sorted({f for n, f in self.index.items() if n.startswith(prefix)}):
            out |= {n: a for n, a in mx.load(str(self.path / f)).items() if n.startswith(prefix)}
        return out

    def model(self, dtype: str = "float32", weights: bool = True) -> nn.Module:
        """The build as a model, lazily (``weights`` False: the same; a folder's lazy
        load costs one header parse a file)."""
        return load_lazy(self.path, dtype)

    def write_small(self, out: Path) -> list[str]:
        """The build's small files (tokenizer, ...) into ``out``; their names."""
        small = small_files(self.path, CONFIG_NAME)
        for name in small:
            shutil.copyfile(self.path / name, out / name)
        return small


def small_files(folder: Path, *skip: str) -> list[str]:
    """A build's small files (tokenizer, chat template, config, ...): every file but its
    shards, index, manifest, journal, hidden files and ``skip``; sorted names."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.suffix != ".safetensors"
        and p.name not in (INDEX_NAME, MANIFEST, JOURNAL, *skip)
    )


def as_build(build):
    """A path (a build folder) or a view, as a view."""
    return BuildFolder(build) if isinstance(build, (str, Path)) else build


def stack_arrays(stacks: list[ExpertStack]) -> dict[str, mx.array]:
    """A unit's expert stacks, read now: every part into one buffer in one go
    (``sfile.read_parts``; a K3 layer's 5,376 parts lie back to back in their shard,
    so that is ~6 ``preadv`` calls), each stack a view of its bytes as its dtype and
    shape (``U32``: MXFP4 codes, 8 to a word; ``U8``: scales). No copy: MLX's slices
    of an evaluated array share its memory."""
    if not stacks:
        return {}
    flat = read_parts([t for e in stacks for t in e.parts], "U8", (sum(e.nbytes for e in stacks),))
    out, at = {}, 0
    for e in stacks:
        out[e.name] = flat[at : at + e.nbytes].view(mx_dtype(e.dtype)).reshape(e.shape)
        at += e.nbytes
    return out


def read_now(t: TensorInfo) -> mx.array:
    """One source tensor as an array, read now (``sfile.read_parts``): no shard's
    header parsed again (``mx.load`` of a 5,404-tensor shard is ~0.05 s, and a unit
    that straddles two shards opened both)."""
    return read_parts((t,), t.dtype, t.shape)


class SourceView:
    """The MXFP4 base build of a Moonshot-format source, never written (module doc).
    ``nonexpert``: a format per non-expert class, as ``convert --nonexpert`` takes it."""

    def __init__(self, src: str | Path, nonexpert: str | dict | None = None):
        from k3dist.format.source import Source

        self.conv = Converter(Source(src), None, nonexpert=nonexpert)
        self.conv.preflight()
        self.path = self.conv.src.path
        self.groups = self.conv.units()
        self.file_of = {g: output_file(g) for g in self.groups}
        self.group_of = {f: g for g, f in self.file_of.items()}
        self.index: dict[str, str] = {}
        self._headers: dict[str, Header] = {}
        self._backing: dict[str, object] = {}  # tensor -> ExpertStack | TensorInfo | group
        done = {}
        for g in self.groups:
            entries, quant = self._layout(g)
            done[g] = {"quantization": quant}
            tensors, at = {}, 0
            vpath = Path(f"{self.path}[base view]") / self.file_of[g]
            for name, dtype, shape, nbytes in entries:
                tensors[name] = TensorInfo(name, dtype, tuple(shape), at, at + nbytes, vpath)
                at += nbytes
                self.index[name] = self.file_of[g]
            self._headers[self.file_of[g]] = Header(vpath, tensors, {"format": "mlx"}, 0, at)
        self.config = self.conv.build_config([done[g] for g in self.groups])
        ident = self.conv.ident
        self.manifest = {
            "kind": "build",
            "identity": ident,
            "build_hash": build_hash(ident),
            "profile": self.conv.profile(done, self.groups),
            "view": "source",
        }
        self._cache: tuple[str, dict[str, bytes]] | None = None
        self._ends: dict[str, list[int]] = {}
        self._files = OpenFiles()  # grade reads a stack's experts part by part

    def __str__(self) -> str:
        return f"{self.path} (read as its MXFP4 base build)"

    @property
    def describe(self) -> str:
        return f"{self.path.resolve()} (MXFP4 base build view)"

    def _layout(self, g: str) -> tuple[list[tuple[str, str, tuple, int]], dict]:
        """(name, dtype, shape, bytes) of unit ``g`` in file order, its quantization."""
        if g == "vision":
            infos = self.conv.vision_infos()
            for t in infos:
                self._backing[t.name] = t
            return [(t.name, t.dtype, t.shape, t.nbytes) for t in infos], {}
        dense, experts, quant = self.conv.unit(g, shape_only)  # opens no shard
        out = []
        for n, a in dense:
            self._backing[n] = g
            out.append((n, mx_dtype_name(a), tuple(a.shape), a.nbytes))
        for e in experts:
            self._backing[e.name] = e
            out.append((e.name, e.dtype, e.shape, e.nbytes))
        return out, quant

    # -- bytes (what grade reads) ---------------------------------------------------
    def files(self) -> list[str]:
        return [self.file_of[g] for g in self.groups]

    def header(self, fname: str) -> Header:
        return self._headers[fname]

    def _dense_bytes(self, g: str) -> dict[str, bytes]:
        """The unit's non-expert tensors evaluated (one unit held at a time)."""
        if self._cache is None or self._cache[0] != g:
            self._cache = None
            dense, _, _ = self.conv.unit(g, read_now)  # no shard header parsed again
            mx.eval([a for _, a in dense])
            self._cache = (g, {n: mx_to_bytes(a) for n, a in dense})
            mx.clear_cache()
        return self._cache[1]

    def read(self, t: TensorInfo, start: int, length: int) -> bytes:
        b = self._backing[t.name]
        if isinstance(b, str):
            return self._dense_bytes(b)[t.name][start : start + length]
        if isinstance(b, TensorInfo):
            return self._files.read(b, start, length)
        # an expert stack: the parts' byte ranges, from the first part the range
        # touches (grade reads a stack a run of experts at a time: scanning all 896
        # parts a read made a layer's reads quadratic in its experts)
        ends = self._part_ends(t.name, b)
        out, k = [], bisect.bisect_right(ends, start)
        while k < len(b.parts) and (pos := ends[k] - b.parts[k].nbytes) < start + length:
            lo, hi = max(start, pos), min(start + length, ends[k])
            out.append(self._files.read(b.parts[k], lo - pos, hi - lo))
            k += 1
        return b"".join(out)

    def _part_ends(self, name: str, stack) -> list[int]:
        """Cumulative end offsets of an expert stack's parts (a unit's 6 stacks kept:
        grade reads them a unit at a time, packed codes and scales in turn)."""
        if name not in self._ends:
            if len(self._ends) >= 6:
                self._ends.clear()
            self._ends[name] = list(itertools.accumulate(p.nbytes for p in stack.parts))
        return self._ends[name]

    def chunks(self, t: TensorInfo) -> Iterator[bytes]:
        for at in range(0, t.nbytes, CHUNK_BYTES):
            yield self.read(t, at, min(CHUNK_BYTES, t.nbytes - at))

    # -- arrays (what a layer stream reads) -------------------------------------------
    def unit_arrays(self, g: str) -> dict[str, mx.array]:
        """Unit ``g``'s arrays, as its file would load: its source tensors read now (a
        layer stream asks for a layer's at its first use, just before it runs), the
        non-expert ones sanitized and quantized lazily."""
        if g == "vision":
            return {n: read_now(self._backing[n]) for n in self._headers[self.file_of[g]].tensors}
        dense, experts, _ = self.conv.unit(g, read_now)
        return dict(dense) | stack_arrays(experts)

    def arrays(self, prefix: str | tuple[str, ...]) -> dict[str, mx.array]:
        out = {}
        for f in dict.fromkeys(f for n, f in self.index.items() if n.startswith(prefix)):
            out |= {
                n: a for n, a in self.unit_arrays(self.group_of[f]).items() if n.startswith(prefix)
            }
        return out

    def all_arrays(self) -> dict[str, mx.array]:
        out = {}
        for g in self.groups:
            out |= self.unit_arrays(g)
        return out

    def model(self, dtype: str = "float32", weights: bool = True) -> nn.Module:
        """The build as a model, lazily; ``weights`` False: unevaluated stand-ins
        (``model_from``), no unit made."""
        return model_from(self.config, self.all_arrays() if weights else None, dtype)

    def write_small(self, out: Path) -> list[str]:
        return sorted(self.conv.copy_tokenizer(out))
