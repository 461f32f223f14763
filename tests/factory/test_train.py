"""Mini-K3 training at the "tiny" size: the loop learns, the aux-loss-free bias balances,
checkpoints resume bit-exactly, and the MXFP4-frozen model exports to K3's source format
that the audit accepts and mlx-lm loads to the same logits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

from k3dist.factory import corpus, minimodel, train
from k3dist.factory.export import MAX_EXPORT_BYTES
from k3dist.format import layout, mxfp4
from k3dist.format import tokens as tk
from k3dist.format.sfile import read_numpy
from k3dist.format.source import Source
from k3dist.pipeline import convert
from k3dist.pipeline.audit import audit
from k3dist.pipeline.checkpoint import format_table

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3
from util import REPO, failed_ranks, feed_stdin, load_f32, mlx_launch

VOCAB = corpus.BASE_VOCAB + tk.NUM_CONTROL_TOKENS


@pytest.fixture(scope="module")
def config() -> dict:
    return train.model_config("tiny", VOCAB)


@pytest.fixture(scope="module")
def batch() -> tuple[mx.array, mx.array]:
    enc = tk.load_encoding(corpus.TOKENIZER_DIR)
    stream = train.token_stream(corpus.load_split("train", "code")[:3], enc)
    return train.fixed_windows(stream, 32, 4)


def experts_frozen(model) -> bool:
    """The routed experts are MXFP4 (quantized modules with scales), as after the freeze."""
    return any(hasattr(m.switch_mlp.gate_proj, "scales") for m in minimodel.moe_layers(model))


def _args(**kw) -> train.TrainArgs:
    base = dict(
        size="tiny",
        seq=32,
        batch=4,
        lr=3e-3,
        warmup=2,
        eval_every=0,
        eval_windows=2,
        save_every_s=1e9,
    )
    return train.TrainArgs(**{**base, **kw})


def test_topology_is_k3s(config):
    tc = config["text_config"]
    model = train.build_model(config)
    kinds = ["kda" if layer.is_linear else "mla" for layer in model.layers]
    assert kinds == ["kda", "kda", "kda", "mla", "mla"]  # every 4th and the last
    assert not isinstance(model.layers[0].mlp, kimi_k3.KimiK3SparseMoE)
    moes = minimodel.moe_layers(model)
    assert len(moes) == tc["num_hidden_layers"] - 1
    assert tc["num_experts"] >= 64 and tc["num_shared_experts"] == 2
    assert (
        moes[0].routed_expert_norm is not None
        and moes[0].latent_size == tc["routed_expert_hidden_size"]
    )
    assert tc["hidden_act"] == "situ" and tc["moe_router_activation_func"] == "sigmoid"
    assert model.layers[0].use_attn_res
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert not any("e_score_correction_bias" in k for k in trainable)
    for size in ("s", "m"):
        info = train.describe(train.model_config(size, VOCAB))
        assert info["source_bytes"] <= MAX_EXPORT_BYTES, (size, info)


def _trainer(config):
    """A fresh model in training mode, its optimizer, loss gradient and arguments."""
    model = train.build_model(config, seed=0)
    model.train()
    a = _args()
    return model, train.make_optimizer(a), nn.value_and_grad(model, train._loss), a


def test_five_steps_lower_loss_on_a_fixed_batch(config, batch):
    x, y = batch
    model, opt, grad_fn, a = _trainer(config)
    losses = [train.train_step(model, opt, grad_fn, x, y, a.lr, a)[0].item() for _ in range(5)]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(np.isfinite(losses))


def test_bias_update_moves_load_toward_balance(config, batch):
    x, _ = batch
    model = train.build_model(config, seed=0)
    model.eval()

    def loads():
        train.reset_caches(model)
        model(x)
        return train.expert_loads(model)

    first = loads()
    # The rule itself: overloaded down, underloaded up, by exactly the rate.
    before = [np.array(m.e_score_correction_bias) for m in minimodel.moe_layers(model)]
    train.update_router_bias(model, first, 0.01)
    for m, b, load in zip(minimodel.moe_layers(model), before, np.array(first), strict=True):
        step = np.array(m.e_score_correction_bias) - b
        np.testing.assert_allclose(step, 0.01 * np.sign(load.mean() - load), atol=1e-7)
    for _ in range(40):
        train.update_router_bias(model, loads(), 0.01)
    last = loads()
    assert train.load_imbalance(last) < 0.8 * train.load_imbalance(first), (
        train.load_imbalance(first),
        train.load_imbalance(last),
    )
    cv = lambda lo: float((np.array(lo).std(axis=1) / np.array(lo).mean(axis=1)).mean())  # noqa: E731
    assert cv(last) < 0.8 * cv(first)


def test_resume_is_bit_exact(tmp_path):
    a = dict(size="tiny", seq=32, batch=4, warmup=2, steps=4, eval_every=2, eval_windows=2)
    straight = train.Trainer(tmp_path / "a", a)
    straight.run(progress=False)
    part = train.Trainer(tmp_path / "b", a)
    part.run(max_steps=2, progress=False)
    resumed = train.Trainer(tmp_path / "b")
    assert resumed.state.step == 2
    resumed.run(progress=False)
    pa = dict(tree_flatten(straight.model.parameters()))
    pb = dict(tree_flatten(resumed.model.parameters()))
    assert pa.keys() == pb.keys()
    for k in pa:
        assert mx.array_equal(pa[k], pb[k]), k
    la = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    assert "eval" in la[1] and set(la[1]["eval"]) == set(corpus.DOMAINS)
    with pytest.raises(ValueError, match="other settings"):
        train.Trainer(tmp_path / "b", {"size": "s"})


def test_freeze_keeps_experts_fixed_and_trains_the_rest(tmp_path):
    tr = train.Trainer(
        tmp_path / "run",
        dict(size="tiny", seq=32, batch=4, warmup=2, steps=2, eval_every=0, eval_windows=2),
    )
    tr.run(progress=False)
    event = tr.freeze()
    assert event["rel_rms_error"] and all(0 < e < 0.2 for e in event["rel_rms_error"].values())
    assert experts_frozen(tr.model)
    trainable = dict(tree_flatten(tr.model.trainable_parameters()))
    assert not any("switch_mlp" in k for k in trainable)
    experts = {k: v for k, v in tree_flatten(tr.model.parameters()) if "switch_mlp" in k}
    others = {k: v for k, v in trainable.items()}
    tr.run(max_steps=2, max_minutes=1, progress=False)
    after = dict(tree_flatten(tr.model.parameters()))
    assert all(mx.array_equal(v, after[k]) for k, v in experts.items())
    assert any(not mx.array_equal(v, after[k]) for k, v in others.items())
    # Resuming a frozen run rebuilds the quantized experts before loading.
    again = train.Trainer(tmp_path / "run")
    assert again.state.phase == "freeze" and experts_frozen(again.model)
    assert all(
        mx.array_equal(v, dict(tree_flatten(again.model.parameters()))[k]) for k, v in after.items()
    )


def test_export_audits_and_loads_to_the_same_logits(config, batch, tmp_path):
    x, y = batch
    model, opt, grad_fn, a = _trainer(config)
    for _ in range(2):  # moves the router bias off zero too
        train.train_step(model, opt, grad_fn, x, y, a.lr, a)
    train.freeze_experts_mxfp4(model)
    model.eval()
    train.round_to_source(model, config)
    out = train.export_source(model, config, tmp_path / "src")

    report = audit(out)
    assert report.ok, format_table(report)
    total = sum(f.stat().st_size for f in out.iterdir())
    assert total <= MAX_EXPORT_BYTES

    loaded, _ = load_f32(out)
    train.reset_caches(model)
    ours, theirs = model(x), loaded(x)
    np.testing.assert_allclose(np.array(theirs), np.array(ours), rtol=0, atol=1e-5)
    assert mx.array_equal(ours.argmax(-1), theirs.argmax(-1))

    # Experts in the file are the frozen bytes (and decode like MLX's kernel reads them).
    lp = layout.LAYER_PREFIX
    src = Source(out)
    packed = read_numpy(src.info(f"{lp}1.block_sparse_moe.experts.5.w2.weight_packed"))
    scales = read_numpy(src.info(f"{lp}1.block_sparse_moe.experts.5.w2.weight_scale"))
    mine = model.layers[1].mlp.switch_mlp.down_proj
    p, s = mxfp4.from_mlx(mine.weight, mine.scales)
    assert np.array_equal(packed, np.array(p[5])) and np.array_equal(scales, np.array(s[5]))
    bias = read_numpy(src.info(f"{lp}1.block_sparse_moe.gate.e_score_correction_bias"))
    assert np.array_equal(bias, np.array(model.layers[1].mlp.e_score_correction_bias))
    assert np.abs(bias).max() > 0

    # The converter (the serving path) takes it as it takes K3.
    build = convert.convert(out, tmp_path / "build", progress=False)
    assert (build / "config.json").exists()
    shutil.rmtree(build)


def test_init_from_an_export_starts_at_its_logits_with_float_experts(config, batch, tmp_path):
    """``--init FOLDER``: a new run starts from an exported checkpoint (experts decoded from
    MXFP4 to float, trainable again), at the export's logits; a mismatched size is refused."""
    x, y = batch
    model, opt, grad_fn, a = _trainer(config)
    for _ in range(2):
        train.train_step(model, opt, grad_fn, x, y, a.lr, a)
    train.freeze_experts_mxfp4(model)
    model.eval()
    train.round_to_source(model, config)
    out = train.export_source(model, config, tmp_path / "src")

    tr = train.Trainer(
        tmp_path / "warm",
        dict(
            size="tiny",
            seq=32,
            batch=4,
            warmup=2,
            steps=2,
            eval_every=0,
            eval_windows=2,
            init=str(out),
        ),
    )
    assert not experts_frozen(tr.model)
    trainable = dict(tree_flatten(tr.model.trainable_parameters()))
    assert any(".switch_mlp.down_proj.weight" in k for k in trainable)
    tr.model.eval()
    train.reset_caches(model)
    train.reset_caches(tr.model)
    np.testing.assert_allclose(np.array(tr.model(x)), np.array(model(x)), rtol=0, atol=1e-5)
    before = dict(tree_flatten(tr.model.parameters()))
    tr.run(progress=False)
    after = dict(tree_flatten(tr.model.parameters()))
    k = next(k for k in before if k.endswith("layers.1.mlp.switch_mlp.down_proj.weight"))
    assert not mx.array_equal(before[k], after[k])  # the experts train again
    with pytest.raises(ValueError, match="--size"):
        train.Trainer(tmp_path / "other", dict(size="s", init=str(out)))


