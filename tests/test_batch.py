"""Batched decode through expert parallelism (issue 14): both MoE forms on two ranks
decode eight prompts together and each gets the greedy tokens single-process mlx-lm
gives it alone (the trained mini-K3, float32); the local form's host syncs are one
per MoE layer per step whatever the batch. The server's batch path:
tests/test_server.py (test_batch_of_8_...)."""

from __future__ import annotations

import json

from k3dist.build import convert, slicing
from k3dist.factory.corpus import DATA_DIR
from k3dist.serve import engine
from k3dist.serve.config import load_deployment

import pytest
from util import failed_ranks, load_f32, mlx_launch, prompt_ids


def test_two_ranks_batch_of_8_both_forms_equal_single_process(tmp_path):
    build = convert.convert(DATA_DIR / "mini-k3", tmp_path / "build", progress=False)
    for r in range(2):
        slicing.slice_rank(build, tmp_path / f"rank{r}", r, 2, None, progress=False)
    model, config = load_f32(build)
    vocab = config["text_config"]["vocab_size"]
    prompts = [prompt_ids(vocab, 3 + 9 * i, seed=i) for i in range(8)]  # 3..66 tokens
    steps = 12
    ref = [engine.greedy(model, p, steps)[0] for p in prompts]
    alone = engine.batch_decode(model, prompts, steps, prefill_step_size=32)
    assert [t[:steps] for t in alone.tokens] == ref  # one process: batch == alone
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    res = mlx_launch(2, "tests/scripts/batch_decode.py", "--rank-dir",
                     str(tmp_path / "rank{rank}"), "--prompts", str(tmp_path / "prompts.json"),
                     "--steps", str(steps), "--out", str(tmp_path / "out{rank}.json"))
    assert res.returncode == 0 and not failed_ranks(res), res.stdout[-2000:] + res.stderr[-4000:]
    reports = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    assert reports[0] == reports[1]
    rep = reports[0]
    for form in ("placeholder", "local"):
        assert rep[form]["tokens"] == ref, form
        assert rep[form]["steps_timed"] == steps
    n = rep["moe_layers"]
    print(f"\nlocal form host syncs per decode step: {rep['local']['host_syncs']} "
          f"({n} MoE layers)")
    assert n > 0 and rep["local"]["host_syncs"] == {"1": n, "8": n}


def test_max_batch_is_a_checked_deployment_key():
    assert load_deployment(None).max_batch == 8
    assert load_deployment(None, max_batch=1).max_batch == 1
    for bad in (0, -1, 10_000):
        with pytest.raises(ValueError, match="max_batch"):
            load_deployment(None, max_batch=bad)
