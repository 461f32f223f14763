"""The converter's peak memory stays within the bound from its largest unit."""

from __future__ import annotations

from k3dist.bench import membound
from k3dist.factory import synth


def test_peak_rss_within_largest_unit_bound(mini_src, tmp_path):
    r = membound.measure(mini_src, tmp_path / "b")
    print(
        f"\npeak over baseline {r['peak_over_baseline']} B, bound "
        f"{r['bound_over_baseline']} B, model {r['model_bytes']} B"
    )
    assert r["within_bound"], r


def test_real_k3_bound_is_a_layer_not_the_model():
    b = membound.bound(synth.real_config())
    assert b["model_bytes"] == 1_560_860_324_864
    assert b["bound_over_baseline"] < b["model_bytes"] / 50