def test_export_refuses_over_budget(config, tmp_path):
    model = train.build_model(config)
    with pytest.raises(ValueError, match="budget"):
        train.export_source(model, config, tmp_path / "x", max_bytes=1000)
    assert not (tmp_path / "x").exists()


def test_lr_schedule():
    assert train.lr_at(0, None, 1.0, 4, 0.1) == pytest.approx(0.25)
    assert train.lr_at(3, None, 1.0, 4, 0.1) == pytest.approx(1.0)
    assert train.lr_at(4, 104, 1.0, 4, 0.1) == pytest.approx(1.0)
    assert train.lr_at(54, 104, 1.0, 4, 0.1) == pytest.approx(0.55)
    assert train.lr_at(104, 104, 1.0, 4, 0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no horizon"):
        train.lr_at(5, None, 1.0, 4, 0.1)


def test_data_parallel_two_ranks_take_the_one_process_steps(tmp_path):
    """mlx.launch -n 2 train/train.py: each rank half of the same global batch; the logged
    losses and the saved weights match one process on the whole batch."""
    args = ["--size", "tiny", "--seq", "32", "--batch", "4", "--steps", "3"]
    res = mlx_launch(2, "train/train.py", "--out", str(tmp_path / "dp"), *args, timeout=120)
    assert not failed_ranks(res) and res.returncode == 0, res.stdout + res.stderr
    assert "2 rank(s)" in res.stdout
    single = train.Trainer(tmp_path / "sp", dict(size="tiny", seq=32, batch=4, steps=3))
    single.run(progress=False)
    logs = [
        [json.loads(line) for line in (tmp_path / d / "log.jsonl").read_text().splitlines()]
        for d in ("dp", "sp")
    ]
    assert [r["step"] for r in logs[0]] == [1, 2, 3]
    np.testing.assert_allclose(
        [r["loss"] for r in logs[0]], [r["loss"] for r in logs[1]], atol=1e-4
    )
    dp = mx.load(str(tmp_path / "dp" / "state" / "model.safetensors"))
    sp = dict(tree_flatten(single.model.parameters()))
    assert dp.keys() == sp.keys()
    for k in dp:
        np.testing.assert_allclose(np.array(dp[k]), np.array(sp[k]), atol=1e-5, err_msg=k)


def test_sigterm_finishes_the_step_and_saves(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "train/train.py",
        "--out",
        str(out),
        "--size",
        "tiny",
        "--seq",
        "32",
        "--batch",
        "4",
        "--steps",
        "10000",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    feed_stdin(proc.stdin)
    log = out / "log.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.terminate()
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, text
    assert "stopped by SIGTERM" in text
    state = json.loads((out / "state" / "state.json").read_text())
    last = json.loads(log.read_text().splitlines()[-1])
    assert state["step"] == last["step"] >= 2
