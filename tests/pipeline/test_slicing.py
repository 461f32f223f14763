"""Rank folders: exactly the owned experts (byte-compared with the build), every
non-expert tensor (attention split: each rank its share, the shares reassembling the
build's bytes), resume, refusals before anything is written, the source route
byte-identical to the build route, and the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from k3dist.config.deployment import load_deployment
from k3dist.format import layout, manifest
from k3dist.format.manifest import JOURNAL
from k3dist.format.placement import Placement, PlacementError, contiguous, load_aware
from k3dist.format.sfile import CheckpointError, read_bytes, read_header
from k3dist.pipeline import convert as convert_mod
from k3dist.pipeline import slicing

import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slicing" / "rank_split.py"
MOE = [1, 2, 3, 4, 5]  # the mini config's MoE layers
E = 16


def tensors(folder: Path) -> dict:
    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    headers = {f: read_header(folder / f) for f in set(idx.values())}
    return {n: headers[f].tensors[n] for n, f in idx.items()}


def expert_bytes(folder: Path) -> int:
    return sum(t.nbytes for n, t in tensors(folder).items() if slicing.stacked_layer(n) is not None)


def skewed_placement(size: int, seed: int = 0) -> Placement:
    rng = np.random.default_rng(seed)
    counts = {layer: rng.pareto(1.2, E) * 1000 for layer in MOE}
    return load_aware(counts, size)


def placements(build: Path) -> dict[str, Placement]:
    return {
        "contiguous-2": slicing.placement_for(build, 2),
        "contiguous-4": slicing.placement_for(build, 4),
        "load-aware-4": skewed_placement(4),
        # uneven: each layer's 16 experts 8:4:4 by the boxes' memory
        "by-memory-3": slicing.placement_for(build, 3, boxes=[512, 256, 256]),
    }


def _array(t) -> np.ndarray:
    """A tensor's raw bytes as [*shape, itemsize] uint8 (dtype-agnostic slicing)."""
    return np.frombuffer(read_bytes(t), np.uint8).reshape(*t.shape, -1)


def assert_split_reassembles(build: Path, folders: list[Path]) -> int:
    """Every tensor a rank holds a share of: the ranks' shares, put back together along
    the tensor's split axis (per segment), are the build's bytes. Returns how many."""
    tc = layout.text_config(json.loads((build / "config.json").read_text()))
    full = tensors(build)
    ranks = [tensors(f) for f in folders]
    split = set(
        manifest.attention_of(json.loads((folders[0] / "k3dist.json").read_text()))["split_layers"]
    )
    n = 0
    for name, g in full.items():
        rule = layout.split_rule(tc, name) if layout.layer_of(name) in split else None
        if rule is None or slicing.stacked_layer(name) is not None:
            continue
        axis, segments = rule
        axis %= len(g.shape)
        parts = [np.split(_array(r[name]), segments, axis=axis) for r in ranks]
        got = np.concatenate([p[s] for s in range(segments) for p in parts], axis=axis)
        assert np.array_equal(got, _array(g)), name
        n += 1
    return n


