"""Expert parallelism under mlx.launch on loopback: every rank's logits match
mlx-lm's single-process kimi_k3 on the unsliced build, ranks agree bitwise, with
attention split across ranks (the default) or replicated; each run also reports the
collectives one decode token issued and the bytes each rank holds, read from the
running model (k3dist.serve.introspect).

At 2, 3 and 4 ranks (one mlx.launch per size, tests/scripts/parity_runs.py), on the
factory's mini checkpoint (k3dist.factory.synth: 16 experts, 4 heads) and the trained
mini (k3dist/data/mini-k3: 64 experts, 2 KDA and 3 MLA heads), with uneven placements: by
each box's memory (``--boxes``: e.g. 512:256:256 gives 32:16:16 of 64 experts), by
equal shares where the size does not divide the experts (16 over 3: 6:5:5 rotated
over the layers), and load-aware within those counts (the trained mini's own routing
counts). Attention splits only where heads divide by the size (the trained
mini at 3 ranks: its 3-head MLA layers, not its 2-head KDA layers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from k3dist import MINI_K3
from k3dist.bench.greedy import greedy
from k3dist.factory.corpus import DATA_DIR
from k3dist.format import layout, placement
from k3dist.format.graded import GradedMap
from k3dist.model import two_bank
from k3dist.pipeline import convert, promote, reference, slicing

import numpy as np
import pytest
from util import failed_ranks, load_f32, mlx_launch

PROMPT, STEPS = 40, 32
# 3 and 4 ranks on the suite's 2 cores spend most of their time waiting in collectives:
# half the greedy steps (the oracle's first 16), the same prefill
STEPS_OVER_2 = 16
# Float32 sums in another order (per-rank partial sums, then all_sum) move logits
# by a few ULPs of their magnitude (~4); 1e-4 is ~100x the differences seen.
ATOL = 1e-4
REPO = Path(__file__).resolve().parents[2]


def _slice_all(build, out, size, plc, attention="split"):
    for r in range(size):
        slicing.slice_rank(
            build, out / f"rank{r}", r, size, plc, progress=False, attention=attention
        )
    return str(out / "rank{rank}")


def _oracle(build, load=load_f32):
    model, config = load(build)
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
    trained = convert.convert(MINI_K3, tmp_path_factory.mktemp("trained") / "b", progress=False)
    # a graded build (two banks, k3dist.model.two_bank): 6 of 16 experts promoted per layer
    moe = layout.moe_layers(
        layout.text_config(json.loads((mini_build / "config.json").read_text()))
    )
    graded = promote.grade(
        mini_build,
        tmp_path_factory.mktemp("graded") / "g",
        {i: [0, 3, 5, 9, 12, 14] for i in moe},
        2,
        "2bit-g32",
        progress=False,
    )
    return {
        16: (mini_build, _oracle(mini_build)),
        8: (b8, _oracle(b8)),
        "8g32": (b8g32, _oracle(b8g32)),
        "trained": (trained, _oracle(trained)),
        "graded": (graded, _oracle(graded, two_bank.load_build)),
    }


def _skewed_placement(build, size):
    tc = layout.text_config(json.loads((build / "config.json").read_text()))
    rng = np.random.default_rng(7)
    moe = layout.moe_layers(tc)
    plc = placement.load_aware({i: rng.pareto(1.0, tc["num_experts"]) for i in moe}, size)
    contiguous = placement.contiguous(tc["num_experts"], size, moe)
    assert plc.owners != contiguous.owners  # really non-contiguous
    return plc


# (size, placement, MoE form, build, attention, layers expected split). Placements:
# "boxes:A,B,..": by each box's memory (GiB); "shares": placement_for's default where the
# size does not divide the experts; "+routing": load-aware within those counts (the
# trained mini: its routing counts, data/mini-k3-routing.npz; else skewed counts).
ALL = list(range(6))
CASES = [
    (2, "contiguous", "placeholder", 16, "split", ALL),
    (2, "contiguous", "local", 16, "split", ALL),
    (2, "load-aware", "placeholder", 16, "replicated", []),
    (2, "load-aware", "local", 8, "split", []),  # o_proj: one group of 64, no split
    (2, "contiguous", "placeholder", "8g32", "split", ALL),
    # trained mini at 3: its MLA layers (3 heads) split, KDA layers (2 heads) replicated
    (3, "boxes:512,256,256", "placeholder", "trained", "split", [3, 5]),
    (3, "shares+routing", "local", 16, "replicated", []),  # 16 experts: 6:5:5 rotated
    # two banks: 8:4:4 experts, the promoted ones spread 3:2:1 (graded.balance_hi: in
    # proportion to each rank's experts)
    (3, "boxes:512,256,256", "local", "graded", "split", []),
    (4, "boxes:512,256,256,256", "local", 16, "split", ALL),
    # trained mini at 4: no layer's heads divide by 4, every layer stays replicated
    (4, "boxes:512,512,256,128+routing", "placeholder", "trained", "split", []),
]


def _steps(size: int) -> int:
    return STEPS if size <= 2 else STEPS_OVER_2


def _placement(build, size: int, kind: str, attention: str) -> placement.Placement:
    tc = layout.text_config(json.loads((build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    if kind == "contiguous":
        return placement.contiguous(tc["num_experts"], size, moe)
    if kind == "load-aware":
        return _skewed_placement(build, size)
    base, _, routing = kind.partition("+")
    if base == "shares":
        plc = slicing.placement_for(build, size)
        assert plc.kind == "by-shares" and tc["num_experts"] % size
        if routing:
            rng = np.random.default_rng(7)
            counts = {i: rng.pareto(1.0, tc["num_experts"]) for i in moe}
            plc = placement.load_aware(counts, size, plc)
    else:
        counts = DATA_DIR / "mini-k3-routing.npz" if routing else None
        boxes = [float(b) for b in base.removeprefix("boxes:").split(",")]
        plc = slicing.placement_for(build, size, counts, boxes, attention)
        assert plc.kind.startswith("by-memory" + ("+load-aware" if routing else ""))
        total = [sum(plc.counts(i)[r] for i in moe) for r in range(size)]
        share = np.array(boxes) / sum(boxes) * len(moe) * tc["num_experts"]
        assert np.abs(np.array(total) - share).max() < 0.05 * share.max(), (total, share)
    assert any(len(set(plc.counts(i))) > 1 for i in moe)  # really uneven
    gmap = GradedMap.from_config(json.loads((build / "config.json").read_text()))
    for i in moe if gmap is not None else []:  # hi bank in proportion to each rank's experts
        own = np.asarray(plc.owners[i])[list(gmap.hi_ids(i))]
        want = placement.hi_counts(len(gmap.hi_ids(i)), plc.counts(i))
        assert np.bincount(own, minlength=size).tolist() == want, plc.kind
    return plc


def _slice_case(builds, out, size, kind, bits, attention):
    build = builds[bits][0]
    return _slice_all(build, out, size, _placement(build, size, kind, attention), attention)


def _reports(r, size: int, run: int | None = None) -> list[dict]:
    assert r.returncode == 0 and not failed_ranks(r), r.stdout[-2000:] + r.stderr[-4000:]
    reports = [json.loads(line) for line in r.stdout.splitlines() if line.startswith('{"r')]
    reports = [x for x in reports if x.get("run") == run]
    assert sorted(x["rank"] for x in reports) == list(range(size)), r.stdout[-2000:]
    return reports


@pytest.fixture(scope="module")
def launches(builds, tmp_path_factory):
    """Every case of one size in one mlx.launch start-up (tests/scripts/parity_runs.py:
    each run as launch/generate.py runs one), started when a test first needs that
    size. Returns size -> (the launch's result, by index in CASES: its run index and
    dump pattern)."""
    done = {}

    def run(size: int):
        if size in done:
            return done[size]
        tmp = tmp_path_factory.mktemp(f"ep{size}")
        runs, where = [], {}
        for case, (n, kind, form, bits, attention, _) in enumerate(CASES):
            if n != size:
                continue
            d = tmp / f"run{len(runs)}"
            where[case] = (len(runs), str(d / "out" / "rank{rank}.npz"))
            boxes = kind.partition("+")[0].removeprefix("boxes:") if "boxes:" in kind else None
            runs.append(
                {
                    "rank_dir": _slice_case(builds, d / "ranks", size, kind, bits, attention),
                    "moe_form": form,
                    "attention": attention,
                    # the loader checks the folders were placed for these boxes
                    "boxes": boxes,
                    # one OpenBLAS thread per rank: the deployment's setting for a box
                    # running more ranks than it has cores (the suite's 2)
                    "blas_threads": 1,
                    "prompt": builds[bits][1][0],
                    "max_tokens": _steps(size),
                    "dump": where[case][1],
                }
            )
        (tmp / "runs.json").write_text(json.dumps(runs))
        r = mlx_launch(
            size, "tests/scripts/parity_runs.py", str(tmp / "runs.json"), timeout=300 * size
        )
        done[size] = (r, where)
        return done[size]

    return run


@pytest.mark.parametrize("size,kind,form,bits,attention,split", CASES)
def test_ep_matches_single_process(builds, launches, size, kind, form, bits, attention, split):
    mini_build, oracle = builds[bits]
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    prompt, tokens, logits = oracle
    tokens, logits = tokens[: _steps(size)], logits[: _steps(size)]
    r, where = launches(size)
    run, dump = where[CASES.index((size, kind, form, bits, attention, split))]
    reports = _reports(r, size, run)
    # One all_sum per MoE layer, one more per split layer (after its attention; the
    # dense layer's second is its MLP's): counted from the running model.
    want = len(moe) + len(split) + (0 in split and 0 not in moe)
    for rep in reports:
        assert rep["attention"]["split_layers"] == split
        assert rep["collectives_per_token"] == want, rep
        assert rep["tokens"] == tokens
    runs = [np.load(dump.format(rank=i)) for i in range(size)]
    diff = max(float(np.abs(x["logits"] - logits).max()) for x in runs)
    held = [rep["bytes_held"] for rep in sorted(reports, key=lambda x: x["rank"])]
    print(
        f"\nN={size} {kind} {form} {bits} {attention}: max |logit - single-process| = "
        f"{diff:.3g}; {want} collectives/token; rank 0 holds {held[0]['attention']:,} "
        f"attention bytes of {held[0]['total']:,}; totals by rank "
        f"{[h['total'] for h in held]}"
    )
    for x in runs:
        assert x["tokens"].tolist() == tokens
        assert np.array_equal(x["logits"], runs[0]["logits"])  # ranks agree bitwise
    assert diff < ATOL


BOXES = "512,256,256"


@pytest.fixture(scope="module")
def pipeline_ranks(tmp_path_factory):
    """The one-command pipeline on the trained mini for boxes 512,256,256: three rank
    folders of different expert counts, straight from the graded stage; and the whole
    graded build they were sliced from (k3dist.pipeline.reference) for the oracle."""
    tmp = tmp_path_factory.mktemp("pipe3")
    out = tmp / "out"
    argv = ["--src", str(MINI_K3), "--out", str(out), "--boxes", BOXES, "--target-bpw", "3.4"]
    argv += ["--lo", "2bit-g32", "--windows", "2", "--seq", "32"]
    r = subprocess.run(
        [sys.executable, "-m", "k3dist.pipeline.runner", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out, reference.write_reference(MINI_K3, out, tmp / "ref")


def test_pipeline_boxes_serve_like_one_process(pipeline_ranks, tmp_path):
    """k3dist-pipeline --boxes 512,256,256 writes three uneven rank folders (the plan's
    counts, by memory for those boxes, promoted experts in proportion); served on 3 ranks
    they give single-process mlx-lm's greedy tokens on the graded build, logits within
    the 2-rank tolerance, ranks bitwise equal."""
    out, ref = pipeline_ranks
    plan = json.loads((out / "plan.json").read_text())
    m = json.loads((out / "rank0" / "k3dist.json").read_text())
    plc = placement.Placement.from_json(m["placement"])
    assert plc.kind.startswith("by-memory") and plc.shares == (512.0, 256.0, 256.0)
    for layer, counts in plan["experts_per_layer_per_rank"].items():
        assert plc.counts(int(layer)) == counts and counts[0] > 2 * min(counts[1:]) - 2
    gmap = GradedMap.from_config(json.loads((out / "rank0" / "config.json").read_text()))
    assert sum(len(v) for v in gmap.hi.values()) == plan["promoted_total"] > 0
    prompt, tokens, logits = _oracle(ref, two_bank.load_build)
    steps = STEPS_OVER_2
    runs = [
        {
            "rank_dir": str(out / "rank{rank}"),
            "boxes": BOXES,  # the loader refuses folders placed for other boxes
            "prompt": prompt,
            "max_tokens": steps,
            "dump": str(tmp_path / "rank{rank}.npz"),
        }
    ]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    r = mlx_launch(3, "tests/scripts/parity_runs.py", str(tmp_path / "runs.json"), timeout=900)
    reports = _reports(r, 3, 0)
    assert all(rep["tokens"] == tokens[:steps] for rep in reports)
    dumps = [np.load(tmp_path / f"rank{i}.npz") for i in range(3)]
    diff = max(float(np.abs(x["logits"] - logits[:steps]).max()) for x in dumps)
    print(f"\npipeline --boxes {BOXES}: {plc.describe()}; max |logit - one process| {diff:.3g}")
    for x in dumps:
        assert np.array_equal(x["logits"], dumps[0]["logits"])
    assert diff < ATOL
