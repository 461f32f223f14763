"""Moonshot-format K3 checkpoints read through their headers: index, tensor
lookup with checks, the ``A_log`` padding check, and the audit.

Nothing here reads tensor data except the bytes a check needs (the ``A_log``
tails); a converter asks ``Source.info`` for a tensor and streams its byte range.

    python -m k3dist.build.checkpoint audit SRC [--json]
    python -m k3dist.build.checkpoint audit --config kimi-k3-config.json \
        --index kimi-k3-model.safetensors.index.json.gz      # names only, no shards
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import hashlib
import json
import struct
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3dist.format import layout
from k3dist.format.sfile import (
    MAX_HEADER,
    CheckpointError,
    Header,
    TensorInfo,
    read_bytes,
    read_header,
)

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SUPPORTED_QUANT = "mxfp4-pack-quantized"


def load_config(src: str | Path) -> dict:
    """``config.json`` as written. Not ``mlx_lm.utils.load_config``: that merges
    generation_config.json's ``eos_token_id`` in (a conversion would then write another
    config.json) and does not name the file when it is missing or broken."""
    path = Path(src) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing; a K3 checkpoint folder has config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def quantization_format(config: dict) -> dict:
    """The source's expert quantization, checked: only Moonshot's release format
    (compressed-tensors mxfp4-pack-quantized, group 32) converts bit-exactly."""
    qc = config.get("quantization_config") or layout.text_config(config).get(
        "quantization_config")
    if qc is None:
        raise CheckpointError("config.json has no quantization_config; k3dist converts "
                              "Moonshot's release (compressed-tensors mxfp4-pack-quantized)")
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors" or fmt != SUPPORTED_QUANT:
        raise CheckpointError(
            f"config.json: unknown quantization format quant_method={method!r} "
            f"format={fmt!r}; k3dist converts compressed-tensors {SUPPORTED_QUANT!r} only")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits", 4) != 4 or w.get("group_size", 32) != 32 or w.get(
                "type", "float") != "float":
            raise CheckpointError(f"config.json: quantization group {name!r} is {w!r}; "
                                  "MXFP4 needs num_bits 4, group_size 32, type float")
    return qc


class Source:
    """A checkpoint folder: config, index and lazily read shard headers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a folder")
        self.config = load_config(self.path)
        self.text_config = layout.text_config(self.config)
        self.index_path = self.path / INDEX_NAME
        if self.index_path.exists():
            try:
                index = json.loads(self.index_path.read_text())
                self.weight_map: dict[str, str] = index["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{self.index_path}: malformed index ({e!r})") from None
            self.index_metadata = index.get("metadata", {})
            self.index_sha256 = hashlib.sha256(self.index_path.read_bytes()).hexdigest()
        else:
            single = self.path / "model.safetensors"
            if not single.exists():
                raise CheckpointError(f"{self.path}: neither {INDEX_NAME} nor "
                                      "model.safetensors; is this a checkpoint folder?")
            h = read_header(single)
            self.weight_map = {n: single.name for n in h.tensors}
            self.index_metadata = {}
            self.index_sha256 = hashlib.sha256(
                json.dumps(sorted(self.weight_map)).encode()).hexdigest()
        self._headers: dict[str, Header] = {}

    @property
    def shard_files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def has_shards(self) -> bool:
        return all((self.path / f).exists() for f in self.shard_files)

    def header(self, fname: str) -> Header:
        if fname not in self._headers:
            self._headers[fname] = read_header(self.path / fname)
        return self._headers[fname]

    def info(self, name: str, spec: layout.TensorSpec | None = None) -> TensorInfo:
        """Where tensor ``name`` lives, checked against the index, header and spec."""
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"{self.index_path}: tensor {name!r} is missing from the "
                                  "index; the checkpoint is incomplete or another model's")
        t = self.header(fname).tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path / fname}: the index places tensor {name!r} "
                                  "here but the shard does not hold it; re-download the shard "
                                  "or the index")
        if spec is not None:
            check_spec(t, spec)
        return t

    @classmethod
    def from_files(cls, config: str | Path, index: str | Path,
                   root: str | Path | None = None) -> Source:
        """A checkpoint whose config and index are named explicitly; either may be
        gzipped (``.gz``), as the real K3's ``kimi-k3-config.json`` and
        ``kimi-k3-model.safetensors.index.json.gz`` shipped in ``k3dist/data``. Shard
        files are looked for in ``root``, by default the index's folder;
        ``index_sha256`` is the digest of the uncompressed index."""
        self = cls.__new__(cls)
        index = Path(index)
        self.path = Path(root) if root is not None else index.parent
        self.config_path = Path(config)
        self.config, _ = _read_json(self.config_path, "config")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config}: not a JSON object; expected a config.json")
        self.text_config = layout.text_config(self.config)
        self.index_path = index
        data, raw = _read_json(index, "index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: malformed index (no weight_map object)")
        self.weight_map = weight_map
        self.index_metadata = data.get("metadata") or {}
        self.index_sha256 = hashlib.sha256(raw).hexdigest()
        self._headers = {}
        return self