def mtimes(folder: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.mark.parametrize("which", ["contiguous-2", "contiguous-4", "load-aware-4", "by-memory-3"])
def test_each_rank_holds_exactly_its_experts(mini_build, tmp_path, which):
    placement = placements(mini_build)[which]
    size = placement.size
    if which.startswith("load-aware"):  # the point of this case: non-contiguous ranges
        assert any(placement.experts_of(L, 0) != list(range(E // size)) for L in MOE)
    build = tensors(mini_build)
    build_manifest = json.loads((mini_build / "k3dist.json").read_text())
    paths = slicing.slice_all(
        mini_build, str(tmp_path / "rank{rank}"), size, placement, progress=False
    )
    if which == "by-memory-3":
        assert [placement.counts(L) for L in MOE] == [[8, 4, 4]] * len(MOE)
    total = 0
    # the mini's 4 KDA and 4 MLA heads divide 2 and 4 ways, not 3
    split = set(range(6)) if 4 % size == 0 else set()
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    for rank, folder in enumerate(paths):
        m = manifest.verify(folder, "rank", sha256=True)
        assert m["attention"] == {"mode": "split", "split_layers": sorted(split)}
        assert (m["kind"], m["rank"], m["size"]) == ("rank", rank, size)
        assert m["build_hash"] == build_manifest["build_hash"]
        assert m["placement_hash"] == placement.hash
        assert Placement.from_json(m["placement"]).hash == placement.hash
        assert m["expert_bytes"] == expert_bytes(folder)
        total += m["expert_bytes"]
        assert (folder / "config.json").read_bytes() == (mini_build / "config.json").read_bytes()
        for name in ("tiktoken.model", "tokenizer_config.json"):
            assert (folder / name).read_bytes() == (mini_build / name).read_bytes()
        idx = json.loads((folder / "model.safetensors.index.json").read_text())
        # the vision tower only where it runs (slicing.vision_ranks: rank 0)
        vis = rank in slicing.vision_ranks(size)
        want = {
            n: f
            for n, f in json.loads((mini_build / "model.safetensors.index.json").read_text())[
                "weight_map"
            ].items()
            if vis or not n.startswith(("vision_tower.", "mm_projector."))
        }
        assert idx["weight_map"] == want
        assert sorted(p.name for p in folder.glob("*.safetensors")) == sorted(
            p.name
            for p in mini_build.glob("*.safetensors")
            if vis or p.name != "model-vision.safetensors"
        )

        mine_all = tensors(folder)
        assert set(mine_all) == set(want)
        stacks = 0
        for name, t in mine_all.items():
            g = build[name]
            layer = slicing.stacked_layer(name)
            assert t.dtype == g.dtype
            if layer is None and layout.layer_of(name) in split and layout.split_rule(tc, name):
                axis, segments = layout.split_rule(tc, name)
                assert t.shape[axis] * size == g.shape[axis], name
                continue  # bytes: assert_split_reassembles below
            if layer is None:
                assert t.shape == g.shape and read_bytes(t) == read_bytes(g), name
                continue
            stacks += 1
            mine = placement.experts_of(layer, rank)
            assert t.shape == (len(mine), *g.shape[1:]), name
            per = g.nbytes // E
            local, glob = read_bytes(t), read_bytes(g)
            for i, e in enumerate(mine):
                assert local[i * per : (i + 1) * per] == glob[e * per : (e + 1) * per], (name, e)
        assert stacks == len(MOE) * 6
        # MLX itself parses the files and sees the local stacks
        arr = mx.load(str(folder / "model-layer-003.safetensors"))
        w = arr["language_model.model.layers.3.mlp.switch_mlp.down_proj.weight"]
        assert w.shape[0] == len(placement.experts_of(3, rank))
    assert total == expert_bytes(mini_build)
    if split:
        assert assert_split_reassembles(mini_build, paths) == 4 * 8 + 2 * 5 + 3  # KDA, MLA, dense


def test_quantized_attention_splits_at_whole_groups(mini_src, tmp_path):
    """8-bit non-expert tensors at group 32: weights, scales and biases split together;
    at group 64 o_proj's 64 inputs are one group, so no layer splits (replicated)."""
    b32 = convert_mod.convert(
        mini_src, tmp_path / "b32", nonexpert_bits=8, group_size=32, progress=False
    )
    paths = slicing.slice_all(b32, str(tmp_path / "r32" / "rank{rank}"), 2, progress=False)
    n = assert_split_reassembles(b32, paths)
    assert n > 4 * 8 + 2 * 5 + 3  # scales and biases too
    t0 = tensors(paths[0])
    assert t0["language_model.model.layers.1.self_attn.o_proj.scales"].shape == (64, 1)
    assert manifest.attention_of(manifest.verify(paths[1], "rank"))["split_layers"] == list(
        range(6)
    )
    b64 = convert_mod.convert(mini_src, tmp_path / "b64", nonexpert_bits=8, progress=False)
    out = slicing.slice_rank(b64, tmp_path / "r64", 0, 2, progress=False)
    assert manifest.attention_of(manifest.verify(out, "rank")) == {
        "mode": "split",
        "split_layers": [],
    }
    with pytest.raises(CheckpointError, match="convert it first"):
        slicing.slice_rank(
            mini_src, tmp_path / "src-split", 0, 2, attention="split", progress=False
        )


def test_resume_after_interruption(mini_build, tmp_path, monkeypatch):
    placement = skewed_placement(2)
    clean = slicing.slice_rank(mini_build, tmp_path / "clean", 1, 2, placement, progress=False)

    out = tmp_path / "resumed"
    first = "model-layer-000.safetensors"
    fail_at = len(read_header(mini_build / first).tensors) + 30  # inside layer 1's experts
    calls = {"n": 0}
    real = slicing.read_bytes

    def failing(info, *a, **k):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise KeyboardInterrupt("simulated crash")
        return real(info, *a, **k)

    monkeypatch.setattr(slicing, "read_bytes", failing)
    with pytest.raises(KeyboardInterrupt):
        slicing.slice_rank(mini_build, out, 1, 2, placement, progress=False)
    journal = json.loads((out / JOURNAL).read_text())
    assert list(journal["done"]) == [first]
    assert not (out / "model-layer-001.safetensors").exists()  # no complete-looking file
    assert not (out / "k3dist.json").exists()
    with pytest.raises(CheckpointError, match="unfinished slicing"):
        manifest.verify(out, "rank")

    monkeypatch.setattr(slicing, "read_bytes", real)
    slicing.slice_rank(mini_build, out, 1, 2, placement, progress=False)
    a = json.loads((out / "k3dist.json").read_text())
    b = json.loads((clean / "k3dist.json").read_text())
    assert a["files"] == b["files"]  # same bytes as an uninterrupted run
    assert not list(out.glob("*.partial")) and not (out / JOURNAL).exists()


def test_source_route_resumes(mini_src, mini_build, tmp_path, monkeypatch):
    placement = skewed_placement(2)
    out = tmp_path / "src-resumed"
    calls = {"n": 0}
    real = convert_mod.iter_chunks

    def failing(info, *a, **k):
        calls["n"] += 1
        if calls["n"] == 20:  # layer 1: 8 experts x 6 tensors
            raise KeyboardInterrupt("simulated crash")
        yield from real(info, *a, **k)

    monkeypatch.setattr(convert_mod, "iter_chunks", failing)
    with pytest.raises(KeyboardInterrupt):
        slicing.slice_rank(mini_src, out, 0, 2, placement, progress=False)
    assert list(json.loads((out / JOURNAL).read_text())["done"]) == ["layer.0"]
    monkeypatch.setattr(convert_mod, "iter_chunks", real)
    slicing.slice_rank(mini_src, out, 0, 2, placement, progress=False)
    ref = slicing.slice_rank(
        mini_build, tmp_path / "ref", 0, 2, placement, progress=False, attention="replicated"
    )
    a = json.loads((out / "k3dist.json").read_text())["files"]
    b = json.loads((ref / "k3dist.json").read_text())["files"]
    assert a == b


@pytest.mark.parametrize("rank", [1, 3])
def test_source_route_byte_identical_to_build_route(mini_src, mini_build, tmp_path, rank):
    assert slicing.is_source(mini_src) and not slicing.is_source(mini_build)
    placement = skewed_placement(4, seed=1)
    a = slicing.slice_rank(mini_src, tmp_path / "from-src", rank, 4, placement, progress=False)
    b = slicing.slice_rank(
        mini_build,
        tmp_path / "from-build",
        rank,
        4,
        placement,
        progress=False,
        attention="replicated",
    )
    ma, mb = manifest.verify(a, "rank", sha256=True), manifest.verify(b, "rank", sha256=True)
    assert (ma["input"], mb["input"]) == ("source", "build")
    assert (
        ma["build_hash"]
        == mb["build_hash"]
        == json.loads((mini_build / "k3dist.json").read_text())["build_hash"]
    )
    assert ma["identity"] == mb["identity"]
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].shape == tb[name].shape, name
        assert read_bytes(ta[name]) == read_bytes(tb[name]), name
    assert ma["files"] == mb["files"]  # whole files, config and tokenizer files too
    assert ma["expert_bytes"] == mb["expert_bytes"]


def test_build_without_manifest(mini_build, tmp_path):
    """An mlx-community-style build (no k3dist.json): hashed from index + config."""
    import hashlib

    build = tmp_path / "community"
    shutil.copytree(mini_build, build)
    (build / "k3dist.json").unlink()
    out = slicing.slice_rank(build, tmp_path / "r", 0, 2, progress=False)
    m = manifest.verify(out, "rank", sha256=True)
    want = hashlib.sha256(
        (build / "model.safetensors.index.json").read_bytes() + (build / "config.json").read_bytes()
    ).hexdigest()[:16]
    assert m["build_hash"] == want
    ref = slicing.slice_rank(mini_build, tmp_path / "ref", 0, 2, progress=False)
    assert m["files"] == json.loads((ref / "k3dist.json").read_text())["files"]


def test_converter_refuses_a_subset_build(mini_src, tmp_path):
    from k3dist.format.source import Source

    conv = convert_mod.Converter(Source(mini_src), tmp_path / "x", experts=lambda L: [0, 1])
    with pytest.raises(ValueError, match="rank folder, not a build"):
        conv.run(progress=False)
    assert not (tmp_path / "x").exists()


def _copy(build: Path, tmp_path: Path, edit=None) -> Path:
    dst = tmp_path / "bad-build"
    shutil.copytree(build, dst)
    if edit:
        edit(dst)
    return dst


def _set_num_experts(folder: Path, n: int) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    cfg["text_config"]["num_experts"] = n
    p.write_text(json.dumps(cfg))


def _unfinished(folder: Path) -> None:
    (folder / "k3dist.json").rename(folder / JOURNAL)


def _truncate(folder: Path) -> None:
    p = folder / "model-layer-002.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


BAD = {
    "rank >= size": (lambda b, t: (b, 2, 2, None), ["--rank 2 must be in 0..1"]),
    "negative rank": (lambda b, t: (b, -1, 2, None), ["--rank -1 must be in 0..1"]),
    "placement of wrong size": (
        lambda b, t: (b, 0, 2, slicing.placement_for(b, 4)),
        ["placement is for 4 ranks but --size is 2"],
    ),
    "placement for 8 experts": (
        lambda b, t: (b, 0, 2, contiguous(8, 2, MOE)),
        ["8 experts per layer", "has 16"],
    ),
    "placement missing a layer": (
        lambda b, t: (b, 0, 2, contiguous(E, 2, MOE[:-1])),
        ["missing [5]"],
    ),
    "placement with an extra layer": (
        lambda b, t: (b, 0, 2, contiguous(E, 2, [0, *MOE])),
        ["extra [0]"],
    ),
    "stack dim != num_experts": (
        lambda b, t: (_copy(b, t, lambda d: _set_num_experts(d, 8)), 0, 2, contiguous(8, 2, MOE)),
        ["switch_mlp", "U32[16,", "num_experts=8"],
    ),
    "unfinished build": (
        lambda b, t: (_copy(b, t, _unfinished), 0, 2, None),
        ["unfinished conversion", "k3dist.pipeline.convert"],
    ),
    "truncated build file": (
        lambda b, t: (_copy(b, t, _truncate), 0, 2, None),
        ["model-layer-002.safetensors", "copy the build again"],
    ),
    "a rank folder as input": (
        lambda b, t: (slicing.slice_rank(b, t / "r0", 0, 2, progress=False), 0, 2, None),
        ["kind 'rank'", "slice the build it came from"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_specific_error_and_nothing_written(mini_build, tmp_path, case):
    make, expect = BAD[case]
    build, rank, size, placement = make(mini_build, tmp_path)
    out = tmp_path / "out"
    with pytest.raises((CheckpointError, PlacementError)) as e:
        slicing.slice_rank(build, out, rank, size, placement, progress=False)
    msg = str(e.value)
    print(f"\n{case}: {msg}")
    for part in expect:
        assert part in msg
    assert not out.exists()


def test_placement_must_own_every_expert_once():
    own = [0] * 8 + [1] * 8
    cases = {
        "duplicated owner entry": (own + [1], "17 owners for 16 experts"),
        "missing owner": (own[:-1], "15 owners for 16 experts"),
        "owner outside the ranks": (own[:-1] + [2], "outside 0..1"),
        "a rank owning nothing": ([0] * 16, "ranks [1] own no expert"),
    }
    for case, (owners, expect) in cases.items():
        with pytest.raises(PlacementError, match=expect.replace("[", r"\[").replace("]", r"\]")):
            Placement.from_json(
                {
                    "size": 2,
                    "num_experts": 16,
                    "kind": "custom",
                    "owners": {str(L): owners for L in MOE},
                }
            )
        print(f"{case}: refused")


def test_refuses_out_folder_of_another_slicing(mini_src, mini_build, tmp_path):
    rep = {"attention": "replicated"}
    out = slicing.slice_rank(mini_build, tmp_path / "r", 0, 2, progress=False, **rep)
    before = mtimes(out)
    bh = json.loads((mini_build / "k3dist.json").read_text())["build_hash"]
    build8 = convert_mod.convert(mini_src, tmp_path / "b8", nonexpert_bits=8, progress=False)
    bh8 = json.loads((build8 / "k3dist.json").read_text())["build_hash"]
    assert bh8 != bh
    with pytest.raises(CheckpointError) as e:
        slicing.slice_rank(build8, out, 0, 2, progress=False, **rep)
    assert f"build_hash: folder has '{bh}', this run '{bh8}'" in str(e.value)
    assert "choose another --out" in str(e.value)
    with pytest.raises(CheckpointError, match="rank: folder has 0, this run 1"):
        slicing.slice_rank(mini_build, out, 1, 2, progress=False, **rep)
    with pytest.raises(CheckpointError, match="placement_hash"):
        slicing.slice_rank(mini_build, out, 0, 2, skewed_placement(2), progress=False, **rep)
    with pytest.raises(CheckpointError, match="attention: folder has 'replicated'"):
        slicing.slice_rank(mini_build, out, 0, 2, progress=False)  # split by default
    assert mtimes(out) == before
    # the same slicing again is a no-op; the source route is the same slicing
    slicing.slice_rank(mini_build, out, 0, 2, progress=False, **rep)
    slicing.slice_rank(mini_src, out, 0, 2, progress=False)
    assert mtimes(out) == before

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a k3dist rank folder"):
        slicing.slice_rank(mini_build, foreign, 0, 2, progress=False)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    with pytest.raises(CheckpointError, match="holds a k3dist build"):
        slicing.slice_rank(mini_build, build8, 0, 2, progress=False)
    with pytest.raises(CheckpointError, match="has no {rank}"):
        slicing.slice_all(mini_build, str(tmp_path / "same"), 2, progress=False)
    assert not (tmp_path / "same").exists()


def test_manifest_verify_finds_damage(mini_build, tmp_path):
    out = slicing.slice_rank(mini_build, tmp_path / "r", 1, 2, progress=False)
    f = out / "model-layer-004.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    manifest.verify(out, "rank")  # same size: only the sha256 check sees it
    with pytest.raises(CheckpointError, match="model-layer-004.safetensors sha256"):
        manifest.verify(out, "rank", sha256=True)
    f.write_bytes(bytes(raw[:-8]))
    with pytest.raises(CheckpointError, match="has .* bytes, manifest"):
        manifest.verify(out, "rank")
    with pytest.raises(CheckpointError, match="kind 'build', not a rank folder"):
        manifest.verify(mini_build, "rank")


def _cli(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_cli(mini_build, tmp_path):
    r = _cli("--rank", 1, "--build", mini_build, "--out", tmp_path / "r{rank}")
    assert r.returncode == 0, r.stderr
    m = manifest.verify(tmp_path / "r1", "rank")
    size = load_deployment(REPO / "deploy" / "local.yaml").size
    assert (m["rank"], m["size"]) == (1, size)  # size from deploy/local.yaml
    assert not (tmp_path / "r0").exists()

    np.savez(tmp_path / "counts.npz", **{f"layer_{L}": np.arange(E)[::-1] ** 2 for L in MOE})
    (tmp_path / "d.yaml").write_text(
        f"build: {mini_build}\nrank_dir: {tmp_path}/yaml/r{{rank}}\nsize: 4\n"
        f"placement_counts: {tmp_path / 'counts.npz'}\n"
    )
    r = _cli("--config", tmp_path / "d.yaml", "--all", "--out", tmp_path / "all" / "r{rank}")
    assert r.returncode == 0, r.stderr
    ms = [manifest.verify(tmp_path / "all" / f"r{k}", "rank") for k in range(4)]
    assert [(m["rank"], m["size"], m["placement"]["kind"]) for m in ms] == [
        (k, 4, "load-aware") for k in range(4)
    ]
    assert not (tmp_path / "yaml").exists()  # --out overrides the YAML's rank_dir

    # any size, and by each box's memory: --size follows --boxes (deploy/local.yaml says 2)
    r = _cli(
        "--rank", 2, "--boxes", "512,256,256", "--build", mini_build, "--out", tmp_path / "b{rank}"
    )
    assert r.returncode == 0, r.stderr
    m = manifest.verify(tmp_path / "b2", "rank")
    plc = Placement.from_json(m["placement"])
    assert (m["rank"], m["size"], plc.kind, plc.shares) == (2, 3, "by-memory", (512, 256, 256))
    assert [plc.counts(L) for L in MOE] == [[8, 4, 4]] * len(MOE)
    assert "by-memory for shares 512:256:256, experts per layer per rank 8:4:4" in r.stdout

    r = _cli("--rank", 5, "--size", 2, "--build", mini_build, "--out", tmp_path / "bad{rank}")
    assert r.returncode != 0
    assert "--rank 5 must be in 0..1" in r.stderr
    assert not list(tmp_path.glob("bad*"))
