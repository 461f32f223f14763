"""``convert --profile``: uniform low-bit, mixed2 and graded builds from a source, each
loading through the two-bank loader; promoted experts keep the source's MXFP4 bytes;
budgets that hold nothing and missing scores are refused with the numbers / the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from k3dist.bench.evaluate import expert_bytes
from k3dist.format import kvmemory, layout
from k3dist.format.graded import HI, LO
from k3dist.format.layout import EXPERT_PROJ
from k3dist.format.sfile import read_bytes, read_header
from k3dist.format.source import Source
from k3dist.model import two_bank
from k3dist.pipeline import convert, promote
from k3dist.pipeline.profiles import convert_profile

import mlx.core as mx
import numpy as np
import pytest
from util import load_f32, prompt_ids

PROJ_SRC = {v: k for k, v in EXPERT_PROJ.items()}  # gate_proj -> w1


def _graded_plan_kw(src: Source) -> dict:
    """A budget between no promotion and all (34 of 80 experts): 2.12 MB for one 256-token
    request's KV/state, the mini's weights and activations with attention split over the
    2 ranks (the plan's default), plus the prompt cache bound the plan also keeps room for
    (256 tokens)."""
    pc = kvmemory.serving_bytes(src.text_config, context=256, batch=1, prompt_cache_tokens=256)
    return {
        "budget": int(2.12e6) + pc["prompt_cache"]["total"],
        "context": 256,
        "batch": 1,
        "prompt_cache_tokens": 256,
        "headroom": 0,
        # the mini's 96-wide experts take only g32 lo formats, outside the quality grid:
        # named, as a user must (planner: auto refuses a point the grid has not measured)
        "lo": "2bit-g32",
    }


def _tensors(build: Path) -> dict:
    index = json.loads((build / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in dict.fromkeys(index.values()):
        out.update(read_header(build / f).tensors)
    return out


def _logits(model, vocab: int) -> np.ndarray:
    out = model(mx.array([prompt_ids(vocab, 24)]))
    return np.asarray(out.astype(mx.float32))


@pytest.fixture(scope="module")
def profiles(mini_src, mini_build, tmp_path_factory):
    """Every uniform profile of the session's mini source, over its MXFP4 build."""
    root = tmp_path_factory.mktemp("profiles")
    return {
        p: convert_profile(mini_src, root / p, p, mxfp4_dir=mini_build, progress=False)
        for p in ("2bit", "3bit", "mixed2")
    }


@pytest.fixture(scope="module")
def scores(mini_src, tmp_path_factory) -> Path:
    tc = Source(mini_src).text_config
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("scores") / "scores.npz"
    np.savez(
        path, **{f"layer_{layer}": rng.random(tc["num_experts"]) for layer in layout.moe_layers(tc)}
    )
    return path


def test_uniform_profiles_load_and_order_by_bytes(mini_src, mini_build, profiles):
    tc = Source(mini_src).text_config
    vocab = tc["vocab_size"]
    ref, _ = load_f32(mini_build)
    ref_logits = _logits(ref, vocab)
    kl = {}
    for p, build in profiles.items():
        model, cfg = two_bank.load_build(build)
        got = _logits(model, vocab)
        assert np.isfinite(got).all()
        kl[p] = float(np.abs(got - ref_logits).mean())
        assert cfg["graded"]["hi"] == {}  # nothing promoted: one (lo) bank
    nbytes = {p: expert_bytes(b).bytes for p, b in profiles.items()}
    assert nbytes["2bit"] < nbytes["mixed2"] < nbytes["3bit"] < expert_bytes(mini_build).bytes
    assert 0 < kl["3bit"] < kl["2bit"]  # fewer bits, further from the MXFP4 logits
    q = json.loads((profiles["2bit"] / "config.json").read_text())["quantization"]
    mid = layout.moe_layers(tc)[1]
    # mini-K3 experts have 96 columns: g64 does not divide them, g32 does
    assert q[f"language_model.model.layers.{mid}.mlp.{LO}.gate_proj"] == {
        "group_size": 32,
        "bits": 2,
        "mode": "affine",
    }


def test_mixed2_is_2bit_and_3bit_projections(mini_src, profiles):
    """mixed2's lo tensors are byte for byte the 3-bit build's for down_proj and the
    first and last MoE layer, the 2-bit build's elsewhere."""
    moe = layout.moe_layers(Source(mini_src).text_config)
    t = {p: _tensors(b) for p, b in profiles.items()}
    checked = {"2bit": 0, "3bit": 0}
    for layer in moe:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            want = "3bit" if proj == "down_proj" or layer in (moe[0], moe[-1]) else "2bit"
            for part in ("weight", "scales", "biases"):
                n = f"language_model.model.layers.{layer}.mlp.{LO}.{proj}.{part}"
                assert read_bytes(t["mixed2"][n]) == read_bytes(t[want][n]), n
            checked[want] += 1
    assert checked["2bit"] and checked["3bit"]
    cfg = json.loads((profiles["mixed2"] / "config.json").read_text())
    q = cfg["quantization"][f"language_model.model.layers.{moe[0]}.mlp.{LO}.gate_proj"]
    assert q["bits"] == 3


@pytest.mark.parametrize("allocation", ["per-layer", "global"])
def test_graded_profile_promotes_source_bytes(mini_src, scores, tmp_path, allocation):
    src = Source(mini_src)
    tc = src.text_config

    def build() -> Path:
        return convert_profile(
            mini_src,
            tmp_path / "graded",
            "graded",
            scores=scores,
            progress=False,
            plan_kw=_graded_plan_kw(src),
            allocation=allocation,
        )

    out = build()
    m = json.loads((out / "k3dist.json").read_text())
    plan = m["plan"]
    assert 0 < plan["promoted_total"] < len(layout.moe_layers(tc)) * tc["num_experts"]
    assert plan["bytes_per_rank"]["total"] <= _graded_plan_kw(src)["budget"]
    assert m["convert_profile"]["profile"] == "graded"
    assert (tmp_path / "graded.mxfp4" / "k3dist.json").exists()  # the resumable stage
    cfg = json.loads((out / "config.json").read_text())
    hi = {int(k): v for k, v in cfg["graded"]["hi"].items()}
    sc = dict(np.load(scores))
    assert plan["allocation"] == allocation
    if allocation == "global":  # the best over all layers, a multiple of the ranks each
        wants = promote.promote_global(
            {int(k[6:]): v for k, v in sc.items()}, plan["promoted_total"], plan["ranks"]
        )
        assert sum(map(len, wants.values())) == plan["promoted_total"]
        assert all(len(v) % plan["ranks"] == 0 for v in wants.values())
    else:
        wants = {
            int(layer): sorted(np.argsort(-sc[f"layer_{layer}"], kind="stable")[:n].tolist())
            for layer, n in plan["promoted_per_layer"].items()
        }
    t = _tensors(out)
    checked = 0
    for layer, want in wants.items():
        assert hi.get(layer, []) == want
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for kind, suffix in (("weight_packed", "weight"), ("weight_scale", "scales")):
                if not want:
                    continue
                stacked = read_bytes(
                    t[f"language_model.model.layers.{layer}.mlp.{HI}.{proj}.{suffix}"]
                )
                per = len(stacked) // len(want)
                for i, e in enumerate(want):
                    name = (
                        f"{layout.LAYER_PREFIX}{layer}.block_sparse_moe.experts.{e}."
                        f"{PROJ_SRC[proj]}.{kind}"
                    )
                    assert stacked[i * per : (i + 1) * per] == read_bytes(src.info(name)), name
                    checked += 1
    assert checked == 6 * plan["promoted_total"]
    # non-experts in the plan's formats
    q = cfg["quantization"]
    att = [v for k, v in q.items() if ".self_attn." in k]
    assert att and all(v["bits"] == int(plan["nonexpert"]["attention"]["format"][0]) for v in att)
    model, _ = two_bank.load_build(out)
    assert np.isfinite(_logits(model, tc["vocab_size"])).all()
    # resumable / idempotent: a second run finds both stages complete
    again = build()
    assert json.loads((again / "k3dist.json").read_text())["build_hash"] == m["build_hash"]


def test_graded_budget_too_small_says_the_numbers(mini_src, scores, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"nothing fits 1000000 bytes per rank: non-experts "
        r"\d+, KV/state \d+, activations \d+",
    ):
        convert_profile(
            mini_src,
            tmp_path / "g",
            "graded",
            scores=scores,
            progress=False,
            plan_kw={"budget": int(1e6), "context": 256, "headroom": 0},
        )
    assert not (tmp_path / "g").exists() and not (tmp_path / "g.mxfp4").exists()


def _profiles_cli(src: Path, out: Path, profile: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m k3dist.pipeline.profiles`` making ``profile`` of ``src`` in ``out``."""
    cmd = ["-m", "k3dist.pipeline.profiles", "--src", str(src), "--out", str(out)]
    return subprocess.run(
        [sys.executable, *cmd, "--profile", profile, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_graded_cli_without_scores_names_calibrate(mini_src, tmp_path):
    r = _profiles_cli(mini_src, tmp_path / "g", "graded", "--budget", "3e6")
    assert r.returncode != 0
    assert "--scores" in r.stderr and "python -m k3dist.pipeline.calibrate" in r.stderr
    r = _profiles_cli(mini_src, tmp_path / "u", "2bit", "--budget", "3e6")
    assert r.returncode != 0 and "only with --profile graded" in r.stderr


def test_profile_resumes_both_stages(mini_src, profiles, tmp_path, monkeypatch):
    """Interrupted in the MXFP4 stage, then in the grade stage: each re-run resumes,
    and the result is byte for byte the uninterrupted build."""
    from k3dist.format.manifest import JOURNAL
    from k3dist.pipeline import view

    out, stage = tmp_path / "2bit", tmp_path / "stage"

    def failing(real, at):
        calls = {"n": 0}

        def f(*a, **k):
            calls["n"] += 1
            if calls["n"] == at:
                raise KeyboardInterrupt("simulated crash")
            return real(*a, **k)

        return f

    monkeypatch.setattr(convert, "iter_chunks", failing(convert.iter_chunks, 40))
    with pytest.raises(KeyboardInterrupt):
        convert_profile(mini_src, out, "2bit", mxfp4_dir=stage, progress=False)
    assert (stage / JOURNAL).exists() and not (stage / "k3dist.json").exists()
    assert not out.exists()
    monkeypatch.undo()
    # a full grade of the mini reads its expert stacks in 30 calls (runs of experts, through
    # the build's reader, k3dist.pipeline.view.BuildFolder): stop half-way
    monkeypatch.setattr(view.OpenFiles, "read", failing(view.OpenFiles.read, 15))
    with pytest.raises(KeyboardInterrupt):
        convert_profile(mini_src, out, "2bit", mxfp4_dir=stage, progress=False)
    assert (stage / "k3dist.json").exists()
    done = json.loads((out / JOURNAL).read_text())["done"]
    assert 0 < len(done) and not (out / "k3dist.json").exists()
    monkeypatch.undo()
    convert_profile(mini_src, out, "2bit", mxfp4_dir=stage, progress=False)
    a = json.loads((out / "k3dist.json").read_text())
    b = json.loads((profiles["2bit"] / "k3dist.json").read_text())
    assert a["files"] == b["files"] and a["build_hash"] == b["build_hash"]
