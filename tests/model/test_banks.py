"""Two-bank (graded) routed experts: equal to the single-bank layer when both banks hold
the same weights, equal to a per-route dense reference, k_hi overflow counted, promoted
bytes identical to the source, and 2-rank EP of a graded build equal to one process."""

from __future__ import annotations

import json

from k3dist.bench.greedy import greedy
from k3dist.format import layout
from k3dist.format.graded import GradedMap, balance_hi
from k3dist.format.placement import contiguous
from k3dist.format.sfile import CheckpointError, read_bytes, read_header
from k3dist.model import two_bank
from k3dist.model.experts import ExpertParallelMoE
from k3dist.pipeline import promote, slicing

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3
from util import failed_ranks, load_f32, mlx_launch

PROJS = ("gate_proj", "up_proj", "down_proj")
LAYER = 2  # a MoE layer of the mini preset
# Promoted experts per MoE layer of the mini (16 experts, top-4), 2 per rank, k_hi 1:
# tokens often route to 2+ promoted experts, so overflow and drops really happen.
PROMOTED = [1, 4, 9, 14]


@pytest.fixture(scope="module")
def single(mini_build):
    """mlx-lm's single-process model of the MXFP4 build (float32) and its config."""
    return load_f32(mini_build)


def _moe(single):
    model, _ = single
    return model.language_model.model.layers[LAYER].mlp


def _stack(moe, proj, mode):
    """The single-bank stack of ``proj`` as (weight, scales, biases) in ``mode``."""
    ql = getattr(moe.switch_mlp, proj)
    if mode == "mxfp4":
        return ql.weight, ql.scales, None
    dense = mx.dequantize(ql.weight, ql.scales, mode="mxfp4", group_size=32, bits=4)
    return mx.quantize(dense, group_size=32, bits=2)


def _qconfig(mode):
    if mode == "mxfp4":
        return {"mode": "mxfp4", "group_size": 32, "bits": 4}
    return {"mode": "affine", "group_size": 32, "bits": 2}


def _pair(single, mode, hi_ids, k_hi, fallback, form="placeholder", hi_mode=None):
    """(single-bank layer, two-bank layer) over the same experts: the two-bank lo bank
    is the whole single-bank stack (fallback) or its unpromoted rows, the hi bank the
    promoted rows of the same stack (in ``hi_mode`` when given)."""
    hi_mode = hi_mode or mode
    moe = _moe(single)
    tc = moe.args
    E = tc.num_experts
    one = ExpertParallelMoE(tc, np.arange(E, dtype=np.int32), None, "placeholder")
    two = two_bank.TwoBankMoE(
        tc, np.zeros(E, dtype=np.int32), 0, None, form, hi_ids, k_hi, fallback
    )

    def proj(p):
        return p.startswith("switch_") and p.endswith(PROJS)

    nn.quantize(one, class_predicate=lambda p, _: proj(p) and _qconfig(mode))
    nn.quantize(
        two,
        class_predicate=lambda p, _: (
            proj(p)
            and (
                (p.startswith("switch_mlp") and _qconfig(mode))
                or (p.startswith("switch_hi") and _qconfig(hi_mode))
            )
        ),
    )
    shared = [(k, v) for k, v in tree_flatten(moe.parameters()) if not k.startswith("switch")]
    lo_ids = list(range(E)) if fallback else [e for e in range(E) if e not in hi_ids]
    one_w, two_w = list(shared), list(shared)
    for proj in PROJS:
        for bank, ids, m in (("switch_mlp", lo_ids, mode), ("switch_hi", hi_ids, hi_mode)):
            for name, a in zip(("weight", "scales", "biases"), _stack(moe, proj, m), strict=True):
                if a is None:
                    continue
                if bank == "switch_mlp" and m == mode:
                    one_w.append((f"switch_mlp.{proj}.{name}", a))
                two_w.append((f"{bank}.{proj}.{name}", a[mx.array(ids)]))
    one.load_weights(one_w)
    two.load_weights(two_w)
    one.set_dtype(mx.float32)
    two.set_dtype(mx.float32)
    return one, two


