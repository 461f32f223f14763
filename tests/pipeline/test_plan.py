"""The byte-budget planner: format sizes against mx.quantize, accounting against the
real K3 index, plans that fit their budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from k3dist.config.box import Box
from k3dist.factory.synth import real_config
from k3dist.format import layout, qformat
from k3dist.format.folder import REAL_K3_CONFIG, REAL_K3_INDEX, read_index
from k3dist.format.kvmemory import GiB
from k3dist.pipeline import accounting, byte_budget, plan, quality

import mlx.core as mx
import pytest

REPO = Path(__file__).resolve().parents[2]
# the real K3's tensor index, as the package ships it (a copy of ../shared/reference's)
REAL_INDEX = REAL_K3_INDEX


@pytest.fixture(scope="module")
def acc() -> accounting.Accounting:
    """The real K3 accounted once against its shipped index (497,220 tensor specs built
    and compared: seconds each time; nothing in a plan changes it)."""
    return accounting.account(real_config(), read_index(REAL_INDEX), str(REAL_INDEX))


def _limits(**overrides) -> byte_budget.Limits:
    """The shipped deployment's serving limits (deploy/tb5.yaml), ``overrides`` on top."""
    return byte_budget.Limits.of(byte_budget.shipped(), **overrides)


@pytest.mark.parametrize("fmt", qformat.all_formats(), ids=lambda f: f.name)
def test_format_bytes_match_mx_quantize(fmt):
    rows, cols = 48, 384  # every group size and bit width divides it
    w = mx.random.normal((rows, cols)).astype(mx.bfloat16)
    kw = {"mode": fmt.mode, "bits": fmt.bits, "group_size": fmt.group_size}
    got = sum(a.nbytes for a in mx.quantize(w, **kw) if a is not None)
    assert fmt.nbytes(rows, cols) == got, fmt.name
    assert fmt.bpw * rows * cols / 8 == got


def test_k3_expert_bytes(acc):
    assert acc.expert_bytes(qformat.MXFP4) == 17_547_264  # the source's bytes per expert
    assert acc.expert_bytes(qformat.QFormat.parse("2bit-g64")) * 8 == 2.5 * acc.expert_params
    assert acc.expert_bytes(qformat.QFormat.parse("2bit-g128")) * 8 == 2.25 * acc.expert_params


def test_parse_rejects_nonsense():
    for bad in ("7bit-g64", "2bit-g48", "fp4", "mxfp4-g16"):
        with pytest.raises(ValueError):
            qformat.QFormat.parse(bad)


def test_real_index_accounting(acc):
    assert acc.index_total == 1_560_860_324_864
    assert sum(c["source_bytes"] for c in acc.classes.values()) == acc.source_total
    assert acc.classes["experts"]["tensors"] == 92 * 896 * 6
    assert acc.classes["experts"]["source_bytes"] == 92 * 896 * 17_547_264
    assert len(acc.moe_layers) == 92 and acc.num_experts == 896


def test_index_mismatch_is_refused(mini_src):
    cfg = json.loads((mini_src / "config.json").read_text())
    index = read_index(mini_src / "model.safetensors.index.json")
    del index["weight_map"][next(iter(index["weight_map"]))]
    with pytest.raises(ValueError, match="not in the index"):
        accounting.account(cfg, index, "idx")


def test_kv_state_k3():
    tc = layout.text_config(real_config())
    kv = byte_budget.kv_state(tc, _limits(context=4096))
    assert kv["mla_layers"] == 24 and kv["kda_layers"] == 69
    assert kv["mla_latent_cache"] == 24 * 4096 * 576 * 2
    assert kv["kda_state"] == 69 * (4 * 96 * 128 * 128 + 2 * 3 * 3 * 96 * 128)


