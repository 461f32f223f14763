"""The audit of a Moonshot-format K3 checkpoint through its index and shard headers:
tensor counts and bytes by family, bytes per shard, key coverage against what
``config.json`` implies, dtypes and shapes, ``A_log`` padding tails, ``total_size``.

Findings are collected, not raised, so one run names every problem. The printed table
and the command (``python -m k3dist.pipeline.checkpoint audit``) are
``k3dist.pipeline.checkpoint``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import struct
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3dist.format import layout
from k3dist.format.sfile import MAX_HEADER, CheckpointError, Header, TensorInfo
from k3dist.format.source import Source, check_a_log_tail, check_spec, open_source

HEADER_CHECKS = ("shard_headers", "index_vs_headers", "dtypes_shapes", "a_log_padding")
NO_SHARDS = "no shard files: header-only checks skipped"


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
            leaves = [(s.name[len(stem) + 2 :], s) for s in first]  # after "0."
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
    a_log = {
        s.layer: s.name for s in by_id.values() if s.family == "kda" and s.name.endswith(".A_log")
    }
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
        return (
            len(self.missing)
            + len(self.unexpected)
            + len(self.mismatches)
            + len(self.index_errors)
            + len(self.shard_errors)
            + len(self.a_log_failures)
            + len(self.errors)
        )

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


def audit(
    src: str | Path | Source | None = None,
    *,
    config: str | Path | None = None,
    index: str | Path | None = None,
) -> AuditReport:
    """Audit a checkpoint through its index and shard headers (no tensor data but
    the ``A_log`` tails). Raises ``CheckpointError`` only when there is nothing to
    audit (no readable config or index); everything else becomes a finding."""
    t0 = time.perf_counter()
    with _gc_paused():
        report = _audit(
            src if isinstance(src, Source) else open_source(src, config=config, index=index)
        )
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
        config_path=str(source.config_path),
        index_path=str(source.index_path),
        index_sha256=source.index_sha256,
        tensors=len(wm),
        expected_tensors=len(specs),
        counts=by_family(counts),
        expected_counts=by_family(imp.counts),
        family_bytes=by_family(family_bytes),
        expert_packed=expert_packed,
        bytes_from="specs",
        shard_tensors={f: len(v) for f, v in by_shard.items()},
        shard_bytes=implied_shard,
        total_bytes=sum(implied_shard.values()),
        index_total_size=_total_size(source.index_metadata),
        missing=missing,
        unexpected=unexpected,
        checks_run=["coverage"],
    )

    if any((source.path / f).exists() for f in by_shard):
        _audit_headers(source, imp, by_shard, report)
    else:
        report.checks_skipped.update({c: NO_SHARDS for c in HEADER_CHECKS})
    _check_total_size(report)
    return report


def _audit_headers(
    source: Source, imp: _Implied, by_shard: dict[str, list[str]], r: AuditReport
) -> None:
    r.checks_run += list(HEADER_CHECKS)
    r.bytes_from = "headers"
    r.shard_bytes = {}
    expect = {
        i: (s.dtype, list(s.shape), s.nbytes) for i, s in imp.by_id.items() if s.shape is not None
    }
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
                return TensorInfo(
                    name, e["dtype"], tuple(e["shape"]), data_offset + b, data_offset + end, path
                )
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


def _certify_shard(
    path: Path,
    names: list[str],
    specs: dict[str, layout.TensorSpec],
    expect: dict[int, tuple[str, list[int], int]],
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
        for name, x in zip(names, map(expect.get, map(id, map(specs.get, names))), strict=True):
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


def _check_header(
    source: Source,
    header: Header,
    names: list[str],
    specs: dict[str, layout.TensorSpec],
    r: AuditReport,
) -> None:
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
        for n in tensors
        if n not in listed
    ]


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
            "sizes are unknown without shard headers"
        )
    else:
        r.checks_run.append("total_size")
        if r.total_bytes != r.index_total_size:
            what = (
                "the shard headers hold"
                if r.bytes_from == "headers"
                else "config.json implies for the index's tensors"
            )
            r.errors.append(
                f"{r.index_path}: metadata.total_size is {r.index_total_size:,} bytes but "
                f"{what} {r.total_bytes:,}; the index and the checkpoint disagree"
            )


def by_family(c: Counter) -> dict[str, int]:
    order = list(layout.FAMILIES) + sorted(set(c) - set(layout.FAMILIES))
    return {f: int(c[f]) for f in order if c.get(f)}
