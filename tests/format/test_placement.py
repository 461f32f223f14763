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


def test_by_shares_any_size():
    """A size that does not divide the experts: counts within one of equal, the extra
    expert rotating over layers so totals over the layers are equal too."""
    p = placement.by_shares(16, [1, 1, 1], [1, 2, 3])
    assert [p.counts(i) for i in (1, 2, 3)] == [[6, 5, 5], [5, 6, 5], [5, 5, 6]]
    assert p.experts_of(2, 1) == list(range(5, 11))  # contiguous ranges
    assert placement.for_config(
        {"num_hidden_layers": 4, "num_experts": 16, "first_k_dense_replace": 1}, 3
    ) == placement.by_shares(16, [1.0] * 3, [1, 2, 3])
    # a dividing size keeps the contiguous placement, and its hash (no shares key)
    tc = {"num_hidden_layers": 3, "num_experts": 16, "first_k_dense_replace": 1}
    c = placement.for_config(tc, 4)
    assert c.kind == "contiguous" and "shares" not in c.to_json()
    assert c.hash == placement.contiguous(16, 4, [1, 2]).hash
    q = placement.by_shares(64, [512, 256, 256], [1, 2])
    assert [q.counts(i) for i in (1, 2)] == [[32, 16, 16]] * 2
    assert Placement.from_json(q.to_json()) == q and q.shares == (512, 256, 256)
    with pytest.raises(PlacementError, match="cannot give each of 5 ranks one"):
        placement.by_shares(4, [1] * 5, [1])


GiB = 1 << 30
K3_LAYERS = list(range(1, 93))  # K3's 92 MoE layers


def test_split_by_memory_at_k3_counts():
    """512 + 256 + 256 GB (what each box gives the weights), the rank 0 box also holding
    the vision tower: each layer's 896 experts go in proportion to what is left, every
    box within its budget, totals within one expert of proportional."""
    budgets = [460 * GiB, 220 * GiB, 220 * GiB]
    nonexpert = [30 * GiB, 29 * GiB, 29 * GiB]
    eb = 8_000_000  # one expert at ~1.8 bpw (MXFP4 is 17,547,264)
    s = placement.split_by_memory(budgets, nonexpert, eb, 896, K3_LAYERS)
    assert all(sum(c) == 896 for c in s.counts.values())
    room = np.array(budgets) - np.array(nonexpert)
    ideal = room / room.sum() * 896 * len(K3_LAYERS) * eb
    assert np.abs(np.array(s.experts) - ideal).max() <= eb
    assert min(s.free) >= 0
    spread = {tuple(c) for c in s.counts.values()}
    assert len(spread) > 1  # the remainder rotates over layers
    p = placement.by_memory([512, 256, 256], s, 896, K3_LAYERS)
    assert p.kind == "by-memory" and p.shares == (512, 256, 256)
    assert all(p.counts(i) == s.counts[i] for i in K3_LAYERS)
    # per-layer expert bytes (e.g. a layer with more promoted experts) are honoured
    per = {i: eb + (4_000_000 if i % 2 else 0) for i in K3_LAYERS}
    s2 = placement.split_by_memory(budgets, nonexpert, per, 896, K3_LAYERS)
    ideal2 = room / room.sum() * 896 * sum(per.values())
    assert np.abs(np.array(s2.experts) - ideal2).max() <= max(per.values())


def test_split_by_memory_refuses_with_numbers():
    # K3's MXFP4 experts (1.45 TB) on two 256 GB boxes
    with pytest.raises(PlacementError, match=r"need 1,446\.46 GB .* leave .* GB short"):
        placement.split_by_memory([240 * GiB] * 2, 20 * GiB, 17_547_264, 896, K3_LAYERS)
    with pytest.raises(PlacementError, match=r"boxes 1 \(5\.37 GB for weights, non-experts"):
        placement.split_by_memory([400 * GiB, 5 * GiB], [20 * GiB, 20 * GiB], 1, 896, [1])
    with pytest.raises(PlacementError, match="one per box"):
        placement.split_by_memory([400 * GiB] * 3, [1, 2], 1, 896, [1])


def test_load_aware_within_memory_counts():
    """Load-aware placement inside by-memory counts: each rank keeps its count, and the
    bigger box takes colder experts, so the per-token critical path drops below that of
    plain contiguous by-memory ranges on skewed routing."""
    rng = np.random.default_rng(3)
    E, k, T = 64, 8, 4000
    pop = np.sort(rng.pareto(1.2, E) + 0.05)[::-1]
    sel = np.stack([rng.choice(E, size=k, replace=False, p=pop / pop.sum()) for _ in range(T)])
    counts = np.bincount(sel.ravel(), minlength=E)
    cap = placement.by_shares(E, [512, 256, 256], [1])
    la = placement.load_aware({1: counts}, 3, cap)
    assert la.counts(1) == cap.counts(1) == [32, 16, 16]
    assert (la.kind, la.shares) == ("by-shares+load-aware", (512, 256, 256))
    m_la, m_cap = la.expected_max_load(1, sel), cap.expected_max_load(1, sel)
    print(f"\nE[max pairs per rank per token] 512:256:256: by memory {m_cap:.3f}, +load {m_la:.3f}")
    assert m_la < m_cap
    with pytest.raises(PlacementError, match="give a capacity"):
        placement.load_aware({1: counts[:62]}, 3)


def test_balance_hi_keeps_uneven_counts_and_shares():
    """A graded build's promoted experts spread over ranks of a by-memory placement:
    counts per rank and the boxes it records stay (the loader checks them)."""
    from k3dist.format.graded import GradedMap, balance_hi

    plc = placement.by_shares(16, [512, 256, 256], [1, 2])  # 8:4:4
    out = balance_hi(plc, GradedMap(16, {1: (0, 1, 2, 3, 4, 5), 2: (15,)}, {1: 2, 2: 1}))
    assert [out.counts(i) for i in (1, 2)] == [[8, 4, 4]] * 2 and out.shares == plc.shares
    # in proportion to each rank's experts (8:4:4 -> 3:1.5:1.5; the half to rank 1)
    assert np.bincount(np.asarray(out.owners[1])[:6], minlength=3).tolist() == [3, 2, 1]
    assert out.kind == "by-shares+hi-balanced"


def test_hi_counts_follow_each_ranks_experts():
    """The promoted experts a rank holds follow the experts it holds: equal counts give
    the old even spread (remainder to the first ranks), uneven ones their proportion,
    never more than a rank has, always the layer's total."""
    assert placement.hi_counts(7, [4, 4]) == [4, 3]
    assert placement.hi_counts(6, [3, 3, 3]) == [2, 2, 2]
    assert placement.hi_counts(300, [448, 224, 224]) == [150, 75, 75]
    assert placement.hi_counts(3, [1, 1, 1]) == [1, 1, 1]
    for promoted in range(17):
        got = placement.hi_counts(promoted, [9, 4, 3])
        assert sum(got) == promoted and all(
            0 <= h <= n for h, n in zip(got, [9, 4, 3], strict=True)
        )
        assert all(abs(h - promoted * n / 16) < 1 for h, n in zip(got, [9, 4, 3], strict=True))
    with pytest.raises(PlacementError, match="17 promoted"):
        placement.hi_counts(17, [9, 4, 3])