def test_kv_state_scales_with_batch(acc):
    """The KV/state line budgets every request the server decodes together, plus the
    prompt cache (the same arithmetic the server's preflight checks)."""
    tc = acc.tc
    one, eight = (byte_budget.kv_state(tc, _limits(batch=b)) for b in (1, 8))
    per = 24 * 131072 * 576 * 2 + 69 * (4 * 96 * 128 * 128 + 2 * 3 * 3 * 96 * 128)
    assert one["per_request"] == eight["per_request"] == per  # 4.07 GB at 128K
    assert eight["requests"] == 8 * per and one["requests"] == per
    assert eight["total"] - one["total"] == 7 * per
    assert one["prompt_cache"] == eight["prompt_cache"] and one["prompt_cache"]["total"] > 0
    # attention split: each rank holds half the KDA state of each request, all the latent
    split = byte_budget.kv_state(tc, _limits(batch=8), attention_split=2)
    per_split = per - 69 * (4 * 96 * 128 * 128 + 2 * 3 * 3 * 96 * 128) // 2
    assert split["per_request"] == per_split
    for attention, each in (("replicated", per), ("split", per_split)):
        req = byte_budget.PlanRequest(ranks=2, lo="2bit-g128", attention=attention)
        plans = {b: byte_budget.make_plan(acc, Box(), _limits(batch=b), req) for b in (1, 8)}
        kv = {b: p["bytes_per_rank"]["kv_state"] for b, p in plans.items()}
        assert kv[8] - kv[1] == 7 * each
        assert plans[8]["promoted_total"] < plans[1]["promoted_total"]  # KV comes off experts
        assert "KV/state: batch 8 x 131,072 tokens" in plan.summary(plans[8])


def _split_rank_folder(folder: Path, size: int) -> Path:
    """Rank 0's config and manifest of the real K3 sliced with attention split over
    ``size`` ranks: what preflight reads."""
    tc = layout.text_config(real_config())
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(real_config()))
    split = [i for i in range(tc["num_hidden_layers"]) if layout.attention_heads(tc, i) % size == 0]
    (folder / "k3dist.json").write_text(
        json.dumps(
            {
                "kind": "rank",
                "rank": 0,
                "size": size,
                "attention": {"mode": "split", "split_layers": split},
            }
        )
    )
    return folder


def test_plan_defaults_are_the_real_deployments_limits(tmp_path):
    """The planner's defaults are the deployment the project ships, deploy/tb5.yaml read
    through the Deployment (not a copy), and its fields mean what the deployment's keys
    mean to the server: at tb5's limits and at others (another dtype, no prompt-cache
    bound), a box holding a deployment's limits budgets exactly the KV/state and prefill
    activations preflight checks that deployment with."""
    from k3dist.config.deployment import load_deployment
    from k3dist.serve import preflight

    tb5 = load_deployment(REPO / "deploy" / "tb5.yaml")
    assert byte_budget.shipped() == tb5
    req = byte_budget.PlanRequest()
    assert (req.attention, req.ranks) == (tb5.attention, tb5.size)
    tc = layout.text_config(real_config())
    folder = _split_rank_folder(tmp_path / "rank0", tb5.size)
    others = [
        load_deployment(None, max_context=8192, max_batch=3, prefill_chunk=64),
        load_deployment(
            None,
            max_context=20000,
            max_batch=1,
            prefill_chunk=512,
            prompt_cache_tokens=50000,
            dtype="float16",
        ),
    ]
    for dep in [tb5, *others]:
        box = byte_budget.Limits.of(dep)
        kv, act = preflight.serving_need(folder, dep)
        assert byte_budget.kv_state(tc, box, tb5.size)["total"] == kv["total"], dep
        assert byte_budget.activations(tc, box, tb5.size)["total"] == act["total"], dep


