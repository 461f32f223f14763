"""How a graded plan's routed experts fill the boxes: one box size repeated, or a list of
boxes of different memory (``k3dist.pipeline.byte_budget``'s :func:`make_plan` asks, for
each lo format, :func:`option`).

Every rank holds the same non-expert bytes (attention heads split evenly where they
divide, the rest replicated, shared experts split by their intermediate dimension) and
the same KV/state and activations at the serving limits; what each box has left, its
**room**, holds routed experts.

- Equal boxes whose rank count divides the experts (two 512 GB boxes): every rank the
  same experts per layer, promotions a multiple of the ranks per layer (as before boxes
  of different sizes existed: the same numbers).
- Otherwise, ``split`` ``"memory"`` (the default): each layer's experts go to the ranks in
  proportion to their room (``k3dist.format.placement``'s apportioning, remainders rotated
  over the layers), each layer's promoted experts in proportion to the experts a rank
  holds (``placement.hi_counts``, the rule the slicer's ``graded.balance_hi`` applies), so
  each box's share of a layer's bytes is its share of the room, hi and lo alike. The
  promoted total is the most that keeps every box within its room.

The trade-off of ``"memory"``: under uniform routing a box reads, per token, its share of
the expert bytes, so a 512 GB box beside two 256 GB ones reads about half of them and
sets the pace of a decode step (the plan reports each box's bytes per token and the
largest over the mean). Every byte of memory buys quality; the big box's bandwidth is
the limit. ``"equal"`` gives every box the same experts (within one) and bytes, as much
as the smallest room holds: equal reads per token, the big box's extra memory unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3dist.format.placement import apportion, hi_counts

SPLITS = ("memory", "equal")


@dataclass(frozen=True)
class Room:
    """What one plan's routed experts have, per rank (module doc)."""

    budgets: tuple[int, ...]  # weights + KV + activations each box may hold
    fixed: int  # per rank: non-experts + KV/state + activations (+ batch join)
    headroom: int  # kept free per rank
    layers: tuple[int, ...]  # MoE layers
    num_experts: int
    top_k: int
    params: int  # one routed expert's parameters
    hi_bytes: int  # one expert in the hi bank (MXFP4)
    lo_fallback: bool = False
    split: str = "memory"

    @property
    def size(self) -> int:
        return len(self.budgets)

    @property
    def rooms(self) -> list[int]:
        """Bytes each rank has for routed experts."""
        return [b - self.headroom - self.fixed for b in self.budgets]

    @property
    def even(self) -> bool:
        """The equal path: one budget repeated and the experts divide by the ranks."""
        return len(set(self.budgets)) == 1 and self.num_experts % self.size == 0


