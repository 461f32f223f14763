"""Which rank owns which routed expert, per MoE layer.

A placement is a map, not a renumbering: the router and the checkpoint keep global
expert ids; each rank stacks the experts it owns in ascending global order (its
local indices). Default: contiguous equal ranges. Load-aware: from per-expert
routing counts, balance the load each rank carries per token, which is what a
decode step waits for (the slowest rank), keeping expert counts equal per rank so
memory stays balanced.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class Placement:
    size: int
    num_experts: int
    # layer index (0-based, MoE layers only) -> owner rank of each global expert
    owners: dict[int, tuple[int, ...]]
    kind: str = "contiguous"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.size < 1:
            raise PlacementError(f"placement size must be >= 1, not {self.size}")
        for layer, own in self.owners.items():
            if len(own) != self.num_experts:
                raise PlacementError(
                    f"placement layer {layer}: {len(own)} owners for {self.num_experts} "
                    "experts; every expert needs exactly one owner"
                )
            bad = [e for e, r in enumerate(own) if not 0 <= r < self.size]
            if bad:
                raise PlacementError(
                    f"placement layer {layer}: experts {bad[:5]} have owners outside "
                    f"0..{self.size - 1}"
                )
            counts = np.bincount(np.asarray(own), minlength=self.size)
            if (counts == 0).any():
                raise PlacementError(
                    f"placement layer {layer}: ranks {np.flatnonzero(counts == 0).tolist()} "
                    "own no expert; every rank needs at least one"
                )

    def experts_of(self, layer: int, rank: int) -> list[int]:
        """Global ids owned by ``rank`` in ``layer``, in local order."""
        return [e for e, r in enumerate(self.owners[layer]) if r == rank]

    def local_table(self, layer: int, rank: int) -> np.ndarray:
        """global id -> local index on ``rank``, -1 where another rank owns it."""
        table = np.full(self.num_experts, -1, dtype=np.int32)
        mine = self.experts_of(layer, rank)
        table[mine] = np.arange(len(mine), dtype=np.int32)
        return table

    def to_json(self) -> dict:
        return {
            "size": self.size,
            "num_experts": self.num_experts,
            "kind": self.kind,
            "owners": {str(k): list(v) for k, v in sorted(self.owners.items())},
        }

    @classmethod
    def from_json(cls, d: dict) -> Placement:
        try:
            owners = {int(k): tuple(int(r) for r in v) for k, v in d["owners"].items()}
            return cls(int(d["size"]), int(d["num_experts"]), owners, d.get("kind", "custom"))
        except (KeyError, TypeError, ValueError) as e:
            raise PlacementError(f"malformed placement JSON ({e!r})") from None

    @property
    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def expected_max_load(self, layer: int, selections: np.ndarray) -> float:
        """Mean over tokens of the largest number of (token, expert) pairs any rank
        computes: the per-token critical path. ``selections``: [tokens, top_k] ids."""
        owner = np.asarray(self.owners[layer])[selections]
        per_rank = np.stack([(owner == r).sum(-1) for r in range(self.size)], -1)
        return float(per_rank.max(-1).mean())


def contiguous(num_experts: int, size: int, moe_layers: list[int]) -> Placement:
    if num_experts % size:
        raise PlacementError(
            f"{num_experts} experts do not split into {size} equal "
            "contiguous ranges; use a load-aware placement or another size"
        )
    per = num_experts // size
    own = tuple(e // per for e in range(num_experts))
    return Placement(size, num_experts, {layer: own for layer in moe_layers}, "contiguous")


def load_aware(counts: dict[int, np.ndarray], size: int) -> Placement:
    """Greedy longest-processing-time: heaviest expert first, to the least-loaded
    rank that still has room (equal expert counts per rank)."""
    num_experts = len(next(iter(counts.values())))
    if num_experts % size:
        raise PlacementError(f"{num_experts} experts do not split evenly over {size} ranks")
    cap = num_experts // size
    owners = {}
    for layer, c in counts.items():
        c = np.asarray(c, dtype=np.float64)
        if c.shape != (num_experts,) or (c < 0).any():
            raise PlacementError(
                f"routing counts for layer {layer}: need {num_experts} "
                f"non-negative values, got shape {c.shape}"
            )
        load = np.zeros(size)
        room = np.full(size, cap)
        own = np.empty(num_experts, dtype=np.int64)
        for e in np.argsort(-c, kind="stable"):
            r = int(np.argmin(np.where(room > 0, load, np.inf)))
            own[e] = r
            load[r] += c[e]
            room[r] -= 1
        owners[int(layer)] = tuple(int(r) for r in own)
    return Placement(size, num_experts, owners, "load-aware")


def read_counts(path: str | Path) -> dict[int, np.ndarray]:
    """Routing counts: ``.npz`` with one array per MoE layer named ``layer_L``, or a
    JSON ``{"layers": {"L": [count per expert, ...]}}``."""
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path) as z:
            out = {}
            for k in z.files:
                if not k.startswith("layer_"):
                    raise PlacementError(f"{path}: array {k!r} is not named layer_<L>")
                out[int(k[len("layer_") :])] = z[k]
            return out
    d = json.loads(path.read_text())
    return {int(k): np.asarray(v) for k, v in d["layers"].items()}


def for_config(text_config: dict, size: int, counts_path: str | Path | None = None) -> Placement:
    """The placement a deployment uses: load-aware when counts are given."""
    from k3dist.format import layout

    moe = layout.moe_layers(text_config)
    if counts_path is None:
        return contiguous(text_config["num_experts"], size, moe)
    counts = read_counts(counts_path)
    missing = sorted(set(moe) - set(counts))
    if missing:
        raise PlacementError(f"{counts_path}: no routing counts for MoE layers {missing[:5]}")
    return load_aware({i: counts[i] for i in moe}, size)
