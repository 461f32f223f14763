"""The layer-streamed forward (k3dist.pipeline.stream), the streamed teacher and the
calibration scores: equal to the whole model in memory, within the cap, resumable."""

from __future__ import annotations

import json

from k3dist.format import layout
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import calibrate, promote, stream, teacher

import mlx.core as mx
import numpy as np
import pytest

N, L = 4, 24


@pytest.fixture(scope="module")
def tokens(mini_build):
    cfg = json.loads((mini_build / "config.json").read_text())
    V = layout.text_config(cfg)["vocab_size"]
    return np.random.default_rng(0).integers(0, V, size=(N, L)).astype(np.int32)


@pytest.fixture(scope="module")
def builds(mini_build, tmp_path_factory):
    """(uniform 2-bit, graded with promotions) builds of the synthetic mini."""
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    d = tmp_path_factory.mktemp("stream")
    uniform = promote.grade(
        mini_build, d / "u", {i: [] for i in moe}, 1, "2bit-g32", progress=False
    )
    graded = promote.grade(
        mini_build, d / "g", {i: [2, 5, 11] for i in moe}, 2, "2bit-g32", progress=False
    )
    return uniform, graded


def _full(path, tokens, batch):
    model = stream.load_lazy(path)
    mx.eval(model.parameters())
    return [model(mx.array(tokens[r])) for r in stream.batches(len(tokens), batch)]


@pytest.mark.parametrize("which", ["mxfp4", "uniform", "graded"])
def test_streamed_forward_equals_the_whole_model(which, mini_build, builds, tokens):
    path = {"mxfp4": mini_build, "uniform": builds[0], "graded": builds[1]}[which]
    st = stream.LayerStream(path)
    got = [logits for _, logits in stream.forward(st, tokens, batch=2)]
    for a, b in zip(got, _full(path, tokens, 2), strict=True):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())


def test_a_token_set_over_the_cap_is_refused_with_the_numbers(mini_build, tokens, tmp_path):
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    need = stream.state_bytes(tc, tokens.size)
    # hidden x (blocks + 1) x 4 bytes per token, plus the stack's inverse RMS
    depth = stream.blocks_before(tc, tc["num_hidden_layers"])
    assert need == tokens.size * (tc["hidden_size"] * 4 * (depth + 1) + 4 * depth)
    with pytest.raises(stream.StreamError, match=r"over the cap .* use at most \d+ tokens"):
        teacher.run(mini_build, tokens, tmp_path / "t", cap=need - 1, batch=2, progress=False)
    assert not (tmp_path / "t" / "k3dist.json").exists()


def test_teacher_writes_the_models_log_probs_and_resumes(mini_build, tokens, tmp_path, monkeypatch):
    ref = teacher.run(mini_build, tokens, tmp_path / "ref", batch=2, progress=False)
    out = teacher.TeacherOutput(ref)
    for b, logits in enumerate(_full(mini_build, tokens, 2)):
        ids, logp = out.logits(b)
        assert ids is None and mx.array_equal(logp, teacher.log_softmax(logits))
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    assert out.manifest["boundaries"] == teacher.boundaries(tc) == [0, 2, 4, 6]
    # the last boundary state is the whole token set after every layer
    assert [s.h.shape for s in out.states(6)] == [(2, L, tc["hidden_size"])] * 2

    # interrupted after the states at layer 2: a re-run starts there and ends equal
    calls = []
    real = teacher._save

    def crash(path, arrays):
        calls.append(path.name)
        if path.name == "states-L4.safetensors":
            raise KeyboardInterrupt
        return real(path, arrays)

    monkeypatch.setattr(teacher, "_save", crash)
    with pytest.raises(KeyboardInterrupt):
        teacher.run(mini_build, tokens, tmp_path / "t", batch=2, progress=False)
    monkeypatch.setattr(teacher, "_save", real)
    assert not (tmp_path / "t" / "k3dist.json").exists()
    journal = json.loads((tmp_path / "t" / ".k3dist-progress.json").read_text())
    assert sorted(journal["done"]) == ["states-L0", "states-L2"]
    teacher.run(mini_build, tokens, tmp_path / "t", batch=2, progress=False)
    for f in sorted(p.name for p in ref.iterdir() if p.suffix == ".safetensors"):
        assert (tmp_path / "t" / f).read_bytes() == (ref / f).read_bytes(), f
    # top-k: the k largest log-probs and their ids
    top = teacher.TeacherOutput(
        teacher.run(mini_build, tokens, tmp_path / "top", batch=2, top_k=5, progress=False)
    )
    ids, logp = top.logits(1)
    _, full = out.logits(1)
    assert mx.array_equal(mx.take_along_axis(full, ids, axis=-1), logp)
    assert mx.array_equal(mx.sort(logp, axis=-1), mx.sort(full, axis=-1)[..., -5:])


