"""Which rank owns which routed expert, per MoE layer.

A placement is a map, not a renumbering: the router and the checkpoint keep global
expert ids; each rank stacks the experts it owns in ascending global order (its
local indices). Default: contiguous equal ranges. Load-aware: from per-expert
routing counts, balance the load each rank carries per token, which is what a
decode step waits for (the slowest rank), keeping expert counts equal per rank so
memory stays balanced (or at the counts a by-memory split gives each rank).

Uneven counts: expert parallelism, unlike tensor parallelism, needs no equal shares.
:func:`by_shares` gives each rank a number of experts per layer in proportion to a
weight (a size that does not divide the expert count: equal weights, counts within
one); :func:`split_by_memory` / :func:`by_memory` give each box experts in proportion
to what its memory has left after the non-expert bytes its rank holds (a 512 GB and
two 256 GB boxes: about 2:1:1). Counts that cannot be exact rotate their remainder
over the layers, so each rank's total over all layers is within one expert's bytes of
its share.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# How a rank handles the (token, expert) pairs it does not own (k3dist.model.experts);
# the deployment's ``moe_form`` is "auto" or one of these. Here, below the model and the
# config layer, so both read the one definition.
MOE_FORMS = ("placeholder", "local", "phased")
# How long a rank keeps trying to join the group its experts are placed over
# (k3dist.model.group.join; the deployment's ring_connect_s default).
RING_CONNECT_S = 120.0


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class Placement:
    size: int
    num_experts: int
    # layer index (0-based, MoE layers only) -> owner rank of each global expert
    owners: dict[int, tuple[int, ...]]
    kind: str = "contiguous"
    # the weights a by-shares / by-memory placement was made for (e.g. each box's GiB),
    # in rank order; None for the others (and then absent from the JSON and its hash)
    shares: tuple[float, ...] | None = None

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

    def counts(self, layer: int) -> list[int]:
        """Experts each rank owns in ``layer``."""
        return np.bincount(np.asarray(self.owners[layer]), minlength=self.size).tolist()

    def describe(self) -> str:
        """Kind, shares and experts per rank (a range where they vary over layers)."""
        per = np.array([self.counts(layer) for layer in sorted(self.owners)]).reshape(-1, self.size)
        counts = [
            str(lo) if lo == hi else f"{lo}-{hi}"
            for lo, hi in zip(per.min(0).tolist(), per.max(0).tolist(), strict=True)
        ]
        shares = "" if self.shares is None else f" for shares {_fmt(self.shares)}"
        return f"{self.kind}{shares}, experts per layer per rank {':'.join(counts)}"

    def to_json(self) -> dict:
        d = {
            "size": self.size,
            "num_experts": self.num_experts,
            "kind": self.kind,
            "owners": {str(k): list(v) for k, v in sorted(self.owners.items())},
        }
        if self.shares is not None:
            d["shares"] = list(self.shares)
        return d

    @classmethod
    def from_json(cls, d: dict) -> Placement:
        try:
            owners = {int(k): tuple(int(r) for r in v) for k, v in d["owners"].items()}
            shares = d.get("shares")
            return cls(
                int(d["size"]),
                int(d["num_experts"]),
                owners,
                d.get("kind", "custom"),
                None if shares is None else tuple(float(x) for x in shares),
            )
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


def _size(n: int) -> str:
    """Bytes in words: GB (1e9) with two decimals, exact bytes below 0.1 GB."""
    return f"{n / 1e9:,.2f} GB" if abs(n) >= 1e8 else f"{int(n):,} bytes"


def _fmt(xs) -> str:
    return ":".join(f"{x:g}" for x in xs)


def contiguous(num_experts: int, size: int, moe_layers: list[int]) -> Placement:
    if num_experts % size:
        raise PlacementError(
            f"{num_experts} experts do not split into {size} equal "
            "contiguous ranges; use by_shares (counts within one of equal) or another size"
        )
    per = num_experts // size
    own = tuple(e // per for e in range(num_experts))
    return Placement(size, num_experts, {layer: own for layer in moe_layers}, "contiguous")


def load_aware(
    counts: dict[int, np.ndarray], size: int, capacity: Placement | None = None
) -> Placement:
    """Greedy longest-processing-time: heaviest expert first, to the least-loaded
    rank that still has room: equal expert counts per rank, or per layer the counts
    ``capacity`` gives each rank (a by-memory placement: the bigger box then takes the
    colder experts, so no rank carries more routes per token for holding more)."""
    num_experts = len(next(iter(counts.values())))
    if capacity is None and num_experts % size:
        raise PlacementError(
            f"{num_experts} experts do not split evenly over {size} ranks; give a "
            "capacity (by_shares or by_memory) for uneven counts"
        )
    if capacity is not None and (capacity.size, capacity.num_experts) != (size, num_experts):
        raise PlacementError(
            f"capacity placement is for {capacity.size} ranks x {capacity.num_experts} "
            f"experts, not {size} x {num_experts}"
        )
    owners = {}
    for layer, c in counts.items():
        c = np.asarray(c, dtype=np.float64)
        if c.shape != (num_experts,) or (c < 0).any():
            raise PlacementError(
                f"routing counts for layer {layer}: need {num_experts} "
                f"non-negative values, got shape {c.shape}"
            )
        load = np.zeros(size)
        room = (
            np.full(size, num_experts // size)
            if capacity is None
            else np.array(capacity.counts(int(layer)))
        )
        own = np.empty(num_experts, dtype=np.int64)
        for e in np.argsort(-c, kind="stable"):
            r = int(np.argmin(np.where(room > 0, load, np.inf)))
            own[e] = r
            load[r] += c[e]
            room[r] -= 1
        owners[int(layer)] = tuple(int(r) for r in own)
    if capacity is None:
        return Placement(size, num_experts, owners, "load-aware")
    return Placement(size, num_experts, owners, f"{capacity.kind}+load-aware", capacity.shares)


def apportion(
    num_experts: int,
    weights: list[float],
    layers: list[int],
    layer_bytes: dict[int, int] | None = None,
    room: list[int] | None = None,
) -> dict[int, list[int]]:
    """Experts per rank for each layer in proportion to ``weights``, at least one each.
    A layer's experts that proportion cannot place exactly go, one at a time, to the
    rank furthest below its share of the bytes placed so far (``layer_bytes``: one
    expert's bytes per layer; 1 each without), among those whose ``room`` (bytes) still
    holds one more."""
    size = len(weights)
    if num_experts < size:
        raise PlacementError(
            f"{num_experts} experts per layer cannot give each of {size} ranks one"
        )
    w = np.asarray(weights, dtype=np.float64)
    if (w <= 0).any() or not np.isfinite(w).all():
        raise PlacementError(f"shares must be positive numbers, not {_fmt(weights)}")
    w = w / w.sum()
    cap = np.full(size, np.inf) if room is None else np.asarray(room, dtype=np.float64)
    given = np.zeros(size)  # bytes placed on each rank so far
    target = np.zeros(size)  # bytes each rank's share of the layers so far would be
    out = {}
    for layer in layers:
        b = 1 if layer_bytes is None else int(layer_bytes[layer])
        n = np.maximum(np.floor(num_experts * w).astype(np.int64), 1)
        while n.sum() > num_experts:  # the minimum of one pushed past the total
            n[int(np.argmax(n))] -= 1
        target += num_experts * b * w
        for _ in range(num_experts - int(n.sum())):
            fits = given + (n + 1) * b <= cap
            if not fits.any():
                raise PlacementError(
                    f"layer {layer}: no rank has room for one more {b:,}-byte expert "
                    f"(room {[int(x) for x in cap]}, placed "
                    f"{[int(x) for x in given + n * b]})"
                )
            deficit = np.where(fits, target - (given + n * b), -np.inf)
            n[int(np.argmax(deficit))] += 1
        given += n * b
        out[int(layer)] = n.tolist()
    over = np.flatnonzero(given > cap)
    if over.size:
        raise PlacementError(
            f"ranks {over.tolist()} would hold {[int(given[r]) for r in over]} expert bytes, "
            f"more than their room {[int(cap[r]) for r in over]}"
        )
    return out


def hi_counts(promoted: int, counts: list[int]) -> list[int]:
    """How many of a layer's ``promoted`` (hi-bank) experts each rank holds: in
    proportion to the experts it holds (``counts``), largest remainder first (ties to
    the lower rank), never more than a rank holds. Equal counts: equal shares, the
    remainder on the first ranks. One rule for the planner (bytes per box) and the
    slicer (``graded.balance_hi``), so each box's hi bytes follow its share of the
    layer and no box reads a larger share of the bytes per token than it holds."""
    n = np.asarray(counts, dtype=np.int64)
    total = int(n.sum())
    if not 0 <= promoted <= total:
        raise PlacementError(f"{promoted} promoted experts for {total} experts in the layer")
    quota = promoted * n / total  # at most n: promoted <= total
    out = np.floor(quota).astype(np.int64)
    # the fractional parts sum to the experts left, each below 1: only ranks with a
    # fractional quota take one, and none goes past its count
    for r in np.argsort(-(quota - out), kind="stable")[: promoted - int(out.sum())]:
        out[r] += 1
    return out.tolist()


def from_counts(
    num_experts: int,
    counts: dict[int, list[int]],
    kind: str = "custom",
    shares: tuple[float, ...] | None = None,
) -> Placement:
    """Contiguous ranges of the given lengths per layer: rank 0 the lowest ids."""
    size = len(next(iter(counts.values())))
    owners = {}
    for layer, n in counts.items():
        if sum(n) != num_experts:
            raise PlacementError(f"layer {layer}: counts {n} do not add up to {num_experts}")
        owners[int(layer)] = tuple(r for r, k in enumerate(n) for _ in range(k))
    return Placement(size, num_experts, owners, kind, shares)


def by_shares(num_experts: int, shares: list[float], moe_layers: list[int]) -> Placement:
    """Contiguous ranges in proportion to ``shares`` (e.g. box memories 512:256:256,
    or equal shares for a size that does not divide the expert count: 16 experts over
    3 ranks are 6:5:5, 5:6:5, 5:5:6 over successive layers)."""
    counts = apportion(num_experts, list(shares), list(moe_layers))
    return from_counts(num_experts, counts, "by-shares", tuple(float(x) for x in shares))


@dataclass(frozen=True)
class MemorySplit:
    """What :func:`split_by_memory` decided, in bytes per rank (box order)."""

    budgets: tuple[int, ...]  # what each box gives the weights
    nonexpert: tuple[int, ...]  # what its rank holds besides routed experts
    counts: dict[int, list[int]]  # experts per rank, per MoE layer
    experts: tuple[int, ...]  # routed-expert bytes each rank holds

    @property
    def free(self) -> tuple[int, ...]:
        return tuple(
            b - n - e for b, n, e in zip(self.budgets, self.nonexpert, self.experts, strict=True)
        )

    def to_json(self) -> dict:
        return {
            "budgets": list(self.budgets),
            "nonexpert": list(self.nonexpert),
            "experts": list(self.experts),
            "free": list(self.free),
        }


def split_by_memory(
    budgets: list[int],
    nonexpert: list[int] | int,
    expert_bytes: dict[int, int] | int,
    num_experts: int,
    moe_layers: list[int],
) -> MemorySplit:
    """Each layer's routed experts split over boxes in proportion to what each box's
    ``budgets`` (bytes it gives the weights) leaves after ``nonexpert`` (bytes its rank
    holds besides routed experts: the replicated parts, its share of split attention,
    the vision tower on rank 0). ``expert_bytes``: one routed expert's bytes (per
    layer, or one number). Refuses, with the numbers, boxes that cannot hold it."""
    size = len(budgets)
    ne = [int(nonexpert)] * size if isinstance(nonexpert, int) else [int(x) for x in nonexpert]
    if len(ne) != size:
        raise PlacementError(f"{len(ne)} non-expert sizes for {size} boxes; give one per box")
    layers = list(moe_layers)
    eb = (
        {layer: int(expert_bytes) for layer in layers}
        if isinstance(expert_bytes, int)
        else {layer: int(expert_bytes[layer]) for layer in layers}
    )
    room = [int(b) - n for b, n in zip(budgets, ne, strict=True)]
    short = [r for r in range(size) if room[r] <= 0]
    if short:
        raise PlacementError(
            "boxes "
            + ", ".join(
                f"{r} ({_size(budgets[r])} for weights, non-experts {_size(ne[r])})" for r in short
            )
            + " have nothing left for routed experts; give them more memory or drop them"
        )
    need = num_experts * sum(eb.values())
    if need > sum(room):
        raise PlacementError(
            f"the routed experts need {_size(need)} but the {size} boxes leave "
            f"{_size(sum(room))} after their non-expert bytes (per box "
            f"{', '.join(_size(x) for x in room)}); {_size(need - sum(room))} short: add a "
            "box, more memory, or a smaller expert format"
        )
    counts = apportion(num_experts, room, layers, eb, room)
    experts = [sum(counts[layer][r] * eb[layer] for layer in layers) for r in range(size)]
    return MemorySplit(tuple(int(b) for b in budgets), tuple(ne), counts, tuple(experts))


def by_memory(
    boxes: list[float], split: MemorySplit, num_experts: int, moe_layers: list[int]
) -> Placement:
    """The placement of a :func:`split_by_memory` split: contiguous ranges of its
    counts; ``boxes`` (as the deployment names them, e.g. GiB) recorded as its shares."""
    assert sorted(split.counts) == sorted(moe_layers)
    return from_counts(num_experts, split.counts, "by-memory", tuple(float(x) for x in boxes))


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


def for_config(
    text_config: dict,
    size: int,
    counts_path: str | Path | None = None,
    capacity: Placement | None = None,
) -> Placement:
    """The placement a deployment uses: contiguous (equal ranges; by_shares with equal
    shares where ``size`` does not divide the expert count), or ``capacity``'s counts
    (by_memory); load-aware within those counts when routing counts are given."""
    from k3dist.format import layout

    moe = layout.moe_layers(text_config)
    E = text_config["num_experts"]
    if capacity is None and E % size:
        capacity = by_shares(E, [1.0] * size, moe)
    if counts_path is None:
        return capacity or contiguous(E, size, moe)
    counts = read_counts(counts_path)
    missing = sorted(set(moe) - set(counts))
    if missing:
        raise PlacementError(f"{counts_path}: no routing counts for MoE layers {missing[:5]}")
    return load_aware({i: counts[i] for i in moe}, size, capacity)
