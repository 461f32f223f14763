"""Batched decode through expert parallelism (issue 14): both MoE forms on two ranks
decode eight prompts together and each gets the greedy tokens single-process mlx-lm
gives it alone (the trained mini-K3, float32); the local form's host syncs are one
per MoE layer per step whatever the batch. The server's batch path:
tests/serve/test_server_batch.py (test_batch_of_8_...)."""

from __future__ import annotations

import json

from k3dist import MINI_K3
from k3dist.bench import greedy
from k3dist.config.deployment import load_deployment
from k3dist.pipeline import convert, slicing
from k3dist.serve import loader, warmup

import mlx.core as mx
import numpy as np
import pytest
from util import failed_ranks, load_f32, mlx_launch, prompt_ids


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return convert.convert(MINI_K3, tmp_path_factory.mktemp("shipped") / "build", progress=False)


def test_two_ranks_batch_of_8_both_forms_equal_single_process(build, tmp_path):
    for r in range(2):
        slicing.slice_rank(build, tmp_path / f"rank{r}", r, 2, None, progress=False)
    model, config = load_f32(build)
    vocab = config["text_config"]["vocab_size"]
    prompts = [prompt_ids(vocab, 3 + 5 * i, seed=i) for i in range(8)]  # 3..38 tokens
    steps = 8
    ref = [greedy.greedy(model, p, steps)[0] for p in prompts]
    alone = greedy.batch_decode(model, prompts, steps, prefill_step_size=32)
    assert [t[:steps] for t in alone.tokens] == ref  # one process: batch == alone
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    res = mlx_launch(
        2,
        "tests/scripts/batch_decode.py",
        "--rank-dir",
        str(tmp_path / "rank{rank}"),
        "--prompts",
        str(tmp_path / "prompts.json"),
        "--steps",
        str(steps),
        "--out",
        str(tmp_path / "out{rank}.json"),
    )
    assert res.returncode == 0 and not failed_ranks(res), res.stdout[-2000:] + res.stderr[-4000:]
    reports = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    assert reports[0] == reports[1]
    rep = reports[0]
    for form in ("placeholder", "local"):
        assert rep[form]["tokens"] == ref, form
        assert rep[form]["steps_timed"] == steps
    n = rep["moe_layers"]
    print(f"\nlocal form host syncs per decode step: {rep['local']['host_syncs']} ({n} MoE layers)")
    assert n > 0 and rep["local"]["host_syncs"] == {"1": n, "8": n}


def test_max_batch_is_a_checked_deployment_key():
    assert load_deployment(None).max_batch == 8
    assert load_deployment(None, max_batch=1).max_batch == 1
    for bad in (0, -1, 10_000):
        with pytest.raises(ValueError, match="max_batch"):
            load_deployment(None, max_batch=bad)


def test_warm_up_runs_every_batch_size_the_server_can_take(build, tmp_path):
    """Warm-up at max_batch 4 runs decode at batch 1..4 and every prefill chunk; a
    batch served afterwards (prompts of several chunk lengths) runs no other shape."""
    slicing.slice_rank(build, tmp_path / "rank0", 0, 1, None, progress=False)
    model, config, _ = loader.load_rank(tmp_path / "rank0", None, "float32", "local", "size")
    model.chunk_sizes = warmup.chunk_sizes(16)
    vocab = config["text_config"]["vocab_size"]
    warm = warmup.warm_up(model, 16, vocab, max_batch=4)
    assert warm["decode"] == [1, 2, 3, 4]
    assert {(1, t) for t in model.chunk_sizes} <= {tuple(x) for x in warm["shapes"]}
    assert not model.shapes_seen  # warm-up's own shapes are in its report only
    greedy.batch_decode(
        model, [prompt_ids(vocab, n, seed=n) for n in (5, 23, 40, 2)], 6, prefill_step_size=16
    )
    assert (4, 1) in model.shapes_seen
    assert model.shapes_seen <= {tuple(x) for x in warm["shapes"]}


@pytest.mark.parametrize("form", ["placeholder", "local"])
def test_moe_layers_give_each_row_of_a_batch_what_it_gets_alone(build, form):
    """Both MoE classes (ExpertParallelMoE, graded TwoBankMoE), with another rank's
    experts in the routing: a batch of 8 decode rows equals the 8 rows one at a time."""
    from k3dist.model.experts import ExpertParallelMoE
    from k3dist.model.two_bank import TwoBankMoE

    from mlx_lm.models import kimi_k3

    model, _ = load_f32(build)
    args = next(
        layer.mlp.args for layer in model.layers if isinstance(layer.mlp, kimi_k3.KimiK3SparseMoE)
    )
    E = args.num_experts
    owners = np.repeat([0, 1], [E // 2, E - E // 2])
    table = np.where(owners == 0, np.cumsum(owners == 0) - 1, -1).astype(np.int32)
    mx.random.seed(0)
    layers = [
        ExpertParallelMoE(args, table, None, form),
        TwoBankMoE(args, owners, 0, None, form, [1, 4, E - 2], 2, False),
    ]
    x = mx.random.normal((8, 1, args.hidden_size))
    for m in layers:
        m.set_dtype(mx.float32)
        batch = np.array(m(x))
        rows = np.concatenate([np.array(m(x[i : i + 1])) for i in range(8)])
        assert np.abs(batch - rows).max() <= 1e-5 * np.abs(rows).max(), type(m).__name__
