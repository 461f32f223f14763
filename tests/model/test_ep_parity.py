"""Expert parallelism under mlx.launch on loopback: every rank's logits match
mlx-lm's single-process kimi_k3 on the unsliced build, ranks agree bitwise, with
attention split across ranks (the default) or replicated; each run also reports the
collectives one decode token issued and the bytes each rank holds, read from the
running model (k3dist.serve.introspect)."""

from __future__ import annotations

import json

from k3dist.bench.greedy import greedy
from k3dist.format import layout, placement
from k3dist.pipeline import convert, slicing

import numpy as np
import pytest
from util import failed_ranks, load_f32, mlx_launch

PROMPT, STEPS = 40, 32
# Float32 sums in another order (per-rank partial sums, then all_sum) move logits
# by a few ULPs of their magnitude (~4); 1e-4 is ~100x the differences seen.
ATOL = 1e-4


def _slice_all(build, out, size, plc, attention="split"):
    for r in range(size):
        slicing.slice_rank(
            build, out / f"rank{r}", r, size, plc, progress=False, attention=attention
        )
    return str(out / "rank{rank}")


def _oracle(build):
    model, config = load_f32(build)
    vocab = config["text_config"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab - 256, size=PROMPT).tolist()
    tokens, logits = greedy(model, prompt, STEPS)
    return prompt, tokens, logits


@pytest.fixture(scope="module")
def builds(mini_src, mini_build, tmp_path_factory):
    """16-bit build; an 8-bit one whose mini shared experts and attention o_proj cannot
    split at group boundaries (64 wide, group 64): they stay replicated, outside the
    all_sum; and an 8-bit one at group 32, whose quantized attention splits."""
    b8 = convert.convert(
        mini_src, tmp_path_factory.mktemp("b8") / "b8", nonexpert_bits=8, progress=False
    )
    b8g32 = convert.convert(
        mini_src,
        tmp_path_factory.mktemp("b8g32") / "b8",
        nonexpert_bits=8,
        group_size=32,
        progress=False,
    )
    return {
        16: (mini_build, _oracle(mini_build)),
        8: (b8, _oracle(b8)),
        "8g32": (b8g32, _oracle(b8g32)),
    }


def _skewed_placement(build, size):
    tc = layout.text_config(json.loads((build / "config.json").read_text()))
    rng = np.random.default_rng(7)
    moe = layout.moe_layers(tc)
    plc = placement.load_aware({i: rng.pareto(1.0, tc["num_experts"]) for i in moe}, size)
    contiguous = placement.contiguous(tc["num_experts"], size, moe)
    assert plc.owners != contiguous.owners  # really non-contiguous
    return plc


# (size, placement, MoE form, build, attention, layers expected split)
ALL = list(range(6))
CASES = [
    (2, "contiguous", "placeholder", 16, "split", ALL),
    (2, "contiguous", "local", 16, "split", ALL),
    (2, "load-aware", "placeholder", 16, "replicated", []),
    (4, "contiguous", "local", 16, "split", ALL),
    (2, "load-aware", "local", 8, "split", []),  # o_proj: one group of 64, no split
    (2, "contiguous", "placeholder", "8g32", "split", ALL),
]


def _slice_case(builds, out, size, kind, bits, attention):
    build = builds[bits][0]
    tc = layout.text_config(json.loads((build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    plc = (
        _skewed_placement(build, size)
        if kind == "load-aware"
        else placement.contiguous(tc["num_experts"], size, moe)
    )
    return _slice_all(build, out, size, plc, attention)


def _reports(r, size: int, run: int | None = None) -> list[dict]:
    assert r.returncode == 0 and not failed_ranks(r), r.stdout[-2000:] + r.stderr[-4000:]
    reports = [json.loads(line) for line in r.stdout.splitlines() if line.startswith('{"r')]
    reports = [x for x in reports if x.get("run") == run]
    assert sorted(x["rank"] for x in reports) == list(range(size)), r.stdout[-2000:]
    return reports


@pytest.fixture(scope="module")
def two_rank_runs(builds, tmp_path_factory):
    """Every 2-rank case in one mlx.launch start-up (tests/scripts/parity_runs.py: each
    run as launch/generate.py runs one); the 4-rank case runs launch/generate.py itself.
    Returns the launch's result and, by index in CASES, its run index and dump pattern."""
    tmp = tmp_path_factory.mktemp("ep2")
    runs, where = [], {}
    for case, (size, kind, form, bits, attention, _) in enumerate(CASES):
        if size != 2:
            continue
        d = tmp / f"run{len(runs)}"
        where[case] = (len(runs), str(d / "out" / "rank{rank}.npz"))
        runs.append(
            {
                "rank_dir": _slice_case(builds, d / "ranks", size, kind, bits, attention),
                "moe_form": form,
                "attention": attention,
                "prompt": builds[bits][1][0],
                "max_tokens": STEPS,
                "dump": where[case][1],
            }
        )
    (tmp / "runs.json").write_text(json.dumps(runs))
    r = mlx_launch(2, "tests/scripts/parity_runs.py", str(tmp / "runs.json"), timeout=600)
    return r, where


@pytest.mark.parametrize("size,kind,form,bits,attention,split", CASES)
def test_ep_matches_single_process(
    builds, request, tmp_path, size, kind, form, bits, attention, split
):
    mini_build, oracle = builds[bits]
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    prompt, tokens, logits = oracle
    if size == 2:
        r, where = request.getfixturevalue("two_rank_runs")
        run, dump = where[CASES.index((size, kind, form, bits, attention, split))]
        reports = _reports(r, size, run)
    else:
        pattern = _slice_case(builds, tmp_path / "ranks", size, kind, bits, attention)
        dump = str(tmp_path / "out" / "rank{rank}.npz")
        r = mlx_launch(
            size,
            "launch/generate.py",
            "--rank-dir",
            pattern,
            "--moe-form",
            form,
            "--attention",
            attention,
            "--count",
            "--prompt-ids",
            ",".join(map(str, prompt)),
            "--max-tokens",
            str(STEPS),
            "--dump",
            dump,
            timeout=150 * size,
        )
        reports = _reports(r, size)
    # One all_sum per MoE layer, one more per split layer (after its attention; the
    # dense layer's second is its MLP's): counted from the running model.
    want = len(moe) + len(split) + (0 in split and 0 not in moe)
    for rep in reports:
        assert rep["attention"]["split_layers"] == split
        assert rep["collectives_per_token"] == want, rep
        assert rep["tokens"] == tokens
    runs = [np.load(dump.format(rank=i)) for i in range(size)]
    diff = max(float(np.abs(x["logits"] - logits).max()) for x in runs)
    held = reports[0]["bytes_held"]
    print(
        f"\nN={size} {kind} {form} {bits}-bit {attention}: max |logit - single-process| = "
        f"{diff:.3g}; {want} collectives/token; rank 0 holds {held['attention']:,} "
        f"attention bytes of {held['total']:,}"
    )
    for x in runs:
        assert x["tokens"].tolist() == tokens
        assert np.array_equal(x["logits"], runs[0]["logits"])  # ranks agree bitwise
    assert diff < ATOL
