"""benchmarks/speed/ep_vs_tp_pp.py's core on mini-K3 under mlx.launch -n 2: the report's
structure, greedy agreement of every mode, positive ratios. No timing assertions."""

from __future__ import annotations

import dataclasses
import json
import platform
import shlex

import k3dist
from k3dist.bench import compare, record, routing
from k3dist.factory import synth
from k3dist.format import layout
from k3dist.pipeline import convert

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from util import failed_ranks, load_f32, mlx_launch, prompt_ids

FAST = (
    "--prompt-len",
    "12",
    "--prefill-rounds",
    "1",
    "--decode-rounds",
    "2",
    "--steps-per-round",
    "2",
    "--warmup-steps",
    "1",
    "--calib-len",
    "16",
    "--comm-trials",
    "3",
    "--batches",
    "1",
    "2",
)


@pytest.fixture(scope="module")
def mini_tp_build(tmp_path_factory):
    """mini with experts twice as wide: mlx-lm's TP splits each expert's intermediate
    dimension, and mini's 32 over 2 ranks is half an mxfp4 group (32)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(
            synth.PRESETS,
            "mini-tp",
            dataclasses.replace(synth.PRESETS["mini"], moe_intermediate_size=64),
        )
        src = synth.synthesize(
            tmp_path_factory.mktemp("src") / "mini-tp", "mini-tp", progress=False
        )
    return convert.convert(src, tmp_path_factory.mktemp("build") / "mini-tp", progress=False)


def _compare(build, out, *extra):
    r = mlx_launch(
        2,
        "benchmarks/speed/ep_vs_tp_pp.py",
        "--build",
        str(build),
        *FAST,
        *extra,
        "--out",
        str(out),
        timeout=400,
    )
    assert r.returncode == 0 and not failed_ranks(r), r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


def test_compare_all_modes(mini_tp_build, tmp_path):
    rep = _compare(mini_tp_build, tmp_path / "c.json")
    # the exact command (repository-relative, no machine path) and the versions that ran
    assert rep["command"] == shlex.join(
        [
            "python",
            "benchmarks/speed/ep_vs_tp_pp.py",
            "--build",
            str(mini_tp_build),
            *FAST,
            "--out",
            str(tmp_path / "c.json"),
        ]
    )
    assert rep["versions"] == {
        "k3dist": k3dist.__version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
    }
    assert rep["settings"]["prompt_len"] == int(FAST[FAST.index("--prompt-len") + 1])
    assert rep["size"] == 2 and len(rep["ranks"]) == 2 and rep["skipped"] == {}
    assert rep["blas"].get("threads") in (None, 1)  # None: no OpenBLAS on this machine
    assert (tmp_path / "c.png").stat().st_size > 0
    modes = {"ep_contiguous", "ep_load_aware", "ep_split", "tp", "pp", "single"}
    batched = {f"{m}@b2" for m in ("ep_contiguous", "ep_split", "tp", "pp")}
    g = rep["greedy_tokens"]
    assert set(g["tokens"]) == modes
    assert g["all_modes_agree"], g["vs_single"]
    assert all(g["identical_across_ranks"].values())
    # a batch's first row is the batch-1 prompt: the same greedy tokens
    assert set(g["batch_row0_vs_batch1"]) == batched
    assert all(v["same_as_batch1"] for v in g["batch_row0_vs_batch1"].values()), g[
        "batch_row0_vs_batch1"
    ]
    # each ratio is the other mode's time / EP's, per interleaved round, then the median
    tr = rep["ranks"][0]["trials"]
    for ep, tag in (("ep_contiguous", "ep"), ("ep_load_aware", "ep_la")):
        for other in ("tp", "pp", "single"):
            d = [
                np.mean(o) / np.mean(e)
                for o, e in zip(tr[other]["decode_ms"], tr[ep]["decode_ms"], strict=True)
            ]
            p = [o / e for o, e in zip(tr[other]["prefill_s"], tr[ep]["prefill_s"], strict=True)]
            assert rep["ratios"][f"{tag}_over_{other}_decode"] == pytest.approx(
                np.median(d), abs=1e-4
            )
            assert rep["ratios"][f"{tag}_over_{other}_prefill"] == pytest.approx(
                np.median(p), abs=1e-4
            )
    for r in rep["ranks"]:
        assert set(r["trials"]) == modes | batched | set(compare.COMPUTE_ONLY.values())
        for n, t in r["trials"].items():
            assert len(t["prefill_s"]) == (0 if n in batched else 1)
            assert [len(x) for x in t["decode_ms"]] == [2, 2]
        # counted from the running models: all_sums per decode token; attention split
        # halves the attention bytes a rank holds
        c = r["counted"]
        assert c["ep_contiguous"]["collectives_per_token"] == 5  # mini: 5 MoE layers
        assert c["tp"]["collectives_per_token"] == 5 + 6 + 1
        assert c["ep_split"]["collectives_per_token"] > 5
        assert (
            c["ep_split"]["weight_bytes"]["attention"]
            < 0.6 * c["ep_contiguous"]["weight_bytes"]["attention"]
        )
        # EP holds half the routed experts; TP a shard of everything
        w = r["weights_bytes"]
        assert w["ep_contiguous"] < w["single"] and w["tp"] < w["single"]
    s = rep["summary"]
    assert s["ep_contiguous"]["split"]["all_sums_per_step"] == 5  # mini: 5 MoE layers
    # the structural plan agrees with the count
    assert (
        s["ep_split"]["split"]["all_sums_per_step"]
        == rep["ranks"][0]["counted"]["ep_split"]["collectives_per_token"]
    )
    for B in (1, 2):
        assert s[compare.batch_name("ep_split", B)]["decode_tok_s_aggregate"] == pytest.approx(
            B * s[compare.batch_name("ep_split", B)]["decode_tok_s"], rel=1e-3
        )
    assert rep["ratios"]["ep_split_batch2_over_batch1"] > 0
    assert rep["ratios"]["ep_split_over_tp_decode"] > 0
    tp = {
        c["what"]: c["count"] for c in rep["ranks"][0]["collectives"]["tp"]["decode"]["collectives"]
    }
    assert tp == {"moe routed+shared": 5, "sharded-to-all linear": 6 + 1}  # attn x6, dense mlp
    pp = [c["op"] for c in rep["ranks"][0]["collectives"]["pp"]["decode"]["collectives"]]
    assert sorted(pp) == ["all_gather", "send_recv"]


def test_compare_reports_tp_it_cannot_run(mini_build, tmp_path):
    rep = _compare(mini_build, tmp_path / "c.json", "--batches", "1")
    assert "moe_intermediate_size" in rep["skipped"]["tp"]
    assert "tp" not in rep["greedy_tokens"]["tokens"]
    assert rep["greedy_tokens"]["all_modes_agree"]
    assert "ep_over_tp_decode" not in rep["ratios"] and rep["ratios"]["ep_over_pp_decode"] > 0


def test_routing_counts(mini_build):
    model, config = load_f32(mini_build)
    tc = config["text_config"]
    prompt = prompt_ids(tc["vocab_size"], 24)
    counts = routing.routing_counts(model, prompt)
    assert sorted(counts) == layout.moe_layers(tc)
    for c in counts.values():
        assert c.shape == (tc["num_experts"],) and c.sum() == 24 * tc["num_experts_per_token"]
    assert not any(isinstance(layer.mlp, routing._RouteRecorder) for layer in model.layers)


def test_stats_and_gather():
    s = record.stats([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["p10"] < s["median"] < s["p90"] and s["n"] == 5
    assert record.gather_json({"a": [1, 2]}, None) == [{"a": [1, 2]}]
    assert np.isclose(compare._ratio_rounds([2.0, 3.0], [1.0, 3.0]), [2.0, 1.0]).all()
