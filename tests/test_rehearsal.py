"""The rehearsal preset (issue 26): ``k3counts`` writes exactly the real K3's index
(497,220 names in Moonshot's 96 shard files, the same key -> shard map, the same
dtypes) and config counts, only widths shrunk. Checked on the generator's layout
function (what ``synthesize`` writes, file by file), not by writing the 0.7 GB."""

from __future__ import annotations

import gzip
import json
from importlib import resources

from k3dist.factory import bpe, synth
from k3dist.format import layout

import pytest

PRESET = synth.PRESETS["k3counts"]


def real_index() -> dict[str, str]:
    raw = resources.files("k3dist").joinpath("data/kimi-k3-model.safetensors.index.json.gz")
    return json.loads(gzip.decompress(raw.read_bytes()))["weight_map"]


@pytest.fixture(scope="module")
def preset_cfg():
    return synth.make_config(PRESET, PRESET.base_vocab + 256)


def test_index_equals_the_real_one(preset_cfg):
    real = real_index()
    files = synth.files_of(preset_cfg)
    mine = {s.name: f for f, specs in files.items() for s in specs}
    assert len(mine) == len(real) == 497_220 and len(files) == 96
    assert set(mine) == set(real)
    wrong = [(k, mine[k], real[k]) for k in real if mine[k] != real[k]]
    assert not wrong, wrong[:5]
    # dtypes: the real layout's (its sizes add up to the real total_size exactly)
    real_dtypes = {s.name: s.dtype for s in layout.source_specs(synth.real_config())}
    dtypes = {s.name: s.dtype for specs in files.values() for s in specs}
    assert dtypes == real_dtypes
    assert sum(s.nbytes for s in layout.source_specs(synth.real_config())) == 1_560_860_324_864


def test_config_has_every_real_count_and_g64_experts(preset_cfg):
    real, tc = synth.real_config()["text_config"], preset_cfg["text_config"]
    for k in ("num_hidden_layers", "attn_res_block_size", "num_experts",
              "num_experts_per_token", "num_shared_experts", "first_k_dense_replace",
              "moe_layer_freq", "vocab_size", "linear_attn_config"):
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
