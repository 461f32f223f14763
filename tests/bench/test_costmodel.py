"""Cost model: the real K3's sizes at a build profile reproduce the published figures;
per-rank bytes and collectives follow each mode's code; projections move with flags."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from k3dist.bench import costmodel as cm
from k3dist.factory import synth
from k3dist.format.placement import Placement

import numpy as np
import pytest

ONE_EXPERT = 17_547_264  # one MXFP4 routed expert (w1 + w2 + w3, scales included)
SOURCE_BYTES = 1_560_860_324_864  # the checkpoint index's total_size
MOE_LAYERS, TOP_K = 92, 16


@pytest.fixture(scope="module")
def cfg():
    return synth.real_config()


@pytest.fixture(scope="module")
def f(cfg):
    return cm.facts(cfg, cm.PROFILES["mxfp4"])


def jaccl(**kw) -> cm.Hardware:
    return replace(cm.with_backend(cm.Hardware(), "jaccl"), **kw)


def test_mxfp4_build_footprint_is_the_published_size(cfg, f):
    fp = cm.footprint(cfg, cm.PROFILES["mxfp4"])
    # The layout's sum is the index's total_size (tests/pipeline/test_checkpoint.py).
    assert fp["build_bytes"] == SOURCE_BYTES
    assert abs(fp["build_bytes"] / 1.561e12 - 1) < 0.005
    assert f.expert_bytes == f.pair_bytes == ONE_EXPERT
    assert fp["by_group"]["routed_experts"] == MOE_LAYERS * 896 * ONE_EXPERT


def test_profiles_shrink_the_build(cfg):
    total = {n: cm.footprint(cfg, p)["build_bytes"] for n, p in cm.PROFILES.items()}
    assert total["mxfp4"] > total["mxfp4-ne8"] > total["mxfp4-ne4"] > total["graded"]
    # Non-experts at 8-bit: 8.5 bits/weight on the quantizable 2-D weights.
    p8 = cm.PROFILES["mxfp4-ne8"]
    assert p8.affine_bits(8) == 8.5 and cm.PROFILES["mxfp4-ne4"].affine_bits(4) == 4.5
    g = cm.PROFILES["graded"]
    assert g.expert_store_bits == pytest.approx(0.1 * 4.25 + 0.9 * 2.25)
    with pytest.raises(ValueError, match="nonexpert_bits must be 16, 8 or 4"):
        cm.Profile("x", nonexpert_bits=6)


def test_ep_routed_bytes_are_the_owned_fraction(f):
    for mode in cm.EP_MODES:
        step = cm.bytes_per_token(mode, f, 2, jaccl())
        assert step["bytes"]["routed_experts_mean"] == TOP_K * MOE_LAYERS * ONE_EXPERT * 0.5
        # The step waits for the busiest rank: E[max] of a hypergeometric split.
        emax = sum(
            max(x, TOP_K - x) * math.comb(448, x) * math.comb(448, TOP_K - x)
            for x in range(TOP_K + 1)
        ) / math.comb(896, TOP_K)
        assert step["bytes"]["routed_experts"] == pytest.approx(
            emax * MOE_LAYERS * ONE_EXPERT, rel=1e-9
        )
    # A placement giving rank 0 three quarters of the experts.
    own = tuple([0] * 672 + [1] * 224)
    pl = Placement(2, 896, {i: own for i in f.moe_layers}, "custom")
    loads = cm.routed_loads(f, 2, pl)
    step = cm.bytes_per_token("ep-replicated", f, 2, jaccl(), loads=loads)
    assert step["bytes"]["routed_experts_mean"] == pytest.approx(
        TOP_K * MOE_LAYERS * ONE_EXPERT * 0.75
    )


def test_modes_are_consistent(f):
    hw = jaccl()
    s = {m: cm.bytes_per_token(m, f, 2, hw) for m in cm.MODES}
    assert s["ep-split"]["bytes_critical_path"] < s["ep-replicated"]["bytes_critical_path"]
    # Collectives as the code issues them: 92 MoE all_sums (latent 3584 + shared 7168),
    # + 93 attention all_sums when attention is split, + 1 dense MLP (split with it, as
    # in mlx-lm's TP; k3dist.serve.introspect counts the same 2 per layer on mini-K3).
    assert [s[m]["n_collectives"] for m in cm.MODES] == [92, 186, 186, 2]
    assert s["tp"]["n_collectives"] > s["ep-replicated"]["n_collectives"]
    moe = s["ep-replicated"]["collectives"][0]
    assert (moe["count"], moe["bytes"]) == (92, (3584 + 7168) * 2)
    # TP reads exactly half of each of the 16 routed experts per layer.
    assert s["tp"]["bytes"]["routed_experts"] == TOP_K * MOE_LAYERS * ONE_EXPERT / 2
    # PP: 47 + 46 layers; the hand-off carries the hidden state and 4 AttnRes blocks.
    pp = s["pp"]
    assert [st["layers"] for st in pp["stages"]] == [[0, 47], [47, 93]]
    send = pp["collectives"][0]
    assert (send["op"], send["bytes"]) == ("send", 5 * 7168 * 2)
    t = pp["time_s"]
    assert t["total"] == pytest.approx(
        sum(st["compute_s"] for st in pp["stages"]) + pp["head_compute_s"] + t["comm"]
    )
    assert pp["bytes"]["routed_experts"] == TOP_K * MOE_LAYERS * ONE_EXPERT
    # One box: every mode is the same single-process step.
    one = {cm.bytes_per_token(m, f, 1, hw)["bytes_critical_path"] for m in cm.MODES}
    assert len(one) == 1 and one.pop() == pp["bytes_critical_path"]


def test_non_owned_pairs_per_form(f):
    hw = jaccl()
    ph = cm.bytes_per_token("ep-split", f, 2, hw, "placeholder")
    lo = cm.bytes_per_token("ep-split", f, 2, hw, "local")
    assert ph["bytes"]["placeholder"] == MOE_LAYERS * ONE_EXPERT
    assert lo["bytes"]["placeholder"] == 0
    assert ph["flops"] > lo["flops"]  # placeholder computes all 16 pairs on each rank
    assert lo["time_s"]["sync"] == pytest.approx(MOE_LAYERS * hw.sync_s)
    assert ph["time_s"]["sync"] == 0


def test_projection_reacts_to_flags(cfg):
    base = jaccl()
    prof = cm.PROFILES["graded"]

    def tok(mode, hw=base, p=prof, **kw):
        return cm.project(cfg, p, hw, 2, modes=(mode,), **kw)["modes"][mode]["tok_s"]

    assert tok("tp", replace(base, bw_fraction=0.8)) > tok("tp")
    slow = cm.with_backend(base, "jaccl", latency_s=1e-3)
    assert tok("tp", slow) < tok("tp")
    # Latency costs TP (186 collectives) far more than PP (2).
    assert tok("tp") / tok("tp", slow) > tok("pp") / tok("pp", slow)
    assert tok("ep-split", form="local") > tok("ep-split", replace(base, sync_s=2e-3), form="local")
    assert tok("ep-split", replace(base, placeholder_reads=4)) < tok("ep-split")
    assert tok("pp", context=65536) < tok("pp", context=1024)
    assert tok("pp", p=replace(prof, nonexpert_bits=4)) > tok("pp")
    r = cm.project(cfg, cm.PROFILES["mxfp4"], base, 2)["modes"]
    assert not any(m["footprint_per_box"]["fits"] for m in r.values())  # 1.56 TB > 2 x 480 GB
    r = cm.project(cfg, prof, base, 2)["modes"]
    assert all(m["footprint_per_box"]["fits"] for m in r.values())


def test_sampled_routing_with_load_aware_placement(f):
    from k3dist.format import placement

    rng = np.random.default_rng(0)
    pop = np.sort(rng.pareto(1.2, 896) + 0.05)[::-1]  # hot experts in low ids
    counts = {i: pop for i in f.moe_layers[:3]}
    sub = cm.Facts(**{**f.__dict__, "layers": [L for L in f.layers if L.index in counts]})
    cont = cm.routed_loads(sub, 2, None, counts, samples=512)
    la = cm.routed_loads(sub, 2, placement.load_aware(counts, 2), counts, samples=512)
    for i in counts:
        assert 8 <= la[i].max < cont[i].max
        assert sum(la[i].mean) == pytest.approx(TOP_K)


def test_cli_writes_json(tmp_path):
    out = tmp_path / "p.json"
    script = Path(__file__).parents[2] / "benchmarks" / "speed" / "project.py"
    r = subprocess.run(
        [
            sys.executable,
            str(script),
            "--profile",
            "graded",
            "--backend",
            "jaccl",
            "--bw-fraction",
            "0.5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    d = json.loads(out.read_text())
    assert d == json.loads(r.stdout)
    assert d["constants"]["hardware"]["bw_fraction"] == 0.5
    assert set(d["projections"]["graded"]["jaccl"]["modes"]) == set(cm.MODES)
    assert {a["anchor"] for a in d["anchors"]["graded"]} >= {"PipeNetwork TP"}


def test_batch_reads_weights_once_and_the_union_of_experts(f):
    hw = cm.Hardware()
    one = cm.bytes_per_token("ep-split", f, 2, hw, batch=1)
    eight = cm.bytes_per_token("ep-split", f, 2, hw, batch=8)
    for g in ("attn_heads", "attn_rep", "dense_mlp", "router", "latent", "shared"):
        assert eight["bytes"][g] == one["bytes"][g]  # weights: once per step
    assert eight["bytes"]["state"] == pytest.approx(8 * one["bytes"]["state"])
    k = f.top_k
    loads = cm.routed_loads(f, 2, batch=8, samples=512)
    for load in loads.values():
        # the busiest rank reads more experts than at batch 1, fewer than 8 x k
        assert k / 2 < load.max < 8 * k and k < load.distinct <= 8 * k
        assert load.pairs_max >= load.max
    # uniform routing over 896 experts: the union of 8 x 16 draws, E (1 - (1 - k/E)^8)
    want = f.num_experts * (1 - (1 - k / f.num_experts) ** 8)
    assert np.mean([v.distinct for v in loads.values()]) == pytest.approx(want, rel=0.02)
    assert one["tok_s_per_request"] > eight["tok_s_per_request"]
    assert eight["tok_s"] == pytest.approx(8 * eight["tok_s_per_request"])
    assert 1 < eight["tok_s"] / one["tok_s"] < 8
    colls = cm.collectives(f, "ep-split", 2, hw, batch=8)
    assert [c["bytes"] for c in colls] == [
        8 * c["bytes"] for c in cm.collectives(f, "ep-split", 2, hw)
    ]


def test_plan_profile_reproduces_the_planner(cfg):
    """A graded plan (issue 12's planner, measured non-expert formats) read as a profile
    gives the planner's own build size and non-expert bytes read per token."""
    path = Path(__file__).parents[2] / "benchmarks/results/2026-12-01/plan-k3-measured.json"
    plan = json.loads(path.read_text())["plans"]["replicated"]
    prof = cm.plan_profile(plan)
    assert prof.hi_fraction == plan["promoted_fraction"] and prof.lo_bits == 2.5
    f = cm.facts(cfg, prof)
    assert cm.footprint(cfg, prof)["build_bytes"] == pytest.approx(plan["build_bytes"], rel=1e-4)
    step = cm.bytes_per_token("ep-replicated", f, 2)
    nonexpert = sum(
        v
        for g, v in step["bytes"].items()
        if g not in ("routed_experts", "routed_experts_mean", "placeholder", "state")
    )
    assert nonexpert == pytest.approx(plan["nonexpert_read_per_token_per_rank"], rel=1e-6)


def test_prefill_chunks_trade_time_to_first_token_for_running_requests_latency(cfg):
    """Prefill: a chunk reads every expert its routes touch (a 512-token chunk ~all 448 of a
    rank's), MLA's work grows with the context (KDA's does not), and the placeholder form
    computes every routed pair; bigger chunks shorten the prompt and stall the decoders."""
    f = cm.facts(cfg, cm.PROFILES["mxfp4"])
    hw = cm.Hardware()
    c = cm.prefill_chunk(f, "ep-split", 2, hw, 512, 0)
    assert 447 < c["experts_touched_per_layer"] <= 448
    assert c["n_collectives"] == 186  # as decode: one all_sum per layer + per MoE layer
    far = cm.prefill_chunk(f, "ep-split", 2, hw, 512, 100_000)
    assert far["attention_flops"] > 10 * c["attention_flops"]
    assert far["flops"] - far["attention_flops"] == pytest.approx(c["flops"] - c["attention_flops"])
    ph = cm.prefill_chunk(f, "ep-split", 2, hw, 512, 0, "placeholder")
    assert ph["flops"] > 1.3 * c["flops"] and ph["time_s"]["sync"] == 0 < c["time_s"]["sync"]
    tp = cm.prefill_chunk(f, "tp", 2, hw, 512, 0)
    assert tp["flops"] < c["flops"] < 1.01 * tp["flops"]  # EP: the busiest rank's pairs
    rows = cm.chunk_tradeoff(f, "ep-split", 2, hw, (128, 512), 2048, 1, 4096)
    assert rows[0]["ttft_s"] > rows[1]["ttft_s"] and rows[0]["itl_mean_s"] < rows[1]["itl_mean_s"]
    assert rows[0]["decode_steps_stalled"] == 16 and rows[1]["decode_steps_stalled"] == 4
    cached = cm.prefill(f, "ep-split", 2, hw, 2048 + 64, 512, start=2048)
    assert (
        cached["chunks"] == 1
        and cached["ttft_s"] < 0.1 * cm.prefill(f, "ep-split", 2, hw, 2048 + 64, 512)["ttft_s"]
    )


def test_mla_expansion_dominates_a_short_chunk_after_a_long_cache_and_absorbed_removes_it(cfg):
    """mlx-lm expands the cached latent to per-head K/V at every chunk: for a 64-token
    turn after 20K cached tokens that is ~0.44 of the chunk's FLOPs on real K3; the
    absorbed form attends over the latents (wider: 2 x 512 + 64) at under half the
    attention FLOPs there."""
    f = cm.facts(cfg, cm.PROFILES["mxfp4"])
    hw = cm.Hardware()
    ex = cm.prefill_chunk(f, "ep-split", 2, hw, 64, 20480)
    ab = cm.prefill_chunk(f, "ep-split", 2, hw, 64, 20480, mla="absorbed")
    assert 0.3 < ex["mla_expand_flops"] / ex["flops"] < 0.6 and ab["mla_expand_flops"] == 0
    assert ab["attention_flops"] < 0.5 * ex["attention_flops"]
    assert ab["flops"] - ab["attention_flops"] == pytest.approx(ex["flops"] - ex["attention_flops"])
    assert ab["time_s"]["total"] < 0.8 * ex["time_s"]["total"]
