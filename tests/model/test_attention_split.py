"""Attention split across ranks, without a launch: the per-rank attention bytes for
the real K3 (from the layout) and the bench preset (a synthesized config), and which
tensors divide how (``layout.split_rule``/``split_layers``)."""

from __future__ import annotations

import json

from k3dist.bench import costmodel as cm
from k3dist.factory import synth
from k3dist.format import layout

import pytest

CONFIGS = {
    "real K3": synth.real_config(),
    "bench preset": synth.make_config(synth.PRESETS["bench"], 4352),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_split_halves_the_head_split_attention_bytes(name):
    config = CONFIGS[name]
    for profile in ("mxfp4", "graded"):
        a = cm.attention_bytes(config, cm.PROFILES[profile], 2)
        print(f"\n{name} {profile}: {json.dumps(a)}")
        frac = a["saved_fraction_of_attention"]
        # Only the low-rank inputs (KDA f_a, MLA q_a/kv_a) and norms stay replicated.
        assert 0.4 < frac < 0.5, frac
        assert a["box_total"]["ep-replicated"] - a["box_total"]["ep-split"] >= a["saved_bytes"]
    assert cm.attention_bytes(config, cm.PROFILES["mxfp4"], 1)["saved_bytes"] == 0


def test_split_rules_and_layers():
    tc = layout.text_config(CONFIGS["real K3"])
    kda, mla = min(layout.kda_layers(tc)), min(set(range(93)) - layout.kda_layers(tc))
    p = layout.LAYER_PREFIX
    assert layout.split_rule(tc, f"{p}{kda}.self_attn.qkv_proj.scales") == (0, 3)
    assert layout.split_rule(tc, f"{p}{kda}.self_attn.o_proj.weight") == (-1, 1)
    assert layout.split_rule(tc, f"{p}{kda}.self_attn.f_a_proj.weight") is None
    assert layout.split_rule(tc, f"{p}{mla}.self_attn.unembed_out.weight") == (0, 1)
    assert layout.split_rule(tc, f"{p}{mla}.self_attn.kv_a_proj_with_mqa.weight") is None
    assert layout.split_rule(tc, f"{p}0.mlp.down_proj.biases") == (-1, 1)
    assert layout.split_rule(tc, f"{p}1.mlp.shared_experts.down_proj.weight") is None
    # o_proj quantized at group 64 over 128 inputs: 2 groups split 2 ways, not 4
    shapes = {f"{p}{kda}.self_attn.o_proj.scales": (64, 2)}
    assert kda in layout.split_layers(tc, 2, shapes)
    assert kda not in layout.split_layers(tc, 4, shapes)
    assert layout.split_layers(tc, 1, {}) == []
    assert layout.split_slice((12, 4), (0, 3), 1, 2) == [(2, 4), (6, 8), (10, 12)]