def test_a_plan_with_the_defaults_passes_tb5_preflight(acc, tmp_path):
    """A build planned with the defaults (real K3 config and tensor index) serves under
    deploy/tb5.yaml: the plan budgets the KV/state and activations preflight computes for
    tb5's limits, tb5's memory_headroom_gib holds them, and each rank's weights (rank 0 also
    holds the vision tower) + that headroom fit the wired limit the plan assumes, its
    runtime reserve left free."""
    from k3dist.config.deployment import load_deployment
    from k3dist.pipeline.slicing import vision_ranks
    from k3dist.serve import preflight

    tb5 = load_deployment(REPO / "deploy" / "tb5.yaml")
    box = Box()
    p = byte_budget.make_plan(acc, box, _limits(), byte_budget.PlanRequest(ranks=tb5.size))
    per = p["bytes_per_rank"]
    # a rank folder sliced for tb5 (attention split over its ranks): config + manifest
    tc = layout.text_config(real_config())
    folder = tmp_path / "rank0"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(real_config()))
    split = [
        i for i in range(tc["num_hidden_layers"]) if layout.attention_heads(tc, i) % tb5.size == 0
    ]
    assert len(split) == tc["num_hidden_layers"]  # K3: every layer's heads divide (96)
    (folder / "k3dist.json").write_text(
        json.dumps(
            {
                "kind": "rank",
                "rank": 0,
                "size": tb5.size,
                "attention": {"mode": tb5.attention, "split_layers": split},
            }
        )
    )
    kv, act = preflight.serving_need(folder, tb5)
    # the same arithmetic at the same limits: the plan budgets what preflight checks
    assert per["kv_state"] == kv["total"] == 24_727_643_136
    assert per["activations"] == act["total"] == 9_980_346_368
    # a 256-token chunk's activations are less than the copy of the 4 requests' caches a
    # joining prompt makes (15.39 GB): that copy is the transient, budgeted by both
    assert per["batch_join_extra"] == kv["requests"] - act["total"] == 5_413_912_576
    need = kv["total"] + act["total"] + per["batch_join_extra"]  # 40.12 GB, 37.37 GiB
    headroom = int(tb5.memory_headroom_gib * GiB)
    assert need + 5 * GiB <= headroom  # 44 GiB: 6.63 GiB beyond what is modelled
    vision = acc.classes["vision"]["source_bytes"]  # 0.89 GB, rank 0 only
    metal = {
        "max_recommended_working_set_bytes": box.wired_bytes,
        "memory_bytes": box.memory_bytes,
        "iogpu_wired_limit_mb": box.wired_limit_mb,
    }
    for rank in range(tb5.size):
        weights = (
            per["nonexpert"]
            + per["routed_experts"]
            + (vision if rank in vision_ranks(tb5.size) else 0)
        )
        assert weights + headroom <= box.usable_bytes  # 482.21 GiB <= 484
        assert (
            preflight.check_memory(
                folder, weights, headroom, box.memory_bytes, "given", metal, kv, act
            )
            == weights + headroom
        )


def test_k3_plan_fits_two_boxes(acc):
    p = byte_budget.make_plan(acc, Box(), _limits(), byte_budget.PlanRequest(ranks=2))
    per = p["bytes_per_rank"]
    assert per["total"] + p["headroom_requested"] <= p["budget_per_rank"]
    assert p["promoted_total"] > 0 and p["quality"]["expected"] is not None  # in the grid
    counts = [int(c) for c in p["promoted_per_layer"].values()]
    assert all(c % 2 == 0 for c in counts)  # hi bytes split evenly over the two ranks
    assert sum(counts) == p["promoted_total"]
    # the routed-expert bytes on a rank are exactly lo + promoted deltas
    hi_b = 17_547_264
    lo = acc.expert_bytes(qformat.QFormat.parse(p["lo"]["format"]))
    assert per["routed_experts"] == (92 * 896 * lo + p["promoted_total"] * (hi_b - lo)) // 2
    assert p["fallback_copy_bytes"] == p["promoted_total"] * lo


