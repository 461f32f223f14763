"""Placement: a map that covers every expert exactly once; load-aware balances
the per-token critical path better than contiguous ranges on skewed routing."""

from __future__ import annotations

import json

from k3dist.format import placement
from k3dist.format.placement import Placement, PlacementError

import numpy as np
import pytest


def test_contiguous_tables():
    p = placement.contiguous(16, 4, [1, 2])
    assert p.experts_of(1, 2) == [8, 9, 10, 11]
    t = p.local_table(2, 1)
    assert t.tolist() == [-1] * 4 + [0, 1, 2, 3] + [-1] * 8
    with pytest.raises(PlacementError, match="equal contiguous"):
        placement.contiguous(10, 4, [1])


@pytest.mark.parametrize(
    "owners,match",
    [
        ([0] * 8 + [1] * 7, "15 owners for 16"),
        ([0] * 8 + [1] * 9, "17 owners for 16"),
        ([0] * 8 + [1] * 7 + [2], "outside 0..1"),
        ([0] * 16, "ranks \\[1\\] own no expert"),
    ],
)
def test_invalid_placements_refused(owners, match):
    with pytest.raises(PlacementError, match=match):
        Placement(2, 16, {1: tuple(owners)})


def test_load_aware_balances_skewed_routing(tmp_path):
    rng = np.random.default_rng(3)
    E, k, T, N = 64, 8, 4000, 4
    # Skewed popularity, hot experts clustered in low ids (contiguous's worst case).
    pop = np.sort(rng.pareto(1.2, E) + 0.05)[::-1]
    sel = np.stack([rng.choice(E, size=k, replace=False, p=pop / pop.sum()) for _ in range(T)])
    counts = np.bincount(sel.ravel(), minlength=E)
    np.savez(tmp_path / "counts.npz", layer_1=counts)
    (tmp_path / "counts.json").write_text(json.dumps({"layers": {"1": counts.tolist()}}))
    la = placement.load_aware(placement.read_counts(tmp_path / "counts.npz"), N)
    assert (
        la.owners == placement.load_aware(placement.read_counts(tmp_path / "counts.json"), N).owners
    )
    cont = placement.contiguous(E, N, [1])
    m_la, m_cont = la.expected_max_load(1, sel), cont.expected_max_load(1, sel)
    print(
        f"\nE[max pairs per rank per token]: contiguous {m_cont:.3f}, load-aware {m_la:.3f}"
        f" (ideal >= {k / N})"
    )
    assert m_la < m_cont
    assert all(len(la.experts_of(1, r)) == E // N for r in range(N))  # memory balanced
    assert Placement.from_json(la.to_json()) == la


def test_for_config_needs_every_moe_layer(tmp_path):
    tc = {"num_hidden_layers": 3, "num_experts": 8, "first_k_dense_replace": 1}
    np.savez(tmp_path / "c.npz", layer_1=np.arange(8))
    with pytest.raises(PlacementError, match="no routing counts for MoE layers \\[2\\]"):
        placement.for_config(tc, 2, tmp_path / "c.npz")
    assert placement.for_config(tc, 2).kind == "contiguous"
