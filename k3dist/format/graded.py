"""The on-disk description of a graded build: which experts of each MoE layer sit in
which bank.

A graded MoE layer holds two expert stacks: the **lo bank** (``mlp.switch_mlp``: affine
low-bit, every expert not promoted, plus the promoted ones when the build keeps a
fallback copy) and the **hi bank** (``mlp.switch_hi``: the promoted experts in their
original MXFP4 bytes), each in ascending global id. ``config.json`` ``graded``
(:class:`GradedMap`): ``hi`` (promoted global ids per MoE layer), ``k_hi`` per layer,
``lo_fallback``, ``lo`` (format name). The slicer, the grader and the loader read it
here; ``k3dist.model.two_bank`` runs it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from k3dist.format.placement import Placement, hi_counts

import numpy as np

GRADED_KEY = "graded"
LO, HI = "switch_mlp", "switch_hi"
_BANK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(switch_mlp|switch_hi)\.")


class GradedError(ValueError):
    pass


@dataclass(frozen=True)
class GradedMap:
    """Which experts of each MoE layer are in which bank."""

    num_experts: int
    hi: dict[int, tuple[int, ...]]  # MoE layer -> promoted global ids, ascending
    k_hi: dict[int, int]
    lo_fallback: bool = False
    lo: str = ""  # lo-bank format name (informational; the quantization block rules)

    def __post_init__(self):
        for layer, ids in self.hi.items():
            if list(ids) != sorted(set(ids)) or any(not 0 <= e < self.num_experts for e in ids):
                raise GradedError(
                    f"graded layer {layer}: promoted ids must be distinct, "
                    f"ascending, in 0..{self.num_experts - 1}; got {ids[:8]}"
                )
            k = self.k_hi.get(layer, 0)
            if ids and k < 1:
                raise GradedError(
                    f"graded layer {layer}: {len(ids)} promoted experts but "
                    f"k_hi {k}; give k_hi >= 1 (calibration: observed max)"
                )
            if not self.lo_fallback and len(ids) == self.num_experts:
                raise GradedError(
                    f"graded layer {layer}: every expert promoted and no "
                    "fallback leaves an empty lo bank; keep one in lo"
                )

    def hi_ids(self, layer: int) -> list[int]:
        return list(self.hi.get(layer, ()))

    def lo_ids(self, layer: int) -> list[int]:
        if self.lo_fallback:
            return list(range(self.num_experts))
        hi = set(self.hi.get(layer, ()))
        return [e for e in range(self.num_experts) if e not in hi]

    def bank_ids(self, layer: int, bank: str) -> list[int]:
        return self.hi_ids(layer) if bank == HI else self.lo_ids(layer)

    def to_json(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "lo_fallback": self.lo_fallback,
            "lo": self.lo,
            "k_hi": {str(k): v for k, v in sorted(self.k_hi.items())},
            "hi": {str(k): list(v) for k, v in sorted(self.hi.items())},
        }

    @classmethod
    def from_json(cls, d: dict) -> GradedMap:
        try:
            return cls(
                int(d["num_experts"]),
                {int(k): tuple(int(e) for e in v) for k, v in d["hi"].items()},
                {int(k): int(v) for k, v in d["k_hi"].items()},
                bool(d.get("lo_fallback", False)),
                str(d.get("lo", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise GradedError(
                f"malformed graded block ({e!r}); it needs num_experts, hi and k_hi"
            ) from None

    @classmethod
    def from_config(cls, config: dict) -> GradedMap | None:
        d = config.get(GRADED_KEY)
        return None if d is None else cls.from_json(d)


def bank_of(name: str) -> tuple[int, str] | None:
    """(layer, ``switch_mlp`` | ``switch_hi``) of a stacked expert tensor name."""
    m = _BANK_RE.search(name)
    return (int(m.group(1)), m.group(2)) if m else None


def bank_names(gmap: GradedMap | None, layer: int) -> list[str]:
    """The expert stacks a MoE layer's files hold."""
    return [LO, HI] if gmap is not None and gmap.hi_ids(layer) else [LO]


def stack_rows(gmap: GradedMap | None, name: str, num_experts: int) -> list[int] | None:
    """Global expert id of each row of a stacked expert tensor (None: not a stack)."""
    b = bank_of(name)
    if b is None:
        return None
    if gmap is None:
        if b[1] == HI:
            raise GradedError(
                f"{name}: a hi-bank tensor in a build whose config.json has "
                f"no {GRADED_KEY!r} block; is config.json from this build?"
            )
        return list(range(num_experts))
    return gmap.bank_ids(*b)


def local_rows(
    gmap: GradedMap | None, name: str, num_experts: int, placement: Placement, rank: int
) -> list[int] | None:
    """Rows of a stacked tensor that ``rank`` holds (positions in the global stack)."""
    rows = stack_rows(gmap, name, num_experts)
    if rows is None:
        return None
    owners = placement.owners[bank_of(name)[0]]
    return [i for i, e in enumerate(rows) if owners[e] == rank]


def balance_hi(placement: Placement, gmap: GradedMap) -> Placement:
    """The placement with each layer's promoted experts spread over the ranks in
    proportion to the experts each holds (``placement.hi_counts``: evenly on equal
    counts, 2:1:1 on a 512:256:256 split), by swapping owners of a promoted and an
    unpromoted expert; expert counts per rank are unchanged."""
    owners = {}
    for layer, own in placement.owners.items():
        own = list(own)
        hi = gmap.hi_ids(layer)
        want = np.asarray(hi_counts(len(hi), placement.counts(layer)))
        for _ in range(len(hi)):
            have = np.bincount([own[e] for e in hi], minlength=placement.size)
            over, under = int(np.argmax(have - want)), int(np.argmin(have - want))
            if have[over] <= want[over]:
                break
            a = next(e for e in hi if own[e] == over)
            hs = set(hi)
            b = next((e for e in range(len(own)) if own[e] == under and e not in hs), None)
            if b is None:
                break
            own[a], own[b] = under, over
        owners[layer] = tuple(own)
    kind = placement.kind if owners == placement.owners else f"{placement.kind}+hi-balanced"
    return Placement(placement.size, placement.num_experts, owners, kind, placement.shares)
