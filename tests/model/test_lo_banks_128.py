"""Lo banks at group 64 and 128 (issue 27): on routed experts 128 wide (synth preset
``mini128``), ``grade`` writes 2-bit g128 / g64 and 3-bit g64 lo banks bit for bit as
``mx.quantize`` of the dequantized MXFP4 expert, at the planner's bytes, and graded
builds run on ranks exactly like one process (g128 on two, 3-bit g64 on four). Also the
unigram floor that a trained mini-K3's held-out perplexity is compared with."""

from __future__ import annotations

import json

from k3dist.bench.evaluate import expert_bytes
from k3dist.bench.greedy import greedy
from k3dist.factory import quality, synth
from k3dist.factory.export import MAX_EXPORT_BYTES
from k3dist.format import layout
from k3dist.format.qformat import QFormat
from k3dist.model import two_bank
from k3dist.pipeline import convert, promote, slicing

import mlx.core as mx
import numpy as np
import pytest
from util import generate_on_ranks

PROMOTED = [1, 4, 9, 14]  # of 16 per MoE layer, 2 per rank; k_hi 1: drops happen
LAYER = 2


@pytest.fixture(scope="module")
def build128(tmp_path_factory):
    d = tmp_path_factory.mktemp("m128")
    src = synth.synthesize(d / "src", "mini128", seed=0, progress=False)
    return convert.convert(src, d / "build", progress=False)


@pytest.fixture(scope="module")
def moe(build128):
    return layout.moe_layers(layout.text_config(json.loads((build128 / "config.json").read_text())))


@pytest.mark.parametrize("lo", ["2bit-g128", "2bit-g64", "3bit-g64"])
def test_lo_bank_values_and_bytes(build128, moe, lo, tmp_path):
    q = QFormat.parse(lo)
    uniform = promote.grade(build128, tmp_path / "u", {i: [] for i in moe}, 1, lo, progress=False)
    eb = expert_bytes(uniform)
    assert eb.bpw == pytest.approx(q.bpw) and q.bpw == q.bits + 32 / q.group_size
    assert eb.bytes == eb.params * q.bpw / 8  # the planner's byte arithmetic
    name = f"language_model.model.layers.{LAYER}.mlp.switch_mlp.down_proj"
    src = mx.load(str(build128 / f"model-layer-{LAYER:03d}.safetensors"))
    got = mx.load(str(uniform / f"model-layer-{LAYER:03d}.safetensors"))
    e = 3
    dense = mx.dequantize(
        src[f"{name}.weight"][e],
        src[f"{name}.scales"][e],
        mode="mxfp4",
        group_size=32,
        bits=4,
        dtype=mx.bfloat16,
    )
    qw, qs, qb = mx.quantize(dense, group_size=q.group_size, bits=q.bits)
    assert dense.shape[-1] == 128 and got[f"{name}.scales"].shape[-1] == 128 // q.group_size
    assert np.array_equal(np.array(got[f"{name}.weight"][e]), np.array(qw))
    for k, want in (("scales", qs), ("biases", qb)):
        assert np.array_equal(
            np.array(got[f"{name}.{k}"][e].astype(mx.float32)), np.array(want.astype(mx.float32))
        ), k


# (lo bank, promoted experts a layer, ranks): the g128 case drops routes (k_hi 1); the
# 3-bit g64 one with nothing promoted is what the K3-count rehearsal's planner chose
# (docs/n-boxes.md), at 4 ranks
@pytest.mark.parametrize(
    "lo,promoted,size", [("2bit-g128", PROMOTED, 2), ("3bit-g64", [], 4)], ids=["g128", "3bit-g64"]
)
def test_graded_build_on_ranks_equals_single_process(build128, moe, lo, promoted, size, tmp_path):
    graded = promote.grade(
        build128, tmp_path / "g", {i: promoted for i in moe}, 1, lo, progress=False
    )
    model, config = two_bank.load_build(graded)
    model.count_routes(True)
    vocab = config["text_config"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab - 256, size=40).tolist()
    tokens, logits = greedy(model, prompt, 16)
    if promoted:
        assert model.route_stats()["dropped_routes"] > 0
    ranks = str(tmp_path / "ranks" / "rank{rank}")
    slicing.slice_all(graded, ranks, size, progress=False)
    runs = generate_on_ranks(ranks, tmp_path, prompt, 16, n=size)
    for x in runs:
        assert x["tokens"].tolist() == tokens
        assert np.array_equal(x["logits"], runs[0]["logits"])
    assert max(float(np.abs(x["logits"] - logits).max()) for x in runs) < 1e-4


def test_unigram_floor():
    """A unigram model of the train split: far better than a uniform guess (4,352 ids),
    far worse than the shipped mini-K3 (held-out ppl ~81 code / ~145 prose)."""
    u = quality.unigram(256, 4)
    for dom, row in u.items():
        assert row["tokens"] == 4 * 256
        assert 200 < row["ppl"] < 4352, (dom, row)
        assert row["nll"] == pytest.approx(np.log(row["ppl"]), abs=1e-3)


def test_shipped_sparse_mini_k3():
    """data/mini-k3-sparse (issue 27): Moonshot's format, 128-wide experts and latent
    (2-bit g64/g128 exist), 128 experts top-8, 2 shared, trained and MXFP4-frozen, and
    held-out perplexity below the unigram floor in every domain (first 4 windows)."""
    from k3dist.factory.corpus import DATA_DIR
    from k3dist.format.folder import load_config
    from k3dist.pipeline.audit import audit
    from k3dist.pipeline.checkpoint import format_table

    shipped = DATA_DIR / "mini-k3-sparse"
    report = audit(shipped)
    assert report.ok, format_table(report)
    assert sum(f.stat().st_size for f in shipped.iterdir()) <= MAX_EXPORT_BYTES
    tc = layout.text_config(load_config(shipped))
    assert tc["moe_intermediate_size"] % 128 == 0 and tc["routed_expert_hidden_size"] % 128 == 0
    assert (tc["num_experts"], tc["num_experts_per_token"], tc["num_shared_experts"]) == (128, 8, 2)
    prov = json.loads((shipped / "training.json").read_text())
    assert prov["phase"] == "freeze" and prov["step"] > prov["phase_start"] > 0
    ppl = quality.perplexity(quality.load_teacher(shipped), 256, 4)
    floor = quality.unigram(256, 4)
    for dom in floor:
        assert ppl[dom]["ppl"] < 0.75 * floor[dom]["ppl"], (dom, ppl[dom], floor[dom])