def test_more_budget_promotes_more_and_fallback_costs(acc):
    base = byte_budget.PlanRequest(ranks=2, lo="2bit-g128")
    a = byte_budget.make_plan(acc, Box(), _limits(), base)
    b = byte_budget.make_plan(
        acc,
        Box(),
        _limits(),
        byte_budget.PlanRequest(
            ranks=2, lo="2bit-g128", budget_per_rank=a["budget_per_rank"] + 20 * 10**9
        ),
    )
    c = byte_budget.make_plan(
        acc, Box(), _limits(), byte_budget.PlanRequest(ranks=2, lo="2bit-g128", lo_fallback=True)
    )
    assert b["promoted_total"] > a["promoted_total"] > c["promoted_total"]


def test_target_bpw(acc):
    p = byte_budget.make_plan(
        acc,
        Box(),
        _limits(),
        byte_budget.PlanRequest(
            ranks=2, lo="2bit-g128", target_expert_bpw=2.5, budget_per_rank=10**13
        ),
    )
    assert 2.45 < p["expert_bpw"] <= 2.5


def test_nothing_fits_says_why(acc):
    with pytest.raises(ValueError, match="nothing fits"):
        byte_budget.make_plan(
            acc, Box(), _limits(), byte_budget.PlanRequest(ranks=2, budget_per_rank=300 * 10**9)
        )


def test_k_hi_uniform_matches_issue_figures():
    # issue 12: uniform routing, 5% promoted, top-16: k_hi=4 overflows 7.4e-4, 6: 4e-6
    p4 = byte_budget.overflow_probability(896, 16, 45, 4)
    p6 = byte_budget.overflow_probability(896, 16, 45, 6)
    assert 5e-4 < p4 < 1e-3 and 1e-6 < p6 < 1e-5
    assert byte_budget.k_hi_uniform(896, 16, 45, 1e-5) == 6


