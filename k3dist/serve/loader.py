"""A rank folder -> the expert-parallel model on this rank, with checks.

Order (mlx-lm's ``sharded_load`` pattern): local checks (the folder is a rank
folder for this rank and group size, its placement is whole, every expert stack
it must hold is there with the right shape); a handshake across ranks (the first
collective) that refuses folders from different builds or placements; then a lazy
load through mlx-lm's ``load_model`` with our model class, the shared-expert
split, evaluation layer by layer, and a barrier.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3dist.format import layout, manifest
from k3dist.format.placement import Placement
from k3dist.format.sfile import CheckpointError, read_header
from k3dist.serve.config import DTYPES as DTYPE_NAMES
from k3dist.serve.model import make_model_class, resolve_form

import mlx.core as mx
import numpy as np
from mlx_lm.models import kimi_k3
from mlx_lm.utils import load_model

DTYPES = {name: getattr(mx, name) for name in DTYPE_NAMES}
PROJS = ("gate_proj", "up_proj", "down_proj")


class RankMismatch(CheckpointError):
    pass


def check_rank_folder(folder: str | Path, rank: int, size: int) -> tuple[dict, Placement]:
    """Everything that can be checked without talking to the other ranks."""
    folder = Path(folder)
    m = manifest.verify(folder, "rank")  # kind, every file's size
    if m["size"] != size:
        raise RankMismatch(f"{folder}: sliced for {m['size']} ranks but the group has {size}; "
                           f"launch with -n {m['size']} or slice again with --size {size}")
    if m["rank"] != rank:
        raise RankMismatch(f"{folder}: holds rank {m['rank']}'s experts but this process is "
                           f"rank {rank} of {size}; give each rank its own folder "
                           "(rank_dir with {rank})")
    placement = Placement.from_json(m["placement"])
    if placement.size != size:
        raise RankMismatch(f"{folder}: placement is for {placement.size} ranks, group has {size}")
    config = json.loads((folder / "config.json").read_text())
    tc = layout.text_config(config)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    headers: dict = {}
    for layer in range(tc["num_hidden_layers"]):
        if not layout.is_moe_layer(tc, layer):
            continue
        if layer not in placement.owners:
            raise CheckpointError(f"{folder}: placement has no owners for MoE layer {layer}")
        n_local = len(placement.experts_of(layer, rank))
        for proj in PROJS:
            name = f"language_model.model.layers.{layer}.mlp.switch_mlp.{proj}.weight"
            fname = index.get(name)
            if fname is None:
                raise CheckpointError(f"{folder}: expert tensor {name!r} is missing from the "
                                      "index; the rank folder is incomplete, slice it again")
            if fname not in headers:
                headers[fname] = read_header(folder / fname)
            t = headers[fname].tensors.get(name)
            if t is None:
                raise CheckpointError(f"{folder / fname}: expert tensor {name!r} is missing; "
                                      "the rank folder is incomplete, slice it again")
            if t.shape[0] != n_local:
                raise CheckpointError(f"{folder / fname}: {name!r} stacks {t.shape[0]} experts "
                                      f"but the placement gives rank {rank} {n_local}")
    return m, placement


def _handshake(manifest: dict, group: mx.distributed.Group) -> None:
    """All ranks must run slices of one build with one placement."""
    mine = f"{manifest['build_hash']}:{manifest['placement_hash']}".encode()
    vec = mx.array(np.frombuffer(mine.ljust(64, b" ")[:64], dtype=np.uint8).astype(np.int32))
    every = np.array(mx.distributed.all_gather(vec[None], group=group)).astype(np.uint8)
    # A peer that died mid-collective leaves garbage here rather than an error.
    seen = [bytes(row).decode(errors="replace").strip() for row in every]
    if len(set(seen)) > 1:
        desc = ", ".join(f"rank {r}: build {s.split(':')[0]} placement {s.split(':')[1]}"
                         for r, s in enumerate(seen))
        raise RankMismatch(f"rank folders come from different builds or placements ({desc}); "
                           "slice every rank from the same build with the same placement")


def load_rank(folder: str | Path, group: mx.distributed.Group | None = None,
              dtype: str = "float32", form: str = "auto"):
    """Load this rank's folder as an expert-parallel K3; returns (model, config, manifest)."""
    group = group or mx.distributed.init()
    rank, size = group.rank(), group.size()
    manifest, placement = check_rank_folder(folder, rank, size)
    if size > 1:  # before minutes of loading: refuse mismatched folders now
        _handshake(manifest, group)
    cls = make_model_class(placement, rank, group, resolve_form(form))
    model, config = load_model(Path(folder), lazy=True, strict=True,
                               get_model_classes=lambda config: (cls, kimi_k3.ModelArgs))
    model.shard_shared_experts()
    if dtype != "bfloat16":
        model.set_dtype(DTYPES[dtype])
    # Layer by layer, so transient full-size tensors (the shared experts before their
    # split) never pile up.
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    if size > 1:
        mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group))  # barrier: all loaded
    return model, config, manifest
