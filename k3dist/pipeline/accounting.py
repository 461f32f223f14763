"""Every tensor of a K3 checkpoint in its storage class (``k3dist.format.classes``):
names from its index, shapes and dtypes from its config through ``k3dist.format.layout``
(which reproduces the real index's ``total_size`` exactly); source bytes and weight
counts per class, and the bytes of a class or a routed expert in any format
(``k3dist.format.qformat``). What the planner spends its budget on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3dist.format import layout
from k3dist.format.classes import tensor_class
from k3dist.format.qformat import QFormat


@dataclass
class Accounting:
    """Source bytes and weight counts per class, and the routed experts' shape."""

    tc: dict
    classes: dict[str, dict]  # class -> {"tensors", "params", "source_bytes"}
    tensors: dict[str, list[layout.TensorSpec]]  # class -> specs
    moe_layers: list[int]
    num_experts: int
    expert_mats: list[tuple[int, int]]  # (rows, cols) of w1, w2, w3 of one expert
    source_total: int
    index_total: int | None

    @property
    def expert_params(self) -> int:
        return sum(r * c for r, c in self.expert_mats)

    def expert_bytes(self, fmt: QFormat) -> int:
        """One routed expert (w1 + w2 + w3) in ``fmt``; mxfp4 equals the source bytes."""
        return sum(fmt.nbytes(r, c) for r, c in self.expert_mats)

    def class_bytes(self, cls: str, fmt: QFormat) -> int:
        """A non-expert class in ``fmt``; matrices it cannot store keep their dtype."""
        n = 0
        for s in self.tensors.get(cls, []):
            f = fmt.for_cols(s.shape[1]) if fmt.quantized else None
            n += f.nbytes(*s.shape) if f is not None else s.nbytes
        return n


def account(config: dict, index: dict | None = None, where: str = "index") -> Accounting:
    """Every tensor of the checkpoint in its class. With an index, its names must be
    exactly the ones the config implies (and its ``total_size`` the sum)."""
    tc = layout.text_config(config)
    specs = layout.source_specs(config)
    total = sum(s.nbytes for s in specs)
    index_total = None
    if index is not None:
        names = set(index["weight_map"])
        implied = {s.name for s in specs}
        missing, extra = sorted(implied - names), sorted(names - implied)
        if missing or extra:
            raise ValueError(
                f"{where}: {len(missing)} tensors the config implies are not "
                f"in the index (e.g. {missing[:3]}) and {len(extra)} index "
                f"tensors the config does not imply (e.g. {extra[:3]}); pass "
                "the config.json of this checkpoint"
            )
        index_total = index.get("metadata", {}).get("total_size")
        vision = {s.name for s in specs if s.family == "vision"}
        if index_total is not None and not vision and index_total != total:
            raise ValueError(
                f"{where}: total_size {index_total} but the config implies "
                f"{total} bytes; pass the config.json of this checkpoint"
            )
    classes: dict[str, dict] = {}
    tensors: dict[str, list] = {}
    for s in specs:
        c = tensor_class(s)
        tensors.setdefault(c, []).append(s)
        e = classes.setdefault(c, {"tensors": 0, "params": 0, "source_bytes": 0})
        e["tensors"] += 1
        n = math.prod(s.shape) if s.shape else 0
        if s.family == "experts":  # two codes a packed byte; scales hold no weights
            n = 2 * n if s.name.endswith("weight_packed") else 0
        e["params"] += n
        e["source_bytes"] += s.nbytes
    moe = [i for i in range(tc["num_hidden_layers"]) if layout.is_moe_layer(tc, i)]
    mats = []
    if moe:
        for s in layout.expert_specs(tc, moe[0], 0):
            if s.name.endswith("weight_packed"):
                mats.append((s.shape[0], s.shape[1] * 2))
    return Accounting(
        tc, classes, tensors, moe, tc.get("num_experts") or 0, mats, total, index_total
    )
