"""The rehearsal preset (issue 26): ``k3counts`` writes exactly the real K3's index
(497,220 names in Moonshot's 96 shard files, the same key -> shard map, the same
dtypes) and config counts, only widths shrunk. Checked on the generator's layout
function (what ``synthesize`` writes, file by file), not by writing the 0.7 GB."""

from __future__ import annotations

from k3dist.factory import bpe, moonshot, synth
from k3dist.format import layout
from k3dist.format.folder import REAL_K3_INDEX, read_index

import numpy as np
import pytest

PRESET = synth.PRESETS["k3counts"]


def real_index() -> dict[str, str]:
    return read_index(REAL_K3_INDEX)["weight_map"]


@pytest.fixture(scope="module")
def preset_cfg():
    return synth.make_config(PRESET, PRESET.base_vocab + 256)


def test_index_equals_the_real_one(preset_cfg):
    real = real_index()
    files = moonshot.files_of(preset_cfg)
    mine = {s.name: f for f, specs in files.items() for s in specs}
    assert len(mine) == len(real) == 497_220 and len(files) == 96
    assert set(mine) == set(real)
    wrong = [(k, mine[k], real[k]) for k in real if mine[k] != real[k]]
    assert not wrong, wrong[:5]
    # dtypes: the real layout's (its sizes add up to the real total_size exactly)
    real_specs = layout.source_specs(synth.real_config())
    dtypes = {s.name: s.dtype for specs in files.values() for s in specs}
    assert dtypes == {s.name: s.dtype for s in real_specs}
    assert sum(s.nbytes for s in real_specs) == 1_560_860_324_864


def test_config_has_every_real_count_and_g64_experts(preset_cfg):
    real, tc = synth.real_config()["text_config"], preset_cfg["text_config"]
    for k in (
        "num_hidden_layers",
        "attn_res_block_size",
        "num_experts",
        "num_experts_per_token",
        "num_shared_experts",
        "first_k_dense_replace",
        "moe_layer_freq",
        "vocab_size",
        "linear_attn_config",
    ):
        if k == "linear_attn_config":
            for sub in ("kda_layers", "full_attn_layers"):
                assert tc[k][sub] == real[k][sub]
        else:
            assert tc[k] == real[k], k
    assert preset_cfg["vision_config"]["vt_num_hidden_layers"] == 27
    assert tc["moe_intermediate_size"] % 64 == 0 and tc["routed_expert_hidden_size"] % 64 == 0
    assert tc["hidden_size"] < real["hidden_size"]


def test_tokenizer_has_the_real_vocabulary_size(tmp_path):
    ranks = bpe.padded_ranks(bpe.mini_tokenizer(512), PRESET.base_vocab)
    from k3dist.format import tokens

    assert tokens.write_tokenizer_files(tmp_path, ranks) == 163_840
    enc = tokens.load_encoding(tmp_path)
    assert enc.n_vocab == 163_840
    text = "The experts live in memory; decoding gives back the same bytes."
    assert enc.decode(enc.encode(text)) == text


def test_grade_runs_of_experts_equal_one_at_a_time(mini_build, tmp_path, monkeypatch):
    """The lo bank, re-quantized a run of consecutive experts per call (runs cut at the
    promoted ones and at CHUNK_BYTES, here 3 experts), holds for each expert exactly
    the bytes of quantizing it alone."""
    from k3dist.format.graded import LO
    from k3dist.format.sfile import mx_to_bytes, read_bytes, read_header
    from k3dist.pipeline import promote

    import mlx.core as mx

    assert promote.expert_runs([0, 1, 2, 5, 6, 9], 2) == [(0, 2), (2, 1), (5, 2), (9, 1)]
    layer, hi = 1, [3, 4, 9]
    src = read_header(mini_build / f"model-layer-{layer:03d}.safetensors").tensors
    p = f"language_model.model.layers.{layer}.mlp"
    w, s = src[f"{p}.switch_mlp.gate_proj.weight"], src[f"{p}.switch_mlp.gate_proj.scales"]
    E, rows = w.shape[0], w.shape[1]
    monkeypatch.setattr(promote, "CHUNK_BYTES", 3 * w.nbytes // E)
    out = promote.grade(mini_build, tmp_path / "g", {layer: hi}, 2, lo="2bit-g32", progress=False)
    got = read_header(out / f"model-layer-{layer:03d}.safetensors").tensors
    lo = [e for e in range(E) if e not in hi]
    parts = {k: read_bytes(got[f"{p}.{LO}.gate_proj.{k}"]) for k in ("weight", "scales", "biases")}
    for i, e in enumerate(lo):
        wq = mx.array(np.frombuffer(read_bytes(w, e * w.nbytes // E, w.nbytes // E), np.uint32))
        sq = mx.array(np.frombuffer(read_bytes(s, e * s.nbytes // E, s.nbytes // E), np.uint8))
        dense = mx.dequantize(
            wq.reshape(rows, -1),
            sq.reshape(rows, -1),
            mode="mxfp4",
            group_size=32,
            bits=4,
            dtype=mx.bfloat16,
        )
        alone = dict(
            zip(
                ("weight", "scales", "biases"),
                mx.quantize(dense, group_size=32, bits=2, mode="affine"),
                strict=True,
            )
        )
        for k, a in alone.items():
            b = mx_to_bytes(a)
            assert parts[k][i * len(b) : (i + 1) * len(b)] == b, (e, k)