def per_layer(total: int, layers: int, ranks: int, cap: int) -> list[int]:
    """``total`` promotions spread over layers, each a multiple of ``ranks`` (hi bytes
    balanced across equal ranks) and at most ``cap``."""
    per = min(cap, (total // layers) // ranks * ranks)
    counts = [per] * layers
    left = total - per * layers
    i = 0
    while left >= ranks and i < layers:
        if counts[i] + ranks <= cap:
            counts[i] += ranks
            left -= ranks
        i += 1
    return counts


def _spread(total: int, layers: int, cap: int) -> list[int]:
    """``total`` promotions over ``layers``, within one of each other, at most ``cap``."""
    total = min(total, cap * layers)
    return [total // layers + (i < total % layers) for i in range(layers)]


def expert_counts(room: Room) -> dict[int, list[int]]:
    """Experts per rank per layer: in proportion to the room (``memory``) or equal
    within one (``equal``); at least one each."""
    E, N = room.num_experts, room.size
    if room.even:
        return {layer: [E // N] * N for layer in room.layers}
    weights = room.rooms if room.split == "memory" else [1] * N
    return apportion(E, [max(w, 1) for w in weights], list(room.layers))


def _bank_bytes(room: Room, counts: dict, promoted: list[int], lo_b: int) -> dict:
    """Per rank: routed-expert bytes held, hi experts held, and expected expert bytes
    read per token under uniform routing (a route reads its expert's bank once)."""
    step = room.hi_bytes if room.lo_fallback else room.hi_bytes - lo_b
    held, hi, read = [0] * room.size, [0] * room.size, [0.0] * room.size
    for layer, p in zip(room.layers, promoted, strict=True):
        n = counts[layer]
        h = hi_counts(p, n)
        for r in range(room.size):
            held[r] += n[r] * lo_b + h[r] * step
            hi[r] += h[r]
            read[r] += room.top_k / room.num_experts * (h[r] * room.hi_bytes + (n[r] - h[r]) * lo_b)
    return {"held": held, "hi": hi, "read": read}


def _limits(room: Room) -> list[int]:
    """What each rank's experts may take: its room, or with ``equal`` the smallest."""
    rooms = room.rooms
    return rooms if room.split == "memory" or room.even else [min(rooms)] * room.size


def promotions(room: Room, lo_b: int, target_bpw: float | None) -> list[int]:
    """Promoted experts per layer: the most every box holds (or ``target_bpw``)."""
    E, L, N = room.num_experts, len(room.layers), room.size
    hi_b = room.hi_bytes
    step = hi_b if room.lo_fallback else hi_b - lo_b  # bytes one promotion adds
    cap = E if room.lo_fallback else E - N  # every rank keeps a lo expert (even path)
    if target_bpw is not None:
        want = (target_bpw * room.params / 8 - lo_b) / (hi_b - lo_b)
        total = max(0, min(L * E, int(want * L * E)))
        if room.even:
            total = total // (L * N) * (L * N) if total >= L * N else 0
            return per_layer(total, L, N, cap)
        return _spread(total, L, cap)
    limits = _limits(room)
    total = max(0, (sum(limits) - L * E * lo_b) // step) if min(limits) > 0 else 0
    if room.even:
        return per_layer(min(L * E, total), L, N, cap)
    counts = expert_counts(room)
    for _ in range(64):  # rounding: each box within a few experts of its share
        promoted = _spread(total, L, cap)
        held = _bank_bytes(room, counts, promoted, lo_b)["held"]
        over = max(h - lim for h, lim in zip(held, limits, strict=True))
        if over <= 0 or total == 0:
            return promoted
        total = max(0, total - max(L, -(-over * N // step)))
    return _spread(0, L, cap)


def option(room: Room, lo_b: int, lo_name: str, lo_bpw: float, target_bpw: float | None) -> dict:
    """One lo format's plan: promoted experts per layer, expert bpw, bytes per box."""
    E, L, N = room.num_experts, len(room.layers), room.size
    promoted = promotions(room, lo_b, target_bpw)
    counts = expert_counts(room)
    banks = _bank_bytes(room, counts, promoted, lo_b)
    limits = _limits(room)
    fits = min(room.rooms) >= 0 and all(
        h <= lim for h, lim in zip(banks["held"], limits, strict=True)
    )
    total = sum(promoted)
    held = total * room.hi_bytes + (L * E - total + (total if room.lo_fallback else 0)) * lo_b
    mean = sum(banks["read"]) / N
    return {
        "lo": lo_name,
        "lo_bpw": round(lo_bpw, 4),
        "lo_expert_bytes": lo_b,
        "fits": bool(fits),
        "promoted_total": total,
        "promoted_fraction": round(total / (L * E), 4),
        "promoted_per_layer": promoted,
        "expert_bpw": round(held * 8 / (L * E * room.params), 4),
        "experts_per_rank": max(banks["held"]),
        "headroom_per_rank": min(
            b - room.fixed - h for b, h in zip(room.budgets, banks["held"], strict=True)
        ),
        "per_box_experts": banks["held"],
        "per_box_hi": banks["hi"],
        "per_box_expert_read": [round(x) for x in banks["read"]],
        "read_ratio": round(max(banks["read"]) / mean, 4) if mean else 1.0,
        "counts": counts,
    }
