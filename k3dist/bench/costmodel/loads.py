"""Routing loads: how many of a step's routed pairs each rank owns, uniform or sampled
from routing counts, for a batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3dist.bench.costmodel.facts import Facts
from k3dist.format.placement import Placement, contiguous

import numpy as np

# ---------------------------------------------------------------- routing loads


@dataclass(frozen=True)
class Load:
    """Routed experts per rank in one MoE layer, per step. At batch 1 a token's ``k``
    experts are distinct, so experts read = pairs computed; at batch B the step reads
    the union of the B tokens' experts and computes B k pairs."""

    mean: tuple[float, ...]  # expected experts read on each rank
    max: float  # expected experts read on the busiest rank (the step's critical path)
    pairs_max: float | None = None  # pairs computed on the busiest rank (None: ``max``)
    distinct: float | None = None  # experts read over all ranks (None: k)


def _uniform_load(owned: list[int], k: int) -> Load:
    """Exact under uniform routing: k distinct experts drawn at random; the number on
    each rank is multivariate hypergeometric. E[max] = sum_m P(max > m)."""
    E = sum(owned)
    total = math.comb(E, k)
    emax = 0.0
    for m in range(k):
        poly = [1]  # ways to pick j experts with every rank <= m
        for c in owned:
            term = [math.comb(c, j) for j in range(min(m, c) + 1)]
            out = [0] * min(len(poly) + len(term) - 1, k + 1)
            for a, x in enumerate(poly):
                for b, y in enumerate(term):
                    if a + b <= k:
                        out[a + b] += x * y
            poly = out
        le = poly[k] if len(poly) > k else 0
        emax += 1 - le / total
    return Load(tuple(k * c / E for c in owned), emax)


def _sampled_load(
    pl: Placement, layer: int, counts: np.ndarray, k: int, samples: int, seed: int
) -> Load:
    """Tokens drawn without replacement proportionally to routing counts (Gumbel top-k)."""
    rng = np.random.default_rng(seed + layer)
    p = np.asarray(counts, dtype=np.float64) + 1e-9
    keys = np.log(p / p.sum()) + rng.gumbel(size=(samples, len(p)))
    sel = np.argpartition(-keys, k - 1, axis=-1)[:, :k]
    owner = np.asarray(pl.owners[layer])[sel]
    mean = tuple(float((owner == r).sum(-1).mean()) for r in range(pl.size))
    return Load(mean, pl.expected_max_load(layer, sel))


def _batch_load(
    pl: Placement,
    layer: int,
    counts: np.ndarray | None,
    k: int,
    batch: int,
    samples: int,
    seed: int,
) -> Load:
    """B tokens per step, each drawing k experts without replacement (proportionally to
    routing counts, or uniformly): the union each rank reads, the pairs it computes."""
    rng = np.random.default_rng(seed + layer)
    E = pl.num_experts
    p = np.ones(E) if counts is None else np.asarray(counts, dtype=np.float64) + 1e-9
    keys = np.log(p / p.sum()) + rng.gumbel(size=(samples, batch, E))
    sel = np.argpartition(-keys, k - 1, axis=-1)[..., :k]  # [samples, B, k]
    touched = np.zeros((samples, E), dtype=bool)
    np.put_along_axis(touched, sel.reshape(samples, -1), True, axis=-1)
    owners = np.asarray(pl.owners[layer])
    read = np.stack([touched[:, owners == r].sum(-1) for r in range(pl.size)], -1)
    pairs = np.stack([(owners[sel] == r).sum((-1, -2)) for r in range(pl.size)], -1)
    return Load(
        tuple(float(x) for x in read.mean(0)),
        float(read.max(-1).mean()),
        float(pairs.max(-1).mean()),
        float(touched.sum(-1).mean()),
    )


def routed_loads(
    f: Facts,
    size: int,
    pl: Placement | None = None,
    counts: dict[int, np.ndarray] | None = None,
    samples: int = 2048,
    seed: int = 0,
    batch: int = 1,
    skew: dict[str, float] | None = None,
) -> dict[int, Load]:
    """Per MoE layer: experts per rank under EP. Uniform routing unless counts are
    given; batch > 1 is sampled (``samples`` steps). ``skew`` (``benchmarks/speed/routing_skew.py``:
    measured over uniform on real routing; keys ``skew``, ``skew_pairs``, ``skew_union``)
    scales the busiest rank's experts read, its pairs and the experts read in all."""
    out = _routed_loads(f, size, pl, counts, samples, seed, batch)
    if not skew:
        return out
    k = f.top_k
    return {
        i: Load(
            v.mean,
            min(v.max * skew["skew"], batch * k),
            min((v.max if v.pairs_max is None else v.pairs_max) * skew["skew_pairs"], batch * k),
            min((k if v.distinct is None else v.distinct) * skew["skew_union"], batch * k),
        )
        for i, v in out.items()
    }


def _routed_loads(
    f: Facts, size: int, pl: Placement | None, counts, samples: int, seed: int, batch: int
) -> dict[int, Load]:
    moe = f.moe_layers
    pl = pl or contiguous(f.num_experts, size, moe)
    if pl.size != size:
        raise ValueError(f"placement is for {pl.size} ranks, not {size}")
    out, cache = {}, {}
    if batch > 1:
        n = max(64, samples // batch)
        for i in moe:
            out[i] = _batch_load(
                pl, i, None if counts is None else counts[i], f.top_k, batch, n, seed
            )
        return out
    for i in moe:
        if counts is not None:
            out[i] = _sampled_load(pl, i, counts[i], f.top_k, samples, seed)
            continue
        owned = tuple(int(c) for c in np.bincount(pl.owners[i], minlength=size))
        if owned not in cache:
            cache[owned] = _uniform_load(list(owned), f.top_k)
        out[i] = cache[owned]
    return out
