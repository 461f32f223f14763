"""Rank folders that do not belong to the running group are refused with a clear
error before any model collective, on every rank, without hanging."""

from __future__ import annotations

import json
import shutil

from k3dist.format import layout, placement
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import convert, slicing
from k3dist.serve import loader

import pytest
from util import failed_ranks, mlx_launch


@pytest.fixture(scope="module")
def ranks2(mini_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks2")
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    plc = placement.contiguous(tc["num_experts"], 2, moe)
    for r in range(2):
        slicing.slice_rank(mini_build, out / f"rank{r}", r, 2, plc, progress=False)
    return out


def _run(n, rank_dir):
    return mlx_launch(
        n, "launch/generate.py", "--rank-dir", rank_dir, "--max-tokens", "2", timeout=120
    )


def test_size_mismatch_refused(ranks2, tmp_path):
    for r in range(4):
        shutil.copytree(ranks2 / f"rank{r % 2}", tmp_path / f"rank{r}")
    res = _run(4, str(tmp_path / "rank{rank}"))
    assert failed_ranks(res)
    assert "sliced for 2 ranks but the group has 4" in res.stderr


def test_wrong_rank_refused(ranks2):
    res = _run(2, str(ranks2 / "rank0"))  # both ranks given rank 0's folder
    assert 1 in failed_ranks(res)
    assert "holds rank 0's experts but this process is rank 1" in res.stderr


def test_other_build_refused_on_every_rank(ranks2, mini_src, tmp_path):
    b8 = convert.convert(mini_src, tmp_path / "b8", nonexpert_bits=8, progress=False)
    m = json.loads((ranks2 / "rank0" / "k3dist.json").read_text())
    plc = placement.Placement.from_json(m["placement"])
    shutil.copytree(ranks2 / "rank0", tmp_path / "mix" / "rank0")
    slicing.slice_rank(b8, tmp_path / "mix" / "rank1", 1, 2, plc, progress=False)
    res = _run(2, str(tmp_path / "mix" / "rank{rank}"))
    assert failed_ranks(res)
    assert "different builds or placements" in res.stderr
    assert m["build_hash"] in res.stderr


def test_missing_expert_tensor_refused(ranks2, tmp_path):
    bad = tmp_path / "rank1"
    shutil.copytree(ranks2 / "rank1", bad)
    idx_path = bad / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    name = "language_model.model.layers.3.mlp.switch_mlp.down_proj.weight"
    del idx["weight_map"][name]
    idx_path.write_text(json.dumps(idx))
    # a folder made that way (not damaged after the fact): the manifest agrees
    mpath = bad / "k3dist.json"
    m = json.loads(mpath.read_text())
    m["files"]["model.safetensors.index.json"]["bytes"] = idx_path.stat().st_size
    mpath.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="switch_mlp.down_proj.weight.*missing"):
        loader.check_rank_folder(bad, 1, 2)


def test_not_a_rank_folder(mini_build):
    with pytest.raises(CheckpointError, match="not a rank folder"):
        loader.check_rank_folder(mini_build, 0, 1)


def test_folder_of_the_other_attention_mode_refused(ranks2):
    """Sliced with attention split (the default); a deployment asking for replicated is
    refused naming the folder and the fix, and the other way round; one rank has
    nothing to split, so it takes either."""
    folder = ranks2 / "rank0"
    m, _ = loader.check_rank_folder(folder, 0, 2, attention="split")
    assert m["attention"] == {"mode": "split", "split_layers": list(range(6))}
    with pytest.raises(loader.RankMismatch) as e:
        loader.check_rank_folder(folder, 0, 2, attention="replicated")
    msg = str(e.value)
    assert str(folder) in msg and "sliced with attention split" in msg
    assert "--attention replicated" in msg
    rep = dict(m, attention={"mode": "replicated", "split_layers": []})
    with pytest.raises(loader.RankMismatch, match="slice again with --attention split"):
        loader.check_attention(folder, rep, "split")
    loader.check_attention(folder, dict(rep, size=1), "split")


def test_folder_of_another_placement_refused(mini_build, tmp_path):
    """A deployment naming its boxes takes only folders placed by memory for those
    boxes (in that order); a folder placed otherwise is refused naming the fix."""
    boxes = [512.0, 256.0, 256.0]
    by_mem = slicing.placement_for(mini_build, 3, boxes=boxes)
    mem = slicing.slice_rank(mini_build, tmp_path / "mem0", 0, 3, by_mem, progress=False)
    _, plc = loader.check_rank_folder(mem, 0, 3, boxes=boxes)
    assert plc == by_mem and plc.counts(1) == [8, 4, 4]
    with pytest.raises(loader.RankMismatch) as e:
        loader.check_rank_folder(mem, 0, 3, boxes=[256, 256, 512])
    msg = str(e.value)
    assert str(mem) in msg and "by-memory for shares 512:256:256" in msg
    assert "slice again with --boxes 256,256,512" in msg
    even = slicing.slice_rank(mini_build, tmp_path / "even0", 0, 3, progress=False)
    with pytest.raises(loader.RankMismatch, match="placed by-shares for shares 1:1:1"):
        loader.check_rank_folder(even, 0, 3, boxes=boxes)
    loader.check_rank_folder(even, 0, 3)  # a deployment naming no boxes takes either
