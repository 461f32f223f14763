"""evaluate: KL / flip / perplexity of student builds against the teacher over fixed
held-out windows, expert bytes and bpw, and a graded student's k_hi drop rate."""

from __future__ import annotations

import json
import math

from k3dist.bench import evaluate
from k3dist.format import layout
from k3dist.format.qformat import MXFP4, QFormat
from k3dist.pipeline import promote

import pytest

WINDOWS, SEQ = 2, 32


@pytest.fixture(scope="module")
def students(mini_build, tmp_path_factory):
    """A uniform 2-bit build (nothing promoted) and a graded one with k_hi 1 (drops)."""
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    d = tmp_path_factory.mktemp("eval")
    uniform = promote.grade(
        mini_build, d / "u", {i: [] for i in moe}, 1, "2bit-g32", progress=False
    )
    graded = promote.grade(
        mini_build, d / "g", {i: [1, 4, 9, 14] for i in moe}, 1, "2bit-g32", progress=False
    )
    return uniform, graded


@pytest.fixture(scope="module")
def report(mini_build, students):
    return evaluate.evaluate(
        mini_build,
        [mini_build, *students],
        WINDOWS,
        SEQ,
        scores=[None, None, "frequency"],
        progress=False,
    )


def test_teacher_against_itself_is_exact(report):
    row = report["rows"][0]
    assert row["build"] == "mxfp4"
    assert row["kl"] == 0.0 and row["flip"] == 0.0
    assert row["ppl"] == report["teacher"]["ppl"]
    assert row["k_hi_drop_rate"] is None


def test_students_differ(report):
    for row in report["rows"][1:]:
        assert row["kl"] > 0
        assert all(math.isfinite(v) and v > 1 for v in row["ppl"].values())


def test_schema_and_bytes(report, mini_build, students):
    assert set(report) >= {"teacher", "rows"}
    for row in report["rows"]:
        assert set(row) >= {
            "build",
            "score",
            "kl",
            "flip",
            "ppl",
            "expert_bpw",
            "bytes",
            "k_hi_drop_rate",
        }
        assert set(row["ppl"]) == {"code", "prose"}
        assert 0 <= row["flip"] <= 1
    assert report["tokens_per_domain"] == {"code": WINDOWS * SEQ, "prose": WINDOWS * SEQ}
    teacher, uniform, graded = report["rows"]
    assert teacher["expert_bpw"] == pytest.approx(4.25)  # mxfp4: 4 bits + 8-bit scale / 32
    # the planner's byte arithmetic (k3dist.format.qformat) agrees with the files
    params = report["teacher"]["expert_params"]
    assert report["teacher"]["bytes"] == params * MXFP4.bpw / 8
    assert uniform["bytes"] == params * QFormat.parse("2bit-g32").bpw / 8
    assert uniform["expert_bpw"] == pytest.approx(3.0)  # 2-bit g32: + bf16 scale and bias
    assert uniform["build"] == "2bit-g32" and graded["build"] == "graded-25"
    # 4 of 16 promoted at 4.25 bpw, 12 at 3.0
    assert graded["expert_bpw"] == pytest.approx(3.0 + 0.25 * 1.25)
    assert graded["bytes"] == evaluate.expert_bytes(students[1]).bytes
    assert graded["score"] == "frequency" and uniform["score"] is None


def test_graded_drop_rate_reported(report):
    _, uniform, graded = report["rows"]
    assert uniform["k_hi_drop_rate"] == 0.0
    # 4 of 16 experts promoted, top-4, k_hi 1: tokens with 2+ promoted routes drop some
    assert 0 < graded["k_hi_drop_rate"] < 1
    assert graded["promoted_share"] == 0.25 and graded["k_hi"] == [1]


def test_deterministic_and_cli(report, mini_build, students, tmp_path):
    out, md = tmp_path / "q.json", tmp_path / "q.md"
    argv = ["--teacher", str(mini_build), "--student", str(mini_build)]
    for s in students:
        argv += ["--student", str(s)]
    argv += [
        "--score",
        "-",
        "--score",
        "-",
        "--score",
        "frequency",
        "--windows",
        str(WINDOWS),
        "--seq",
        str(SEQ),
        "--out",
        str(out),
        "--markdown",
        str(md),
        "--plot",
        str(tmp_path / "q.png"),
    ]
    evaluate.main(argv)
    again = json.loads(out.read_text())
    for a, b in zip(report["rows"], again["rows"], strict=True):
        for k in ("kl", "flip", "ppl", "bytes", "expert_bpw", "k_hi_drop_rate"):
            assert a[k] == b[k], k
    assert again["command"].startswith("python -m k3dist.bench.evaluate --teacher")
    assert "graded-25" in md.read_text() and (tmp_path / "q.png").stat().st_size > 0
    assert "p95 KL" in md.read_text() and again["rows"][1]["kl_p95"] == report["rows"][1]["kl_p95"]


def test_p95_kl_per_token(report):
    """p95 of the per-token KL: 0 for the teacher itself, a tail above the mean of
    the students (KL per token is skewed), per domain too."""
    teacher, *students = report["rows"]
    assert teacher["kl_p95"] == 0.0
    assert set(teacher["kl_p95_by_domain"].values()) == {0.0}
    for row in students:
        assert row["kl_p95"] > row["kl"] > 0
        doms = row["kl_p95_by_domain"]
        assert set(doms) == {"code", "prose"} and all(v > 0 for v in doms.values())


def test_row_sums_per_token_kl_matches_numpy():
    """The per-token KLs behind the percentile: KL(p || q) of each position, computed
    in numpy from the same logits; their sum is the row's KL, and the percentile is
    numpy's."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    t_logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    s_logits = (t_logits + rng.normal(scale=0.5, size=t_logits.shape)).astype(np.float32)
    y = mx.array(rng.integers(0, 11, size=(2, 5)))

    def logp(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    tp, sp = logp(t_logits.astype(np.float64)), logp(s_logits.astype(np.float64))
    want = (np.exp(tp) * (tp - sp)).sum(-1)
    kl, _, _, kl_tok = evaluate.row_sums(
        None, evaluate.log_softmax(mx.array(t_logits)), mx.array(s_logits), y
    )
    assert kl_tok.shape == (2, 5)
    np.testing.assert_allclose(kl_tok, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(kl, want.sum(-1), rtol=1e-4)
    sums = [evaluate.Sums(), evaluate.Sums()]
    sums[0].add(0.0, 0, 0.0, 5, kl_tok[0])
    sums[1].add(0.0, 0, 0.0, 5, kl_tok[1])
    assert evaluate.kl_percentile(sums) == pytest.approx(np.percentile(want, 95), rel=1e-4)
    with pytest.raises(ValueError, match="no per-token KLs"):
        evaluate.kl_percentile([evaluate.Sums()])
