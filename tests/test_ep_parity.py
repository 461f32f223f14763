"""Expert parallelism under mlx.launch on loopback: every rank's logits match
mlx-lm's single-process kimi_k3 on the unsliced build, ranks agree bitwise."""

from __future__ import annotations

import json

from k3dist.build import convert, slicing
from k3dist.format import layout, placement
from k3dist.serve.engine import greedy

import numpy as np
import pytest
from util import failed_ranks, load_f32, mlx_launch

PROMPT, STEPS = 40, 32
# Float32 sums in another order (per-rank partial sums, then all_sum) move logits
# by a few ULPs of their magnitude (~4); 1e-4 is ~100x the differences seen.
ATOL = 1e-4


def _slice_all(build, out, size, plc):
    for r in range(size):
        slicing.slice_rank(build, out / f"rank{r}", r, size, plc, progress=False)
    return str(out / "rank{rank}")


def _oracle(build):
    model, config = load_f32(build)
    vocab = config["text_config"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab - 256, size=PROMPT).tolist()
    tokens, logits = greedy(model, prompt, STEPS)
    return prompt, tokens, logits


@pytest.fixture(scope="module")
def builds(mini_src, mini_build, tmp_path_factory):
    """16-bit build, and an 8-bit one whose mini shared experts cannot split at group
    boundaries (64 wide, group 64): they stay replicated, outside the all_sum."""
    b8 = convert.convert(mini_src, tmp_path_factory.mktemp("b8") / "b8", nonexpert_bits=8,
                         progress=False)
    return {16: (mini_build, _oracle(mini_build)), 8: (b8, _oracle(b8))}


def _skewed_placement(build, size):
    tc = layout.text_config(json.loads((build / "config.json").read_text()))
    rng = np.random.default_rng(7)
    moe = layout.moe_layers(tc)
    plc = placement.load_aware({i: rng.pareto(1.0, tc["num_experts"]) for i in moe}, size)
    contiguous = placement.contiguous(tc["num_experts"], size, moe)
    assert plc.owners != contiguous.owners  # really non-contiguous
    return plc


@pytest.mark.parametrize("size,kind,form,bits", [
    (2, "contiguous", "placeholder", 16),
    (2, "contiguous", "local", 16),
    (2, "load-aware", "placeholder", 16),
    (4, "contiguous", "local", 16),
    (2, "load-aware", "local", 8),
])
def test_ep_matches_single_process(builds, tmp_path, size, kind, form, bits):
    mini_build, oracle = builds[bits]
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    plc = (_skewed_placement(mini_build, size) if kind == "load-aware"
           else placement.contiguous(tc["num_experts"], size, moe))
    pattern = _slice_all(mini_build, tmp_path / "ranks", size, plc)
    prompt, tokens, logits = oracle
    r = mlx_launch(size, "launch/generate.py", "--rank-dir", pattern, "--moe-form", form,
                   "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(STEPS),
                   "--dump", str(tmp_path / "out" / "rank{rank}.npz"))
    assert r.returncode == 0 and not failed_ranks(r), r.stdout[-2000:] + r.stderr[-4000:]
    runs = [np.load(tmp_path / "out" / f"rank{i}.npz") for i in range(size)]
    diff = max(float(np.abs(x["logits"] - logits).max()) for x in runs)
    print(f"\nN={size} {kind} {form} {bits}-bit: max |logit - single-process| = {diff:.3g}")
    for x in runs:
        assert x["tokens"].tolist() == tokens
        assert np.array_equal(x["logits"], runs[0]["logits"])  # ranks agree bitwise
    assert diff < ATOL