def check_spec(t: TensorInfo, spec: layout.TensorSpec) -> None:
    if t.dtype != spec.dtype or (spec.shape is not None and t.shape != spec.shape):
        raise CheckpointError(
            f"{t.path}: tensor {t.name!r} is {t.dtype}{list(t.shape)} but config.json "
            f"implies {spec.dtype}{list(spec.shape or ())}; the shard and config.json "
            "come from different models")


def check_a_log_tail(t: TensorInfo, num_heads: int) -> None:
    """K3 stores A_log per head padded with zeros to head_dim. Read only the tail
    and refuse a non-zero one: it would mean the real heads are not the first ones."""
    if t.dtype != "F32" or len(t.shape) != 1:
        raise CheckpointError(f"{t.path}: {t.name!r} is {t.dtype}{list(t.shape)}, "
                              "expected a 1-D F32 per-head vector")
    if t.shape[0] < num_heads:
        raise CheckpointError(f"{t.path}: {t.name!r} has {t.shape[0]} values for "
                              f"{num_heads} heads")
    tail = np.frombuffer(read_bytes(t, 4 * num_heads), dtype=np.float32)
    if np.any(tail != 0):
        layer = layout.layer_of(t.name)
        bad = int(np.flatnonzero(tail != 0)[0]) + num_heads
        raise CheckpointError(
            f"{t.path}: layer {layer} {t.name!r} has a non-zero padding tail (value "
            f"{float(tail[bad - num_heads])!r} at index {bad}, num_heads={num_heads}); "
            "K3 pads A_log per head with zeros, so this checkpoint is corrupted or "
            "laid out differently; refusing to truncate it")


# ----------------------------------------------------------------------------- audit

HEADER_CHECKS = ("shard_headers", "index_vs_headers", "dtypes_shapes", "a_log_padding")
NO_SHARDS = "no shard files: header-only checks skipped"


def _read_json(path: Path, what: str) -> tuple[object, bytes]:
    """A JSON file, gunzipped first when its name ends in ``.gz``: (value, raw bytes)."""
    if not path.exists():
        raise CheckpointError(f"{path}: missing; pass the checkpoint's {what} file")
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        return json.loads(raw), raw
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid {what} JSON file ({e})") from None


def open_source(src: str | Path | None = None, *, config: str | Path | None = None,
                index: str | Path | None = None) -> Source:
    """``Source(src)``, or with ``config``/``index`` named explicitly (either may be
    ``.gz``; what is not named defaults to SRC/config.json and SRC's index)."""
    if config is None and index is None:
        if src is None:
            raise CheckpointError("no checkpoint given: pass a folder, or a config and an index")
        return Source(src)
    root = Path(src) if src is not None else None
    if root is None and (config is None or index is None):
        raise CheckpointError("without a checkpoint folder, pass both a config and an index")
    return Source.from_files(config if config is not None else root / "config.json",
                             index if index is not None else root / INDEX_NAME, root)