@pytest.mark.parametrize("mode", ["mxfp4", "affine2"])
@pytest.mark.parametrize("T", [1, 37])  # decode; prefill (SwitchGLU sorts >= 64 pairs)
@pytest.mark.parametrize("k_hi", [1, 4])  # 1: overflow goes to the lo fallback copy
def test_same_weights_equal_single_bank_exactly(single, mode, T, k_hi):
    one, two = _pair(single, mode, PROMOTED, k_hi, fallback=True)
    x = mx.random.normal((1, T, one.args.hidden_size), key=mx.random.key(T))
    a, b = one(x), two(x)
    # Per-route outputs are computed by the same kernel on the same weights and merged
    # by position before the same weighted sum over k: bitwise equal, not just close.
    assert np.array_equal(np.array(a), np.array(b))


def test_same_weights_local_form_close(single):
    one, two = _pair(single, "mxfp4", PROMOTED, 1, fallback=True, form="local")
    x = mx.random.normal((1, 37, one.args.hidden_size), key=mx.random.key(3))
    # local form: owned pairs are gathered and scatter-added (another summation order)
    assert np.abs(np.array(one(x)) - np.array(two(x))).max() < 1e-5


def test_phased_form_is_placeholder_for_decode_and_local_for_chunks(single):
    """moe_form phased (auto on Metal): a decode step runs the placeholder form, bit for
    bit; a call of LOCAL_FROM_TOKENS tokens the local form, bit for bit."""
    from k3dist.model.forms import LOCAL_FROM_TOKENS

    _, ph = _pair(single, "mxfp4", PROMOTED, 1, fallback=True, form="phased")
    _, pl = _pair(single, "mxfp4", PROMOTED, 1, fallback=True, form="placeholder")
    _, lo = _pair(single, "mxfp4", PROMOTED, 1, fallback=True, form="local")
    for T, same in ((1, pl), (LOCAL_FROM_TOKENS, lo)):
        x = mx.random.normal((1, T, ph.args.hidden_size), key=mx.random.key(T))
        assert np.array_equal(np.array(ph(x)), np.array(same(x))), T


