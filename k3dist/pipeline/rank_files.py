"""What a rank folder holds and how its files are made: its identity and manifest, the
placement check, which experts a rank owns (``vision_ranks``, ``placement_for``), and the
byte ranges of a stacked expert tensor each rank reads (``split_reads``, ``id_runs``).
``k3dist.pipeline.slicing`` writes rank folders with them."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from k3dist import __version__
from k3dist.format import graded, layout, manifest, verify
from k3dist.format.folder import INDEX_NAME, load_config, weight_map
from k3dist.format.journal import JournaledFolder
from k3dist.format.placement import (
    Placement,
    PlacementError,
    by_memory,
    for_config,
    from_counts,
    split_by_memory,
)
from k3dist.format.sfile import (
    CHUNK_BYTES,
    CheckpointError,
    Header,
    TensorInfo,
    read_header,
    sha256_file,
)

import numpy as np

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
    in proportion to each rank's experts (``graded.balance_hi``: counts unchanged)."""
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


def plan_placement(plan: dict, num_experts: int, gmap: graded.GradedMap | None) -> Placement | None:
    """The placement a plan made for boxes of different memory (``plan --boxes``): its
    experts per layer per rank as contiguous ranges, by memory for the boxes it names
    (what the loader checks a deployment's ``boxes`` against), the build's promoted
    experts (``gmap``) spread in proportion (``graded.balance_hi``). None for a plan of
    equal boxes (then ``placement_for``'s)."""
    if "experts_per_layer_per_rank" not in plan:
        return None
    counts = {int(k): list(v) for k, v in plan["experts_per_layer_per_rank"].items()}
    shares = tuple(float(b["memory_gib"]) for b in plan["boxes"])
    plc = from_counts(num_experts, counts, "by-memory", shares)
    return plc if gmap is None else graded.balance_hi(plc, gmap)


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
        elif is_vision(n):
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


def is_vision(name: str) -> bool:
    return name.startswith(layout.VISION_PREFIXES)


def rank_identity(
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


def describe_identity(ident: dict) -> str:
    return (
        f"rank {ident.get('rank')} of {ident.get('size')} of build "
        f"{ident.get('build_hash')} (placement {ident.get('placement_hash')})"
    )


def copy_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def stacked_expert_bytes(header: Header) -> int:
    return sum(t.nbytes for n, t in header.tensors.items() if stacked_layer(n) is not None)


def id_runs(ids: list[int], per: int) -> list[tuple[int, int]]:
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


def split_reads(
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
        reads = [
            (a * inner + s, n, None) for a, b in spans for s, n in id_runs([0], (b - a) * inner)
        ]
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


def rank_journal(out: Path, ident: dict, source_kind: str) -> JournaledFolder:
    return JournaledFolder(
        out,
        "rank",
        ident,
        source=source_kind,
        describe=describe_identity,
        hint=" (e.g. one with {rank})",
    )


def write_manifest(
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
        "expert_bytes": sum(stacked_expert_bytes(read_header(out / n)) for n in safetensors),
        # layers whose attention heads (and dense MLP) this rank holds a part of
        "attention": {"mode": ident["attention"], "split_layers": sorted(split or [])},
        "files": files,
        "seconds": round(seconds, 2),
    }
    folder.finish(manifest)
    verify.stamp_folder(out, manifest)  # hashed while written: the first start hashes nothing
    return manifest


def check_placement(
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
            f"placement covers MoE layers {short_list(placement.owners)} but {where} has expert "
            f"stacks for {short_list(layers)} (missing {short_list(missing)}, extra "
            f"{short_list(extra)}); "
            "make the placement from this model's config"
        )


def short_list(xs, n: int = 8) -> str:
    xs = sorted(xs)
    return str(xs) if len(xs) <= n else f"{str(xs[:n])[:-1]}, ... ({len(xs)} in all)]"