@dataclass
class _Implied:
    """Every tensor a config implies, by name, in checkpoint order. Routed experts
    are regular, so each MoE layer's six expert specs are built once (for expert 0)
    and shared by all its experts' names: ``specs[n].name`` may differ from ``n``.
    That keeps the real model's 497k names well under a second."""

    specs: dict[str, layout.TensorSpec]
    by_id: dict[int, layout.TensorSpec]  # id(spec) -> spec, one per distinct object
    counts: Counter
    a_log: dict[int, str]  # KDA layer -> its A_log tensor name


def _implied(config: dict) -> _Implied:
    tc = layout.text_config(config)
    specs: dict[str, layout.TensorSpec] = {}
    by_id: dict[int, layout.TensorSpec] = {}
    counts: Counter = Counter()

    def add(spec_list: list[layout.TensorSpec]) -> None:
        for s in spec_list:
            specs[s.name] = s
            by_id[id(s)] = s
            counts[s.family] += 1

    for layer in range(tc["num_hidden_layers"]):
        add(layout.layer_specs(tc, layer, with_experts=False))
        if layout.is_moe_layer(tc, layer):
            first = layout.expert_specs(tc, layer, 0)
            stem = first[0].name[: first[0].name.index(".experts.0.") + len(".experts.")]
            leaves = [(s.name[len(stem) + 2:], s) for s in first]  # after "0."
            for s in first:
                by_id[id(s)] = s
            n_experts = tc["num_experts"]
            for e in range(n_experts):
                prefix = f"{stem}{e}."
                for leaf, s in leaves:
                    specs[prefix + leaf] = s
            counts["experts"] += n_experts * len(first)
    add(layout.head_specs(tc))
    add(layout.vision_specs(config))
    a_log = {s.layer: s.name for s in by_id.values()
             if s.family == "kda" and s.name.endswith(".A_log")}
    return _Implied(specs, by_id, counts, dict(sorted(a_log.items())))


@dataclass
class AuditReport:
    """What ``audit`` found. Findings are collected, not raised, so one run names
    every problem; ``ok`` is False when any was found. Checks that need shard
    headers are listed in ``checks_skipped`` (with the reason) when no shard is there."""

    source: str  # folder the shard files are looked for in
    config_path: str
    index_path: str
    index_sha256: str
    tensors: int  # keys in the index
    expected_tensors: int  # keys config.json implies
    counts: dict[str, int]  # family -> index keys config.json implies
    expected_counts: dict[str, int]  # family -> keys config.json implies
    family_bytes: dict[str, int]  # family -> bytes implied by the specs, present keys
    expert_packed: int  # routed expert weight_packed tensors in the index
    bytes_from: str  # "headers": shard_bytes are the headers' tensor bytes; else "specs"
    shard_tensors: dict[str, int]  # shard file -> keys the index places there
    shard_bytes: dict[str, int]  # shard file -> tensor data bytes (unreadable shards absent)
    total_bytes: int  # sum of shard_bytes
    index_total_size: int | None  # the index's metadata.total_size
    missing: list[str] = field(default_factory=list)  # implied by config, not in the index
    unexpected: list[str] = field(default_factory=list)  # in the index, not implied
    mismatches: list[str] = field(default_factory=list)  # dtype/shape vs config.json
    index_errors: list[str] = field(default_factory=list)  # index vs shard header
    shard_errors: dict[str, str] = field(default_factory=dict)  # unreadable shard -> why
    a_log: dict[int, str] = field(default_factory=dict)  # KDA layer -> "ok" or the failure
    errors: list[str] = field(default_factory=list)  # the rest (total_size)
    checks_run: list[str] = field(default_factory=list)
    checks_skipped: dict[str, str] = field(default_factory=dict)  # check -> reason
    seconds: float = 0.0

    @property
    def a_log_failures(self) -> dict[int, str]:
        return {k: v for k, v in self.a_log.items() if v != "ok"}

    @property
    def findings(self) -> int:
        return (len(self.missing) + len(self.unexpected) + len(self.mismatches)
                + len(self.index_errors) + len(self.shard_errors)
                + len(self.a_log_failures) + len(self.errors))

    @property
    def ok(self) -> bool:
        return self.findings == 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["a_log"] = {str(k): v for k, v in self.a_log.items()}
        d["ok"] = self.ok
        d["findings"] = self.findings
        return d