def _dense(ql, e, lo: bool):
    if lo and hasattr(ql, "biases") and ql.mode == "affine":
        return mx.dequantize(
            ql.weight[e], ql.scales[e], ql.biases[e], group_size=ql.group_size, bits=ql.bits
        )
    return mx.dequantize(
        ql.weight[e], ql.scales[e], mode=ql.mode, group_size=ql.group_size, bits=ql.bits
    )


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("form", ["placeholder", "local"])
def test_matches_per_route_dense_reference(single, fallback, form):
    """Lo bank affine 2-bit, hi bank MXFP4: every route computed densely by hand."""
    moe = _moe(single)
    tc = moe.args
    E, k = tc.num_experts, tc.num_experts_per_token
    _, two = _pair(single, "affine2", PROMOTED, 1, fallback, form, hi_mode="mxfp4")
    lo_ids = list(range(E)) if fallback else [e for e in range(E) if e not in PROMOTED]
    x = mx.random.normal((1, 23, tc.hidden_size), key=mx.random.key(5))
    got = np.array(
        two._routed_placeholder(two.routed_expert_down_proj(x), *two._route(x))
        if form == "placeholder"
        else two._routed_local(two.routed_expert_down_proj(x), *two._route(x))
    )
    inds, w = (np.array(a) for a in two._route(x))
    y = np.array(two.routed_expert_down_proj(x))
    act = kimi_k3.SiTU(tc.activation_situ_beta or 1.0, tc.activation_situ_linear_beta)
    want = np.zeros_like(y)
    dropped = 0
    for t in range(y.shape[1]):
        prom = [j for j in range(k) if inds[0, t, j] in PROMOTED]
        hi_route = max(prom, key=lambda j: w[0, t, j]) if prom else None
        for j in range(k):
            e = int(inds[0, t, j])
            if j == hi_route:
                bank, row, lo = two.switch_hi, PROMOTED.index(e), False
            elif e in lo_ids:
                bank, row, lo = two.switch_mlp, lo_ids.index(e), True
            else:
                dropped += 1
                continue
            g, u, d = (_dense(getattr(bank, p), row, lo) for p in PROJS)
            v = mx.array(y[0, t])
            h = act(u @ v, g @ v)
            want[0, t] += w[0, t, j] * np.array(d @ h)
    assert (dropped > 0) == (not fallback)  # the case under test really happens
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_overflow_counting(single):
    _, two = _pair(single, "mxfp4", PROMOTED, 1, fallback=False)
    _, two_fb = _pair(single, "mxfp4", PROMOTED, 1, fallback=True)
    x = mx.random.normal((1, 50, two.args.hidden_size), key=mx.random.key(9))
    inds = np.array(two._route(x)[0])
    n_prom = np.isin(inds, PROMOTED).sum(-1)
    over = np.maximum(n_prom - 1, 0)
    assert over.sum() > 0
    two.count_routes = two_fb.count_routes = True
    mx.eval(two(x), two_fb(x))
    s, s_fb = two.route_stats(), two_fb.route_stats()
    assert s["overflow_routes"] == s["dropped_routes"] == over.sum()
    assert s["overflow_token_layers"] == (over > 0).sum()
    assert s["routes"] == inds.size and s["tokens"] == 50
    assert s_fb["overflow_routes"] == over.sum() and s_fb["dropped_routes"] == 0
    # the serving metrics' sample (k3dist.serve.metrics): the same counts from the ids the
    # layer kept of its last call, without counting in the graph
    assert two.last_routes is None  # kept only once asked (serving)
    two.record_last_routes(True)
    two_fb.record_last_routes(True)
    mx.eval(two(x), two_fb(x))
    kept = np.array(two.last_routes).reshape(-1, inds.shape[-1])
    assert (kept == inds.reshape(-1, inds.shape[-1])).all()
    assert two.sampled_overflow(kept) == (over.sum(), over.sum())
    assert two_fb.sampled_overflow(kept) == (over.sum(), 0)
    two.reset_route_stats()
    assert two.route_stats()["routes"] == 0
    _, quiet = _pair(single, "mxfp4", PROMOTED, 1, fallback=False)
    mx.eval(quiet(x))  # off by default: nothing counted
    assert quiet.route_stats()["routes"] == 0


# ----------------------------------------------------------------------------- builds


@pytest.fixture(scope="module")
def graded(mini_build, tmp_path_factory):
    cfg = json.loads((mini_build / "config.json").read_text())
    tc = layout.text_config(cfg)
    moe = [i for i in range(tc["num_hidden_layers"]) if layout.is_moe_layer(tc, i)]
    promoted = {i: PROMOTED for i in moe}
    return promote.grade(
        mini_build, tmp_path_factory.mktemp("g") / "graded", promoted, 1, "2bit-g32", progress=False
    )


def test_promoted_bytes_identical_to_source(graded, mini_build, mini_src):
    cfg = json.loads((graded / "config.json").read_text())
    gmap = GradedMap.from_config(cfg)
    idx = json.loads((graded / "model.safetensors.index.json").read_text())["weight_map"]
    src_idx = json.loads((mini_src / "model.safetensors.index.json").read_text())["weight_map"]
    src_proj = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    checked = 0
    for layer, ids in gmap.hi.items():
        for proj in PROJS:
            for suffix, kind in (("weight", "weight_packed"), ("scales", "weight_scale")):
                name = f"language_model.model.layers.{layer}.mlp.switch_hi.{proj}.{suffix}"
                t = read_header(graded / idx[name]).tensors[name]
                b = mini_build / f"model-layer-{layer:03d}.safetensors"
                full = read_header(b).tensors[name.replace("switch_hi", "switch_mlp")]
                per = t.nbytes // len(ids)
                for row, e in enumerate(ids):
                    mine = read_bytes(t, row * per, per)
                    assert mine == read_bytes(full, e * per, per)
                    sname = (
                        f"language_model.model.layers.{layer}.block_sparse_moe.experts."
                        f"{e}.{src_proj[proj]}.{kind}"
                    )
                    st = read_header(mini_src / src_idx[sname]).tensors[sname]
                    assert mine == read_bytes(st)
                    checked += 1
    assert checked == len(gmap.hi) * len(PROMOTED) * 6