def test_top_k_kl_is_exact_with_the_whole_vocabulary(mini_build, tokens):
    logits = _full(mini_build, tokens, 4)[0]
    t = teacher.log_softmax(logits * 0.7)
    V = t.shape[-1]
    ids = mx.broadcast_to(mx.arange(V), t.shape)
    a = calibrate.kl_sum(None, t, logits).item()
    b = calibrate.kl_sum(ids, t, logits).item()
    assert a > 0 and abs(a - b) < 1e-3 * a


def test_k_hi_from_routes():
    routes = np.array([[0, 1, 2, 3], [0, 5, 6, 7], [4, 5, 6, 7], [1, 2, 8, 9]])
    assert calibrate.k_hi_from_routes(routes, [], 4) == 0
    assert calibrate.k_hi_from_routes(routes, [0, 1, 2], 4) == 3
    assert calibrate.k_hi_from_routes(routes, [0, 1, 2], 4, target=0.25) == 2
    assert calibrate.k_hi_from_routes(routes, [9], 4) == 1


def test_streamed_gradient_equals_the_whole_models(mini_build, builds, tokens, tmp_path):
    """Calibration's block-by-block backward gives each MoE layer's routed-sum gradient
    that mx.grad of the whole model in memory gives."""
    uniform = builds[0]
    t = teacher.run(mini_build, tokens, tmp_path / "t", batch=2, progress=False)
    cal = calibrate.Calibration(
        uniform, mini_build, t, tokens, tmp_path / "work", batch=2, progress=False
    )
    cal.grads = {}
    summary = cal.run(tmp_path / "out")
    assert summary["tokens"] == tokens.size and summary["kl_per_token"] > 0

    model = stream.load_lazy(uniform)
    mx.eval(model.parameters())
    moes = [
        layer.mlp for layer in model.language_model.model.layers if hasattr(layer.mlp, "_route")
    ]
    hooks = [calibrate.RoutedProbe(m) for m in moes]
    out = teacher.TeacherOutput(t)
    for b, r in enumerate(stream.batches(N, 2)):
        x = mx.array(tokens[r])
        _, t_logp = out.logits(b)

        def loss(probes, x=x, t_logp=t_logp):
            for h, p in zip(hooks, probes, strict=True):
                h.probe = p
            return calibrate.kl_sum(None, t_logp, model(x))

        latent = model.args.text_config.routed_expert_hidden_size
        grads = mx.grad(loss)([mx.zeros((2, L, latent)) for _ in hooks])
        for i, g in zip(cal.moe, grads, strict=True):
            assert mx.allclose(cal.grads[(i, b)], g, rtol=1e-3, atol=1e-6), (i, b)
    # scores: one per expert of every MoE layer, frequencies sum to the routes
    E = model.args.text_config.num_experts
    k = model.args.text_config.num_experts_per_token
    freq = np.load(tmp_path / "out" / "scores-frequency.npz")
    assert sorted(freq.files) == sorted(f"layer_{i}" for i in cal.moe)
    assert all(freq[f].shape == (E,) and freq[f].sum() == tokens.size * k for f in freq.files)
    for name in ("output-error", "fisher"):
        s = np.load(tmp_path / "out" / f"scores-{name}.npz")
        assert all((s[f] >= 0).all() and (s[f] > 0).any() for f in s.files)
    routes = np.load(tmp_path / "out" / "routes.npz")
    assert all(routes[f].shape == (tokens.size, k) for f in routes.files)


def test_calibration_refuses_a_graded_or_mxfp4_student(mini_build, builds, tokens, tmp_path):
    t = teacher.run(mini_build, tokens, tmp_path / "t", batch=2, progress=False)
    for student in (mini_build, builds[1]):
        with pytest.raises(CheckpointError, match="uniform low-bit build"):
            calibrate.Calibration(student, mini_build, t, tokens, tmp_path / "w", batch=2)
    with pytest.raises(CheckpointError, match="same token set"):
        calibrate.Calibration(builds[0], mini_build, t, tokens[:2], tmp_path / "w", batch=2)