def to_json(report: AuditReport) -> str:
    return json.dumps(report.to_dict(), indent=2)


def audit(src: str | Path | Source | None = None, *, config: str | Path | None = None,
          index: str | Path | None = None) -> AuditReport:
    """Audit a checkpoint through its index and shard headers (no tensor data but
    the ``A_log`` tails). Raises ``CheckpointError`` only when there is nothing to
    audit (no readable config or index); everything else becomes a finding."""
    t0 = time.perf_counter()
    with _gc_paused():
        report = _audit(src if isinstance(src, Source)
                        else open_source(src, config=config, index=index))
    report.seconds = time.perf_counter() - t0
    return report


@contextlib.contextmanager
def _gc_paused():
    """Parsing ~1M small JSON containers (the real index and headers) triggers the
    cyclic GC over and over; nothing here makes cycles, so pause it meanwhile."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _audit(source: Source) -> AuditReport:
    imp = _implied(source.config)
    specs, wm = imp.specs, source.weight_map

    missing_set = specs.keys() - wm.keys()
    missing = [n for n in specs if n in missing_set] if missing_set else []
    unexpected = sorted(wm.keys() - specs.keys())

    by_shard: defaultdict[str, list[str]] = defaultdict(list)
    for n, fname in wm.items():
        by_shard[fname].append(n)
    by_shard = dict(sorted(by_shard.items()))

    # Per spec object: how many index keys it covers, per shard (id(None): unexpected).
    nbytes = {i: s.nbytes for i, s in imp.by_id.items()}
    counts: Counter = Counter()
    family_bytes: Counter = Counter()
    implied_shard: dict[str, int] = {}
    expert_packed = 0
    for fname, names in by_shard.items():
        total = 0
        for i, k in Counter(map(id, map(specs.get, names))).items():
            s = imp.by_id.get(i)
            if s is None:
                continue
            counts[s.family] += k
            family_bytes[s.family] += k * nbytes[i]
            total += k * nbytes[i]
            if s.family == "experts" and s.name.endswith(".weight_packed"):
                expert_packed += k
        implied_shard[fname] = total

    report = AuditReport(
        source=str(source.path),
        config_path=str(getattr(source, "config_path", source.path / "config.json")),
        index_path=str(source.index_path), index_sha256=source.index_sha256,
        tensors=len(wm), expected_tensors=len(specs),
        counts=_by_family(counts), expected_counts=_by_family(imp.counts),
        family_bytes=_by_family(family_bytes), expert_packed=expert_packed,
        bytes_from="specs", shard_tensors={f: len(v) for f, v in by_shard.items()},
        shard_bytes=implied_shard, total_bytes=sum(implied_shard.values()),
        index_total_size=_total_size(source.index_metadata),
        missing=missing, unexpected=unexpected, checks_run=["coverage"])

    if any((source.path / f).exists() for f in by_shard):
        _audit_headers(source, imp, by_shard, report)
    else:
        report.checks_skipped.update({c: NO_SHARDS for c in HEADER_CHECKS})
    _check_total_size(report)
    return report


def _audit_headers(source: Source, imp: _Implied, by_shard: dict[str, list[str]],
                   r: AuditReport) -> None:
    r.checks_run += list(HEADER_CHECKS)
    r.bytes_from = "headers"
    r.shard_bytes = {}
    expect = {i: (s.dtype, list(s.shape), s.nbytes)
              for i, s in imp.by_id.items() if s.shape is not None}
    num_heads = source.text_config["linear_attn_config"]["num_heads"]
    a_log_by_shard: defaultdict[str, list[tuple[int, str]]] = defaultdict(list)
    for layer, name in imp.a_log.items():
        if name in source.weight_map:  # else reported as missing
            a_log_by_shard[source.weight_map[name]].append((layer, name))
    for fname, names in by_shard.items():
        path = source.path / fname
        clean = _certify_shard(path, names, imp.specs, expect)
        if clean is not None:
            nbytes, entries, data_offset = clean

            def tensor(name: str, entries=entries, data_offset=data_offset, path=path):
                e = entries[name]
                b, end = e["data_offsets"]
                return TensorInfo(name, e["dtype"], tuple(e["shape"]), data_offset + b,
                                  data_offset + end, path)
        else:
            try:
                header = source.header(fname)
            except CheckpointError as e:  # missing, truncated, not safetensors
                r.shard_errors[fname] = str(e)
                continue
            _check_header(source, header, names, imp.specs, r)
            nbytes = sum(t.nbytes for t in header.tensors.values())
            tensor = header.tensors.get
        r.shard_bytes[fname] = nbytes
        for layer, name in a_log_by_shard.get(fname, ()):
            t = tensor(name)
            if t is None:
                continue  # reported as an index error already
            try:
                check_a_log_tail(t, num_heads)
                r.a_log[layer] = "ok"
            except CheckpointError as e:
                r.a_log[layer] = str(e)
    r.total_bytes = sum(r.shard_bytes.values())
    r.a_log = dict(sorted(r.a_log.items()))


def _certify_shard(path: Path, names: list[str], specs: dict[str, layout.TensorSpec],
                   expect: dict[int, tuple[str, list[int], int]]
                   ) -> tuple[int, dict, int] | None:
    """The common case, fast: the header lists exactly ``names``, each with the dtype
    and shape config.json implies, spanning its bytes, inside the file. Returns
    (tensor bytes, raw header entries, data offset), or None on any doubt: the
    caller then reads the shard with ``read_header`` and ``check_spec``, which name
    the problem. (``read_header`` makes an object per tensor; for the real model's
    497k tensors that alone takes seconds.)"""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER or 8 + n > size:
                return None
            entries = json.loads(f.read(n))
        entries.pop("__metadata__", None)
        if len(entries) != len(names):
            return None
        total = last = 0
        for name, x in zip(names, map(expect.get, map(id, map(specs.get, names))),
                           strict=True):
            e = entries.get(name)
            if e is None or x is None or e["dtype"] != x[0] or e["shape"] != x[1]:
                return None
            b, end = e["data_offsets"]
            if end - b != x[2]:
                return None
            if end > last:
                last = end
            total += x[2]
        return (total, entries, 8 + n) if 8 + n + last <= size else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, struct.error):
        return None


def _check_header(source: Source, header: Header, names: list[str],
                  specs: dict[str, layout.TensorSpec], r: AuditReport) -> None:
    """Every finding in one readable shard: index keys it lacks, tensors it holds that
    the index does not place there, dtypes and shapes config.json does not imply."""
    tensors = header.tensors
    for n in names:
        t = tensors.get(n)
        if t is None:
            try:
                source.info(n)  # raises with the converter's own message
            except CheckpointError as e:
                r.index_errors.append(str(e))
            continue
        spec = specs.get(n)
        if spec is not None:
            try:
                check_spec(t, spec)
            except CheckpointError as e:
                r.mismatches.append(str(e))
    listed = set(names)
    r.index_errors += [
        f"{header.path}: holds tensor {n!r} that the index does not place there; "
        "the index and the shard disagree (re-download the index or the shard)"
        for n in tensors if n not in listed]


def _total_size(metadata: dict) -> int | None:
    try:
        return int(metadata["total_size"])
    except (KeyError, TypeError, ValueError):
        return None


def _check_total_size(r: AuditReport) -> None:
    if r.index_total_size is None:
        r.checks_skipped["total_size"] = "the index has no metadata.total_size"
    elif r.shard_errors:
        r.checks_skipped["total_size"] = "some shard headers are unreadable"
    elif r.index_errors:
        r.checks_skipped["total_size"] = "the index and the shard headers list different tensors"
    elif r.bytes_from == "specs" and r.unexpected:
        r.checks_skipped["total_size"] = (
            f"{len(r.unexpected)} index keys are not implied by config.json, so their "
            "sizes are unknown without shard headers")
    else:
        r.checks_run.append("total_size")
        if r.total_bytes != r.index_total_size:
            what = ("the shard headers hold" if r.bytes_from == "headers"
                    else "config.json implies for the index's tensors")
            r.errors.append(
                f"{r.index_path}: metadata.total_size is {r.index_total_size:,} bytes but "
                f"{what} {r.total_bytes:,}; the index and the checkpoint disagree")


def _by_family(c: Counter) -> dict[str, int]:
    order = list(layout.FAMILIES) + sorted(set(c) - set(layout.FAMILIES))
    return {f: int(c[f]) for f in order if c.get(f)}


def _human(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return f"{n:,.2f} TB"


def _listing(title: str, items: list[str], limit: int = 10) -> list[str]:
    if not items:
        return []
    out = [f"{title} ({len(items):,}):"] + [f"  {x}" for x in items[:limit]]
    if len(items) > limit:
        out.append(f"  ... and {len(items) - limit:,} more (--json lists all)")
    return out


def format_table(r: AuditReport, top: int = 5) -> str:
    """A human summary: families, shards (the ``top`` largest when there are many),
    coverage, findings and which checks ran or were skipped."""
    lines = [f"k3dist audit of {r.source}",
             f"  config {r.config_path}",
             f"  index  {r.index_path}  sha256 {r.index_sha256[:16]}",
             "",
             f"{'family':<16}{'tensors':>10}{'implied':>10}{'bytes (implied)':>22}"]
    fams = list(_by_family(Counter({**r.expected_counts, **r.counts})))
    for fam in fams:
        lines.append(f"{fam:<16}{r.counts.get(fam, 0):>10,}{r.expected_counts.get(fam, 0):>10,}"
                     f"{r.family_bytes.get(fam, 0):>22,}")
    if r.unexpected:
        lines.append(f"{'(not implied)':<16}{len(r.unexpected):>10,}{0:>10,}{'?':>22}")
    lines.append(f"{'total':<16}{r.tensors:>10,}{r.expected_tensors:>10,}"
                 f"{sum(r.family_bytes.values()):>22,}")
    lines.append(f"routed expert packed weights: {r.expert_packed:,}")
    lines.append("")

    src = ("tensor bytes from the shard headers" if r.bytes_from == "headers"
           else "bytes config.json implies for the tensors the index places there")
    lines.append(f"shards: {len(r.shard_tensors)} ({src})")
    names = list(r.shard_tensors)
    if len(names) > 2 * top:
        shown = sorted(r.shard_bytes, key=r.shard_bytes.__getitem__, reverse=True)[:top]
        shown = sorted(set(shown) | set(r.shard_errors))
    else:
        shown = names
    width = max([len(n) for n in names] + [5])
    for n in shown:
        size = (f"{r.shard_bytes[n]:>22,}" if n in r.shard_bytes else f"{'UNREADABLE':>22}")
        lines.append(f"  {n:<{width}}{r.shard_tensors[n]:>9,} tensors{size}")
    if len(shown) < len(names):
        lines.append(f"  ... {len(names) - len(shown)} more shards (the {top} largest shown)")
    size_note = ""
    if r.index_total_size is not None:
        same = "=" if r.index_total_size == r.total_bytes else "!="
        size_note = f"  {same} index total_size {r.index_total_size:,}"
    lines.append(f"  {'total':<{width}}{r.tensors:>9,} tensors{r.total_bytes:>22,}"
                 f"  ({_human(r.total_bytes)}){size_note}")
    lines.append("")

    if not r.missing and not r.unexpected:
        lines.append("coverage: complete (every key config.json implies is in the index, "
                     "and nothing else)")
    else:
        lines.append(f"coverage: {len(r.missing):,} missing, {len(r.unexpected):,} unexpected")
    lines += _listing("missing keys", r.missing)
    lines += _listing("unexpected keys", r.unexpected)
    lines += _listing("unreadable shards", [f"{f}: {m}" for f, m in r.shard_errors.items()])
    lines += _listing("index vs shard headers", r.index_errors)
    lines += _listing("dtype/shape mismatches", r.mismatches)
    if r.a_log:
        bad = r.a_log_failures
        lines.append(f"A_log padding: {len(r.a_log)} KDA layers checked, "
                     + (f"{len(bad)} with a non-zero tail" if bad else "every tail is zero"))
        lines += _listing("A_log failures", [f"layer {k}: {v}" for k, v in bad.items()])
    lines += _listing("other", r.errors)
    lines.append("")
    lines.append("checks run: " + ", ".join(r.checks_run))
    for check, why in r.checks_skipped.items():
        lines.append(f"skipped: {check} ({why})")
    verdict = "OK" if r.ok else f"FAILED: {r.findings:,} findings"
    lines.append(f"result: {verdict}  [{r.seconds:.2f} s]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m k3dist.build.checkpoint",
        description="Moonshot-format K3 checkpoints, read through their headers.")
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "audit", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="tensor counts, bytes, key coverage, dtypes/shapes, A_log padding",
        description=(
            "Audit a checkpoint from its index and shard headers (no tensor data is read\n"
            "except each KDA layer's A_log padding tail): tensor counts and bytes by family,\n"
            "bytes per shard, coverage against the keys config.json implies, dtypes and\n"
            "shapes, A_log tails. With only a config and an index (no shard files), names,\n"
            "counts, coverage and total_size are checked and the header checks are listed\n"
            "as skipped."),
        epilog=(
            "examples:\n"
            "  python -m k3dist.build.checkpoint audit mini-src\n"
            "  python -m k3dist.build.checkpoint audit --json \\\n"
            "      --config k3dist/data/kimi-k3-config.json \\\n"
            "      --index k3dist/data/kimi-k3-model.safetensors.index.json.gz\n\n"
            "exit status: 0 ok, 1 findings (all are printed), 2 nothing to audit"))
    a.add_argument("src", nargs="?", help="checkpoint folder (config.json, "
                   f"{INDEX_NAME} or model.safetensors, shard files)")
    a.add_argument("--config", help="config JSON file, may be gzipped (.gz); "
                   "default SRC/config.json")
    a.add_argument("--index", help=f"index JSON file, may be gzipped (.gz); default "
                   f"SRC/{INDEX_NAME}. Shards are looked for in SRC, else beside the index")
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if args.src is None and (args.config is None or args.index is None):
        a.error("give a checkpoint folder SRC, or both --config and --index")
    if args.src and args.config is None and args.index is None:
        from k3dist.build import mlxbuild

        if (Path(args.src) / "config.json").exists() and mlxbuild.is_mlx_build(args.src):
            # an MLX build (ours or published): its own audit (k3dist.build.mlxbuild)
            return mlxbuild.main([args.src, *(["--json"] if args.json else [])])
    try:
        report = audit(args.src, config=args.config, index=args.index)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(to_json(report) if args.json else format_table(report))
    if not report.ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