def _plan_json(out: Path, *args: str) -> dict:
    """``python -m k3dist.pipeline.plan ARGS --dry-run --json --out OUT``: the plan."""
    r = subprocess.run(
        [sys.executable, "-m", "k3dist.pipeline.plan", *args, "--dry-run", "--json"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_cli_json(mini_src, tmp_path):
    p = _plan_json(
        tmp_path / "plan.json",
        *("--src", str(mini_src), "--budget", "1e9", "--context", "256"),
        *("--lo", "2bit-g32", "--headroom-gib", "0"),
    )
    assert p["command"].startswith("python -m k3dist.pipeline.plan --src ")
    # all fit but one lo expert per rank (no fallback: the lo bank is never empty)
    assert p["lo"]["format"] == "2bit-g32" and p["promoted_total"] == 5 * 14
    assert p["bytes_per_rank"]["total"] <= 1e9


def _sensitivity(tmp_path, kl: dict[str, dict[int, float]]) -> Path:
    """A benchmarks/quality/nonexpert.py-shaped file (rows: one class, one format, its KL)."""
    rows = [
        {"build": f"{c}-{b}bit", "class": c, "format": f"{b}bit-g64", "kl": v}
        for c, per in kl.items()
        for b, v in per.items()
    ]
    rows.append({"build": "all-6bit", "class": "all", "format": {}, "kl": 1.0})
    p = tmp_path / "sens.json"
    p.write_text(json.dumps({"rows": rows}))
    return p


def test_measured_nonexpert_fewest_bits_within_tolerance(tmp_path):
    sens = byte_budget.read_sensitivity(
        _sensitivity(
            tmp_path,
            {
                "attention": {8: 1e-4, 6: 5e-4, 5: 1.5e-3, 4: 4e-3},
                "embed": {8: 1e-5, 6: 2e-5, 5: 5e-5, 4: 1e-4},
                "lm_head": {8: 3e-3, 6: 9e-3, 5: 2e-2, 4: 5e-2},
            },
        )
    )
    fmts, origin = byte_budget.measured_nonexpert(sens, 2e-3)
    assert fmts["attention"] == "5bit-g64" and "KL 0.00150 <= 0.002" in origin["attention"]
    assert fmts["embed"] == "4bit-g64"
    assert fmts["lm_head"] == "bf16" and "no format within" in origin["lm_head"]
    assert (
        fmts["shared"] == byte_budget.DEFAULT_NONEXPERT["shared"] and origin["shared"] == "default"
    )
    fmts, _ = byte_budget.measured_nonexpert(sens, 1e-3)  # tighter: more bits
    assert fmts["attention"] == "6bit-g64"


def test_real_k3_plan_with_measured_formats(tmp_path):
    """Fewer non-expert bytes -> more promoted experts, and the plan says where each
    class's format came from."""
    sens = _sensitivity(
        tmp_path,
        {c: {8: 1e-4, 6: 5e-4, 5: 1e-3, 4: 1.5e-3} for c in ("attention", "shared", "embed")},
    )
    outs = {}
    for name, extra in (("default", []), ("measured", ["--nonexpert-sensitivity", str(sens)])):
        real = ("--config", str(REAL_K3_CONFIG), "--index", str(REAL_INDEX), "--ranks", "2")
        outs[name] = _plan_json(tmp_path / f"{name}.json", *real, *extra)
    d, m = outs["default"], outs["measured"]
    assert d["nonexpert_sensitivity"] is None
    assert m["nonexpert_sensitivity"]["kl_tolerance"] == byte_budget.DEFAULT_KL_TOLERANCE
    for c in ("attention", "shared", "embed"):
        assert m["nonexpert"][c]["format"] == "4bit-g64", c
    assert m["nonexpert"]["attention"]["from"].startswith("measured")
    assert m["nonexpert"]["latent"]["from"] == "default"
    assert m["bytes_per_rank"]["nonexpert"] < d["bytes_per_rank"]["nonexpert"]
    assert m["nonexpert_read_per_token_per_rank"] < d["nonexpert_read_per_token_per_rank"]
    assert m["promoted_total"] > d["promoted_total"]


# ----------------------------------------------------------------- the quality grid


def _grid(tmp_path, rows: list[tuple]) -> Path:
    """A grid file (benchmarks/quality/quality_grid.py --package's shape) of (lo, student, bpw,
    kl)."""
    p = tmp_path / "grid.json"
    p.write_text(
        json.dumps(
            {
                "provenance": {"command": "test", "commit": "-", "windows_per_domain": 1},
                "rows": [
                    {
                        "id": f"{lo}@{bpw}/{s}",
                        "lo": lo,
                        "student": s,
                        "expert_bpw": bpw,
                        "kl": kl,
                        "kl_p95": 3 * kl,
                        "flip": kl,
                    }
                    for lo, s, bpw, kl in rows
                ],
            }
        )
    )
    return p


def test_shipped_grid_says_where_it_comes_from():
    g = quality.QualityGrid.load()
    p = g.provenance
    assert p["command"].startswith("python benchmarks/quality/quality_grid.py")
    assert p["commit"] and p["windows_per_domain"] >= 1 and p["src"] == "data/mini-k3-sparse"
    assert {"1bit-g64", "2bit-g128"} <= set(g.formats)


def test_grid_interpolates_and_keeps_the_best_student(tmp_path):
    g = quality.QualityGrid.load(
        _grid(
            tmp_path,
            [
                ("1bit-g64", None, 1.5, 0.08),
                ("1bit-g64", "1bit-g64", 2.5, 0.06),
                ("1bit-g64", "2bit-g64", 2.5, 0.02),
            ],
        )
    )
    e = g.expected("1bit-g64", 2.0)
    assert e.student == "2bit-g64" and e.kl == pytest.approx(0.05)  # half way 0.08 -> 0.02
    assert e.rows == ("1bit-g64@1.5/None", "1bit-g64@2.5/2bit-g64")
    assert g.expected("1bit-g64", 2.51).rows == ("1bit-g64@2.5/2bit-g64",)  # at the edge
    assert g.expected("1bit-g64", 2.6) is None and g.expected("2bit-g128", 2.2) is None
    assert g.nearest("1bit-g64", 2.6).id == "1bit-g64@2.5/2bit-g64"


def test_auto_is_the_grids_best_at_every_budget(acc):
    """440e9..520e9 a rank: the chosen lo format has the lowest expected KL of the
    formats that fit, read from the shipped grid, and the pipeline's score student is
    that row's."""
    grid = quality.QualityGrid.load()
    for budget in range(440 * 10**9, 520 * 10**9 + 1, 10 * 10**9):
        p = byte_budget.make_plan(
            acc, Box(), _limits(), byte_budget.PlanRequest(ranks=2, budget_per_rank=budget)
        )
        e = p["quality"]["expected"]
        assert e is not None and p["quality"]["warning"] is None, budget
        fits = [o for o in p["alternatives"] if o["fits"]]
        best = min(
            (
                (grid.expected(o["lo"], o["expert_bpw"]), o["lo"])
                for o in fits
                if grid.expected(o["lo"], o["expert_bpw"]) is not None
            ),
            key=lambda x: x[0].kl,
        )
        assert p["lo"]["format"] == best[1] and e["kl"] == pytest.approx(best[0].kl, abs=1e-6)
        assert p["calib_student"] == best[0].student == e["calib_student"]
        assert "expected KL" in plan.summary(p)


def test_out_of_grid_refused_unless_named(acc, tmp_path):
    grid = str(_grid(tmp_path, [("3bit-g64", None, 3.5, 0.004)]))
    with pytest.raises(ValueError, match="no lo format that fits lies in the measured quality"):
        byte_budget.make_plan(acc, Box(), _limits(), byte_budget.PlanRequest(ranks=2, grid=grid))
    p = byte_budget.make_plan(
        acc, Box(), _limits(), byte_budget.PlanRequest(ranks=2, grid=grid, lo="2bit-g128")
    )
    assert p["quality"]["expected"] is None and p["calib_student"] == "2bit-g128"
    assert "nearest measured row 3bit-g64@3.5/None" in p["quality"]["warning"]
    assert "outside the measured grid" in plan.summary(p)


def test_boxes_of_different_memory(acc):
    """--boxes 512,256,256: every box within its budget, experts per layer in proportion
    to each box's room, the promoted ones in proportion to each rank's experts; two equal
    boxes plan as --ranks 2; a set below the grid's lowest measured bpw is refused with
    the numbers."""
    from k3dist.config.box import parse_boxes
    from k3dist.format.placement import hi_counts

    def plan_for(spec: str, **kw) -> dict:
        req = byte_budget.PlanRequest(boxes=parse_boxes(spec), **kw)
        return byte_budget.make_plan(acc, Box(), _limits(), req)

    p = plan_for("512,256,256")
    assert p["ranks"] == 3 and p["quality"]["expected"] is not None
    for b in p["per_box"]:
        assert b["total"] <= b["budget"] and b["headroom"] >= p["headroom_requested"]
    fixed = [b["total"] - b["routed_experts"] + p["headroom_requested"] for b in p["per_box"]]
    rooms = [b["budget"] - f for b, f in zip(p["per_box"], fixed, strict=True)]
    for layer, counts in p["experts_per_layer_per_rank"].items():
        assert sum(counts) == acc.num_experts
        want = [acc.num_experts * r / sum(rooms) for r in rooms]
        assert max(abs(c - w) for c, w in zip(counts, want, strict=True)) < 1.5
        hi = hi_counts(p["promoted_per_layer"][layer], counts)
        assert all(h <= c for h, c in zip(hi, counts, strict=True))
    assert sum(b["hi_experts"] for b in p["per_box"]) == p["promoted_total"]
    reads = [b["read_per_token"] for b in p["per_box"]]
    assert reads[0] > max(reads[1:]) and abs(reads[1] - reads[2]) < 1e-4 * reads[1]
    assert p["read_ratio"] == max(b["read_share_of_mean"] for b in p["per_box"])
    two = plan_for("512,512")
    one = byte_budget.make_plan(acc, Box(), _limits(), byte_budget.PlanRequest(ranks=2))
    assert (two["expert_bpw"], two["promoted_total"]) == (one["expert_bpw"], one["promoted_total"])
    # three 256 GB boxes: only 1-bit g64 fits, inside the grid since it measured 1bit-g64@1.5
    small = plan_for("256,256,256")
    assert small["lo"]["format"] == "1bit-g64" and small["quality"]["expected"] is not None
    with pytest.raises(ValueError, match="nothing fits"):
        plan_for("512,256", expert_split="equal")


def test_plan_for_a_deployment_of_boxes(tmp_path, capsys):
    """`k3dist-plan --deployment deploy/tb5-3.yaml` plans for the boxes it lists (memory
    and wired limit each) at its limits: the same plan as --boxes with those wired
    limits; a lower wired limit on one box gives that box less; deploy/tb5.yaml plans
    what the planner's defaults do; the pipeline's --deployment takes the same boxes."""
    from k3dist.pipeline import runner

    real = ["--config", str(REAL_K3_CONFIG), "--index", str(REAL_INDEX), "--json"]

    def run(*args: str) -> dict:
        plan.main([*real, *args])
        return json.loads(capsys.readouterr().out)

    tb5_3 = run("--deployment", str(REPO / "deploy" / "tb5-3.yaml"))
    flags = run("--boxes", "512:499712,256:237568,256:237568")
    assert {k: v for k, v in tb5_3.items() if k != "command"} == {
        k: v for k, v in flags.items() if k != "command"
    }
    assert [b["memory_gib"] for b in tb5_3["boxes"]] == [512, 256, 256]
    assert [b["wired_limit_mb"] for b in tb5_3["per_box"]] == [499712, 237568, 237568]
    assert all(b["budget"] == (b["wired_limit_mb"] << 20) - 4 * GiB for b in tb5_3["per_box"])
    assert tb5_3["quality"]["expected"] is not None
    # one 256 GB box wired 8 GiB lower: it holds fewer experts, the plan still fits
    text = (REPO / "deploy" / "tb5-3.yaml").read_text()
    lower = text.replace(
        "{memory_gib: 256, wired_limit_mb: 237568}   # mac-studio-3.local",
        "{memory_gib: 256, wired_limit_mb: 229376}   # mac-studio-3.local",
    )
    assert lower != text
    (tmp_path / "low.yaml").write_text(lower)
    low = run("--deployment", str(tmp_path / "low.yaml"))
    b1, b2 = low["per_box"][1:]
    assert b2["budget"] == b1["budget"] - 8 * GiB
    assert b2["routed_experts"] < b1["routed_experts"] and b2["total"] <= b2["budget"]
    layer = next(iter(low["experts_per_layer_per_rank"]))
    n1, n2 = low["experts_per_layer_per_rank"][layer][1:]
    assert n2 < n1
    # deploy/tb5.yaml names no boxes: its size of the default box, the defaults' plan
    tb5 = run("--deployment", str(REPO / "deploy" / "tb5.yaml"))
    default = run()
    assert {k: v for k, v in tb5.items() if k != "command"} == {
        k: v for k, v in default.items() if k != "command"
    }
    # the pipeline plans for the same boxes
    a, _ = runner.parse(["--real-k3", "--dry-run", "--deployment", "deploy/tb5-3.yaml"])
    assert (a.ranks, a.boxes) == (3, "512:499712,256:237568,256:237568")
    a, _ = runner.parse(["--real-k3", "--dry-run", "--deployment", "deploy/tb5.yaml"])
    assert (a.ranks, a.boxes) == (2, None)
