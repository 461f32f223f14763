"""A rank folder -> the expert-parallel model on this rank, with checks.

Order (mlx-lm's ``sharded_load`` pattern): local checks (the folder is a rank
folder for this rank and group size, its placement is whole, every expert stack
it must hold is there with the right shape); a handshake across ranks (the first
collective) that refuses folders from different builds or placements; then a lazy
load through mlx-lm's ``load_model`` with our model class, the shared-expert
split, evaluation layer by layer, and a barrier.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from k3dist.format import graded, layout, manifest
from k3dist.format import manifest as mf
from k3dist.format.folder import load_config, weight_map
from k3dist.format.placement import Placement
from k3dist.format.sfile import COMPUTE_DTYPES, CheckpointError, mx_dtype, read_header
from k3dist.format.verify import verify_folder
from k3dist.model import two_bank
from k3dist.model.ep import make_model_class
from k3dist.model.forms import resolve_form

import mlx.core as mx
import numpy as np
from mlx_lm.models import kimi_k3
from mlx_lm.utils import load_model

if TYPE_CHECKING:
    from k3dist.config.deployment import Deployment

DTYPES = {name: mx_dtype(name) for name in COMPUTE_DTYPES}


class RankMismatch(CheckpointError):
    pass


class PeerFailed(RuntimeError):
    """Another rank failed before the handshake; the message names it and, when its
    watchdog sent one, its reason."""


# A handshake row: "build_hash:placement_hash". A rank that died before (or during)
# the all_gather leaves zeros or garbage in its row instead.
_ROW = re.compile(r"[0-9A-Za-z_.-]+:[0-9A-Za-z_.-]+")


def _peer_failed(
    ranks: list[int],
    why: str,
    peer_failure: Callable[[int], str | None] | None,
    wait_s: float = 1.0,
) -> PeerFailed:
    """The error for a rank (one of ``ranks``) that failed during start-up, with its
    own reason if its watchdog's FAIL arrives within ``wait_s`` (a failing rank sends
    it before it exits)."""
    deadline = time.monotonic() + wait_s
    while peer_failure is not None:
        known = [(r, peer_failure(r)) for r in ranks if peer_failure(r) is not None]
        if known:
            r, reason = known[0]
            return PeerFailed(f"rank {r} failed during start-up: {reason} ({why})")
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"one of ranks {ranks}"
    return PeerFailed(
        f"{who} failed during start-up: no reason received; its own error is in its log ({why})"
    )


def check_attention(folder: Path, m: dict, attention: str | None) -> None:
    """A folder is sliced for one attention mode (``split`` or ``replicated``); a
    deployment asking for the other is refused with the fix."""
    if attention is None:
        return
    if attention not in layout.ATTENTION_MODES:
        raise ValueError(f"attention must be one of {layout.ATTENTION_MODES}, not {attention!r}")
    want = "replicated" if m["size"] <= 1 else attention
    have = manifest.attention_of(m)["mode"]
    if have != want:
        raise RankMismatch(
            f"{folder}: sliced with attention {have} but the deployment asks "
            f"for {want}; slice again with --attention {want} (python "
            f"slicing/rank_split.py) or deploy with attention: {have}"
        )


def check_boxes(folder: Path, placement: Placement, boxes: list[float] | None) -> None:
    """A deployment naming its boxes serves only folders placed for those boxes (the
    folder's placement records them); one placed otherwise is refused with the fix."""
    if boxes is None:
        return
    have = placement.shares if placement.kind.startswith("by-memory") else None
    if have is None or [float(b) for b in boxes] != list(have):
        shown = ",".join(f"{b:g}" for b in boxes)
        raise RankMismatch(
            f"{folder}: its experts are placed {placement.describe()}, not by memory for "
            f"boxes {shown} as the deployment names them; slice again with --boxes "
            f"{shown} (python slicing/rank_split.py --all --boxes {shown}), or deploy "
            "with the boxes it was sliced for"
        )


def check_rank_folder(
    folder: str | Path,
    rank: int,
    size: int,
    verify: str = "stamp",
    attention: str | None = None,
    boxes: list[float] | None = None,
) -> tuple[dict, Placement]:
    """Everything that can be checked without talking to the other ranks; last, the
    content against the manifest (``k3dist.format.verify``; report in ``manifest["verify"]``).
    ``attention``: the mode the deployment asks for (None: whatever the folder holds);
    ``boxes``: the boxes it names (``check_boxes``; None: any placement)."""
    folder = Path(folder)
    m = manifest.verify(folder, "rank")  # kind, every file's size
    if m["size"] != size:
        raise RankMismatch(
            f"{folder}: sliced for {m['size']} ranks but the group has {size}; "
            f"launch with -n {m['size']} or slice again with --size {size}"
        )
    if m["rank"] != rank:
        raise RankMismatch(
            f"{folder}: holds rank {m['rank']}'s experts but this process is "
            f"rank {rank} of {size}; give each rank its own folder "
            "(rank_dir with {rank})"
        )
    check_attention(folder, m, attention)
    placement = Placement.from_json(m["placement"])
    if placement.size != size:
        raise RankMismatch(f"{folder}: placement is for {placement.size} ranks, group has {size}")
    check_boxes(folder, placement, boxes)
    config = load_config(folder)
    tc = layout.text_config(config)
    index = weight_map(folder)
    headers: dict = {}
    gmap = graded.GradedMap.from_config(config)  # a graded build: two stacks per layer
    for layer in range(tc["num_hidden_layers"]):
        if not layout.is_moe_layer(tc, layer):
            continue
        if layer not in placement.owners:
            raise CheckpointError(f"{folder}: placement has no owners for MoE layer {layer}")
        banks = graded.bank_names(gmap, layer)
        for bank, proj in [(b, p) for b in banks for p in layout.MLP_PROJS]:
            name = f"language_model.model.layers.{layer}.mlp.{bank}.{proj}.weight"
            n_local = len(graded.local_rows(gmap, name, placement.num_experts, placement, rank))
            fname = index.get(name)
            if fname is None:
                raise CheckpointError(
                    f"{folder}: expert tensor {name!r} is missing from the "
                    "index; the rank folder is incomplete, slice it again"
                )
            if fname not in headers:
                headers[fname] = read_header(folder / fname)
            t = headers[fname].tensors.get(name)
            if t is None:
                raise CheckpointError(
                    f"{folder / fname}: expert tensor {name!r} is missing; "
                    "the rank folder is incomplete, slice it again"
                )
            if t.shape[0] != n_local:
                raise CheckpointError(
                    f"{folder / fname}: {name!r} stacks {t.shape[0]} experts "
                    f"but the placement gives rank {rank} {n_local}"
                )
    m["verify"] = verify_folder(folder, m, verify).to_json()
    return m, placement


def _handshake(
    manifest: dict,
    group: mx.distributed.Group,
    peer_failure: Callable[[int], str | None] | None = None,
) -> None:
    """All ranks must run slices of one build with one placement. ``peer_failure``
    (rank -> the reason it failed, if known: the watchdog's) names why a peer that
    died before the handshake did."""
    mode = mf.attention_of(manifest)["mode"]
    mine = f"{manifest['build_hash']}:{manifest['placement_hash']}-{mode}".encode()
    vec = mx.array(np.frombuffer(mine.ljust(64, b" ")[:64], dtype=np.uint8).astype(np.int32))
    try:
        every = np.array(mx.distributed.all_gather(vec[None], group=group)).astype(np.uint8)
    except RuntimeError as e:  # the ring saw a peer go
        peers = [r for r in range(group.size()) if r != group.rank()]
        raise _peer_failed(peers, f"the handshake failed: {e}", peer_failure) from None
    # A peer that died mid-collective leaves garbage here rather than an error.
    seen = [bytes(row).decode(errors="replace").strip() for row in every]
    for r, s in enumerate(seen):
        if not _ROW.fullmatch(s):
            raise _peer_failed(
                [r],
                "what it sent in the handshake is not a build:placement "
                "pair: the ring returned garbage for a peer that is gone",
                peer_failure,
            )
    if len(set(seen)) > 1:
        desc = ", ".join(
            f"rank {r}: build {s.split(':')[0]} placement-attention {s.split(':')[1]}"
            for r, s in enumerate(seen)
        )
        raise RankMismatch(
            f"rank folders come from different builds or placements or "
            f"attention modes ({desc}); slice every rank from the same build "
            "with the same placement and --attention"
        )


def load_rank(
    folder: str | Path,
    group: mx.distributed.Group | None = None,
    dtype: str = "float32",
    form: str = "auto",
    verify: str = "stamp",
    peer_failure: Callable[[int], str | None] | None = None,
    attention: str | None = None,
    boxes: list[float] | None = None,
):
    """Load this rank's folder as an expert-parallel K3; returns (model, config, manifest).
    ``peer_failure``: see ``_handshake``; ``attention``: the mode the deployment asks
    for (``check_attention``; None: the folder's); ``boxes``: the deployment's
    (``check_boxes``)."""
    group = group or mx.distributed.init()
    rank, size = group.rank(), group.size()
    manifest, placement = check_rank_folder(folder, rank, size, verify, attention, boxes)
    if size > 1:  # before minutes of loading: refuse mismatched folders now
        _handshake(manifest, group, peer_failure)
    gmap = graded.GradedMap.from_config(load_config(folder))
    split = mf.attention_of(manifest)["split_layers"]
    cls = (
        make_model_class(placement, rank, group, resolve_form(form), split)
        if gmap is None
        else two_bank.make_model_class(placement, rank, group, resolve_form(form), gmap, split)
    )
    try:
        model, config = load_model(
            Path(folder),
            lazy=True,
            strict=True,
            get_model_classes=lambda config: (cls, kimi_k3.ModelArgs),
        )
    except ValueError as e:
        if "shape" not in str(e):
            raise
        raise CheckpointError(
            f"{folder}: its tensors do not fit the model built for attention "
            f"split over layers {split} on {size} ranks ({e}); slice the "
            "folder again"
        ) from None
    if dtype != "bfloat16":
        model.set_dtype(DTYPES[dtype])
    # Layer by layer, so transient full-size tensors (the shared experts before their
    # split in load_weights) never pile up.
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    if size > 1:
        mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group))  # barrier: all loaded
    return model, config, manifest


def load_deployed(
    dep: Deployment,
    group: mx.distributed.Group,
    folder: str | Path | None = None,
    peer_failure: Callable[[int], str | None] | None = None,
):
    """``load_rank`` as the deployment says: its dtype, MoE form, verify mode, attention
    and boxes; ``folder`` defaults to this rank's (``dep.rank_path``)."""
    folder = dep.rank_path(group.rank()) if folder is None else folder
    checks = {"peer_failure": peer_failure, "attention": dep.attention, "boxes": dep.box_gib}
    return load_rank(folder, group, dep.dtype, dep.moe_form, dep.verify, **checks)


def load_tokenizer(folder: str | Path):
    """mlx-lm's tokenizer of ``folder``, given its config: without one, transformers'
    AutoTokenizer fails to map ``kimi_k3`` to a config class, falls back to the base
    class and warns on every rank ("You are using a model of type `kimi_k3` to
    instantiate a model of type ``"); the tokenizer it makes is the same."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer
    from transformers import PretrainedConfig

    config = PretrainedConfig.from_dict(PretrainedConfig.get_config_dict(str(folder))[0])
    return mlx_load_tokenizer(folder, {"trust_remote_code": False, "config": config})
