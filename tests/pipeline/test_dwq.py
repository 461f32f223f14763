"""Block-aligned DWQ (k3dist.pipeline.dwq) on the synthetic mini: every block's held-out
loss goes down, frozen tensors keep their bytes, the output is a build that loads, and an
interrupted run resumes by block to the same bytes."""

from __future__ import annotations

import json

from k3dist.format import layout
from k3dist.format.graded import HI, LO
from k3dist.format.sfile import read_bytes, read_header
from k3dist.model import two_bank
from k3dist.pipeline import dwq, promote, teacher
from k3dist.pipeline.adam import Adam

import mlx.core as mx
import numpy as np
import pytest

N, L = 6, 24
CFG = dwq.DWQConfig(steps=12, lr=3e-3, batch=2, valid_windows=2, eval_every=4)


@pytest.fixture(scope="module")
def setup(mini_build, tmp_path_factory):
    cfg = json.loads((mini_build / "config.json").read_text())
    tc = layout.text_config(cfg)
    moe = layout.moe_layers(tc)
    d = tmp_path_factory.mktemp("dwq")
    student = promote.grade(
        mini_build, d / "graded", {i: [2, 5] for i in moe}, 2, "2bit-g32", progress=False
    )
    tokens = np.random.default_rng(0).integers(0, tc["vocab_size"], size=(N, L)).astype(np.int32)
    t = teacher.run(mini_build, tokens, d / "teacher", batch=2, progress=False)
    out = dwq.dwq(t, student, tokens, d / "dwq", CFG, progress=False)
    return student, t, tokens, out, d


def _tensors(build):
    index = json.loads((build / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in dict.fromkeys(index.values()):
        out.update(read_header(build / f).tensors)
    return out


def test_every_block_improves_on_held_out_windows(setup):
    _, _, _, out, _ = setup
    m = json.loads((out / "k3dist.json").read_text())
    blocks = m["dwq"]["blocks"]
    assert [b["layers"] for b in blocks] == [[0, 1], [2, 3], [4, 5]]
    for b in blocks:
        assert b["valid_after"] < b["valid_before"], b
        assert b["train_loss_last"] < b["train_loss_first"], b
    assert m["dwq"]["config"]["steps"] == CFG.steps
    assert m["dwq"]["windows"] == {"train": N - 2, "valid": 2}


def test_only_lo_bank_scales_and_biases_change(setup):
    student, _, _, out, _ = setup
    a, b = _tensors(student), _tensors(out)
    assert a.keys() == b.keys()
    changed = [n for n in a if read_bytes(a[n]) != read_bytes(b[n])]
    assert changed and all(f".{LO}." in n and n.endswith((".scales", ".biases")) for n in changed)
    # the lo bank's codes and the MXFP4 hi bank are byte for byte the student's
    assert any(f".{HI}." in n for n in a)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == json.loads((student / "config.json").read_text())


def test_output_loads_and_is_closer_to_the_teacher(setup, mini_build):
    student, t, tokens, out, _ = setup
    ids, logp = teacher.TeacherOutput(t).logits(0)
    x = mx.array(tokens[:2])

    def kl(path):
        model, _ = two_bank.load_build(path)
        s = teacher.log_softmax(model(x))
        return float((mx.exp(logp) * (logp - s)).sum(-1).mean())

    assert kl(out) < kl(student)


def test_resumes_by_block(setup, monkeypatch):
    student, t, tokens, out, d = setup
    real = dwq.DWQ.train_block
    calls = []

    def crash(self, a, c, s_in, t_out):
        calls.append(a)
        if a == 2:
            raise KeyboardInterrupt
        return real(self, a, c, s_in, t_out)

    monkeypatch.setattr(dwq.DWQ, "train_block", crash)
    with pytest.raises(KeyboardInterrupt):
        dwq.dwq(t, student, tokens, d / "resumed", CFG, progress=False)
    monkeypatch.setattr(dwq.DWQ, "train_block", real)
    assert calls == [0, 2] and not (d / "resumed" / "k3dist.json").exists()
    again = dwq.dwq(t, student, tokens, d / "resumed", CFG, progress=False)
    a, b = _tensors(out), _tensors(again)
    assert all(read_bytes(a[n]) == read_bytes(b[n]) for n in a)


def test_refuses_an_mxfp4_student(mini_build, setup, tmp_path):
    _, t, tokens, _, _ = setup
    with pytest.raises(Exception, match="MXFP4 build"):
        dwq.dwq(t, mini_build, tokens, tmp_path / "x", CFG, progress=False)


def test_bf16_state_improves_every_block_like_float32(setup, tmp_path):
    """``--state bf16``: Adam's moments and the best copy in bfloat16 improve each block
    by nearly what float32 state does (``--input teacher``: each block sees the same
    input in both runs, so the gains compare block by block)."""
    student, t, tokens, _, _ = setup
    runs = {}
    for state in ("float32", "bf16"):
        cfg = dwq.DWQConfig(**{**CFG.__dict__, "state": state, "input": "teacher"})
        out = dwq.dwq(t, student, tokens, tmp_path / state, cfg, progress=False)
        runs[state] = json.loads((out / "k3dist.json").read_text())["dwq"]
    assert runs["bf16"]["config"]["state"] == "bf16"
    gains = []
    for a, b in zip(runs["float32"]["blocks"], runs["bf16"]["blocks"], strict=True):
        assert a["valid_before"] == b["valid_before"]
        gain, gain16 = (r["valid_before"] - r["valid_after"] for r in (a, b))
        assert gain16 >= 0.75 * gain, (a, b)  # (a gain of 0: the best is the start)
        gains.append(gain16)
    assert sum(g > 0 for g in gains) >= 2, gains


def test_adam_moments_are_kept_in_the_state_dtype():
    p = {"w": mx.array(np.random.default_rng(0).normal(size=(64,)).astype(np.float32))}
    g = {"w": mx.array(np.random.default_rng(1).normal(size=(64,)).astype(np.float32))}
    full, half = Adam(), Adam(dtype=mx.bfloat16)
    a, b = p, p
    for _ in range(20):
        a, b = full.update(a, g, 1e-2), half.update(b, g, 1e-2)
    assert half.m["w"].dtype == half.v["w"].dtype == mx.bfloat16
    assert full.m["w"].dtype == mx.float32 and b["w"].dtype == mx.float32
    assert np.allclose(np.array(a["w"]), np.array(b["w"]), atol=2e-3)