def test_graded_build_bytes_and_lo_values(graded, mini_build):
    """The lo bank is mx.quantize of the dequantized MXFP4 expert, bit for bit."""
    name = f"language_model.model.layers.{LAYER}.mlp.switch_mlp.up_proj"
    h = read_header(graded / f"model-layer-{LAYER:03d}.safetensors")
    w, s = (
        mx.load(str(mini_build / f"model-layer-{LAYER:03d}.safetensors"))[f"{name}.{x}"]
        for x in ("weight", "scales")
    )
    got = mx.load(str(graded / f"model-layer-{LAYER:03d}.safetensors"))
    e = 0  # expert 0 is not promoted: lo row 0
    dense = mx.dequantize(w[e], s[e], mode="mxfp4", group_size=32, bits=4, dtype=mx.bfloat16)
    qw, qs, qb = mx.quantize(dense, group_size=32, bits=2)
    assert np.array_equal(np.array(got[f"{name}.weight"][0]), np.array(qw))
    assert np.array_equal(
        np.array(got[f"{name}.scales"][0].astype(mx.float32)), np.array(qs.astype(mx.float32))
    )
    assert h.tensors[f"{name}.weight"].shape[0] == 16 - len(PROMOTED)


def test_slicing_refuses_empty_hi_bank(graded, tmp_path):
    cfg = json.loads((graded / "config.json").read_text())
    tc = layout.text_config(cfg)
    moe = [i for i in range(tc["num_hidden_layers"]) if layout.is_moe_layer(tc, i)]
    # contiguous: rank 0 owns 0..7, rank 1 8..15 -> PROMOTED = [1, 4, 9, 14] splits 2/2;
    # a placement with all four promoted on rank 0 must be refused
    bad = contiguous(16, 2, moe)
    owners = {
        i: tuple(0 if e in PROMOTED or e in (0, 2, 3, 5) else 1 for e in range(16)) for i in moe
    }
    bad = type(bad)(2, 16, owners, "custom")
    with pytest.raises(Exception, match="none of"):
        slicing.slice_rank(graded, tmp_path / "r0", 0, 2, bad, progress=False)


def test_loader_checks_bank_rows(graded, tmp_path):
    out = slicing.slice_rank(graded, tmp_path / "r0", 0, 1, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    cfg["graded"]["hi"][str(LAYER)] = [1, 4, 9]  # config no longer matches the stacks
    (out / "config.json").write_text(json.dumps(cfg))
    m = json.loads((out / "k3dist.json").read_text())  # past the size check, to the rows
    m["files"]["config.json"]["bytes"] = (out / "config.json").stat().st_size
    (out / "k3dist.json").write_text(json.dumps(m))
    from k3dist.serve import loader

    with pytest.raises(CheckpointError, match="stacks"):
        loader.check_rank_folder(out, 0, 1)


@pytest.fixture(scope="module")
def graded_oracle(graded):
    model, config = two_bank.load_build(graded)
    model.count_routes(True)
    vocab = config["text_config"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab - 256, size=40).tolist()
    tokens, logits = greedy(model, prompt, 32)
    return prompt, tokens, logits, model.route_stats()


def _uneven_promotion(mini_build):
    """A global budget that promotes unevenly: one layer nearly all (k_hi = top-k), one
    none (a single bank), the rest a few with their own k_hi."""
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    E, k = tc["num_experts"], tc["num_experts_per_token"]
    rng = np.random.default_rng(1)
    scores = {i: rng.random(E) * (100 if i == moe[0] else 1) for i in moe}
    scores[moe[1]] = np.zeros(E) - 1.0  # never chosen before the others run out
    promoted = promote.promote_global(scores, E + 4, 2)
    k_hi = {i: (k if i == moe[0] else 1) for i in moe}
    return moe, E, promoted, k_hi


@pytest.fixture(scope="module")
def uneven(mini_build, tmp_path_factory):
    """The graded build of ``_uneven_promotion`` and its single-process greedy run."""
    _, _, promoted, k_hi = _uneven_promotion(mini_build)
    out = tmp_path_factory.mktemp("uneven")
    build = promote.grade(mini_build, out / "g", promoted, k_hi, "2bit-g32", progress=False)
    model, config = two_bank.load_build(build)
    vocab = config["text_config"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab - 256, size=40).tolist()
    tokens, logits = greedy(model, prompt, 16)
    return build, prompt, tokens, logits


@pytest.fixture(scope="module")
def two_rank_runs(graded, graded_oracle, uneven, tmp_path_factory):
    """The 2-rank EP runs of this file in one mlx.launch start-up
    (tests/scripts/parity_runs.py: each run as launch/generate.py runs one): the graded
    build with each MoE form, and the uneven build with the default form. Returns the
    launch's result and, by name, each run's index and dump pattern."""
    tmp = tmp_path_factory.mktemp("banks-ep")
    for name, build in (("graded", graded), ("uneven", uneven[0])):
        slicing.slice_all(build, str(tmp / name / "rank{rank}"), 2, progress=False)
    plan = [
        ("placeholder", "graded", "placeholder", graded_oracle[0], 32),
        ("local", "graded", "local", graded_oracle[0], 32),
        ("uneven", "uneven", None, uneven[1], 16),
    ]
    runs, where = [], {}
    for name, folder, form, prompt, steps in plan:
        where[name] = (len(runs), str(tmp / "out" / name / "rank{rank}.npz"))
        runs.append(
            {
                "rank_dir": str(tmp / folder / "rank{rank}"),
                "moe_form": form,
                "prompt": prompt,
                "max_tokens": steps,
                "dump": where[name][1],
            }
        )
    (tmp / "runs.json").write_text(json.dumps(runs))
    r = mlx_launch(2, "tests/scripts/parity_runs.py", str(tmp / "runs.json"), timeout=600)
    return r, where


def _rank_dumps(two_rank_runs, name: str) -> list:
    r, where = two_rank_runs
    assert r.returncode == 0 and not failed_ranks(r), r.stdout[-2000:] + r.stderr[-4000:]
    run, dump = where[name]
    done = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"run"')]
    done = [x for x in done if x["run"] == run]
    assert sorted(x["rank"] for x in done) == [0, 1], r.stdout[-2000:]
    return [np.load(dump.format(rank=i)) for i in range(2)]


@pytest.mark.parametrize("form", ["placeholder", "local"])
def test_two_rank_ep_equals_single_process(graded_oracle, two_rank_runs, form):
    prompt, tokens, logits, stats = graded_oracle
    assert stats["dropped_routes"] > 0  # k_hi = 1: drops are part of what must agree
    runs = _rank_dumps(two_rank_runs, form)
    diff = max(float(np.abs(x["logits"] - logits).max()) for x in runs)
    print(f"\ngraded 2-rank {form}: max |logit - single-process| = {diff:.3g}")
    for x in runs:
        assert x["prompt"].tolist() == prompt
        assert x["tokens"].tolist() == tokens
        assert np.array_equal(x["logits"], runs[0]["logits"])
    assert diff < 1e-4


def test_grade_cli_promotes_top_scores(mini_build, tmp_path):
    import subprocess
    import sys

    from util import REPO

    cfg = json.loads((mini_build / "config.json").read_text())
    tc = layout.text_config(cfg)
    moe = [i for i in range(tc["num_hidden_layers"]) if layout.is_moe_layer(tc, i)]
    rng = np.random.default_rng(1)
    scores = {str(i): rng.random(16).tolist() for i in moe}
    (tmp_path / "scores.json").write_text(json.dumps({"layers": scores}))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3dist.pipeline.promote",
            "--build",
            str(mini_build),
            "--out",
            str(tmp_path / "g"),
            "--scores",
            str(tmp_path / "scores.json"),
            "--per-layer",
            "2",
            "--k-hi",
            "1",
            "--lo",
            "2bit-g32",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    gmap = GradedMap.from_config(json.loads((tmp_path / "g" / "config.json").read_text()))
    for i in moe:
        assert list(gmap.hi[i]) == sorted(np.argsort(scores[str(i)])[-2:].tolist())
        assert gmap.k_hi[i] == 1


def test_balance_hi_spreads_promoted_experts():
    moe = [1, 2]
    plc = contiguous(16, 2, moe)  # rank 0: 0..7, rank 1: 8..15
    gmap = GradedMap(16, {1: (0, 1, 2, 3), 2: (2, 9)}, {1: 2, 2: 1})
    out = balance_hi(plc, gmap)
    for layer, ids in gmap.hi.items():
        own = np.asarray(out.owners[layer])
        assert np.bincount(own[list(ids)], minlength=2).tolist() == [len(ids) // 2] * 2
        assert np.bincount(own, minlength=2).tolist() == [8, 8]  # memory still balanced
    assert out.owners[2] == plc.owners[2]  # already balanced: untouched
    assert out.kind == "contiguous+hi-balanced"


def test_plan_then_grade(mini_build, tmp_path):
    """plan -> grade: the plan's counts, k_hi and lo format, the plan in the manifest."""
    import subprocess
    import sys

    from util import REPO

    plan_json = tmp_path / "plan.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3dist.pipeline.plan",
            "--config",
            str(mini_build / "config.json"),
            "--budget",
            "1e9",
            "--context",
            "256",
            "--lo",
            "2bit-g32",
            "--headroom-gib",
            "0",
            "--json",
            "--out",
            str(plan_json),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(plan_json.read_text())
    counts = {str(i): list(range(16)) for i in map(int, plan["promoted_per_layer"])}
    (tmp_path / "counts.json").write_text(json.dumps({"layers": counts}))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3dist.pipeline.promote",
            "--build",
            str(mini_build),
            "--out",
            str(tmp_path / "g"),
            "--scores",
            str(tmp_path / "counts.json"),
            "--plan",
            str(plan_json),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    gmap = GradedMap.from_config(json.loads((tmp_path / "g" / "config.json").read_text()))
    for layer, n in plan["promoted_per_layer"].items():
        assert list(gmap.hi[int(layer)]) == list(range(16 - n, 16))  # highest counts
        assert gmap.k_hi[int(layer)] == plan["k_hi_uniform"][layer]
    assert gmap.lo == "2bit-g32"
    assert json.loads((tmp_path / "g" / "k3dist.json").read_text())["plan"] == plan
    model, _ = two_bank.load_build(tmp_path / "g")  # loads and runs
    assert greedy(model, [5, 6, 7], 2)[0]


def test_two_rank_ep_of_an_uneven_global_promotion(mini_build, uneven, two_rank_runs):
    """A global budget promotes unevenly: one layer nearly all (k_hi = top-k), one none
    (a single bank), the rest a few with their own k_hi; 2-rank EP still equals single
    process."""
    moe, E, promoted, _ = _uneven_promotion(mini_build)
    assert len(promoted[moe[0]]) == E - 2 and not promoted[moe[1]]
    assert all(len(v) % 2 == 0 for v in promoted.values())
    _, prompt, tokens, logits = uneven
    for x in _rank_dumps(two_rank_runs, "uneven"):
        assert x["prompt"].tolist() == prompt
        assert x["tokens"].tolist() == tokens
        assert float(np.abs(x["logits"] - logits).max()) < 1e-4


def test_global_promotion_takes_the_best_groups_over_layers():
    rng = np.random.default_rng(3)
    scores = {i: rng.random(16) * w for i, w in ((1, 1.0), (2, 5.0), (3, 0.2))}
    # groups of one: exactly the top 10 values over all layers
    got = promote.promote_global(scores, 10, 1)
    flat = sorted(((v, i, e) for i, s in scores.items() for e, v in enumerate(s)), reverse=True)
    want: dict[int, list[int]] = {i: [] for i in scores}
    for _, i, e in flat[:10]:
        want[i].append(e)
    assert got == {i: sorted(v) for i, v in want.items()}
    # groups of two: each layer's best pairs, counts even, a lo expert always left
    got = promote.promote_global(scores, 40, 2)
    assert all(len(v) % 2 == 0 and len(v) <= 14 for v in got.values())
    assert sum(map(len, got.values())) == 40
    for i, ids in got.items():
        assert ids == sorted(np.argsort(-scores[i], kind="stable")[: len(ids)].tolist())
