"""The one-command pipeline (k3dist.pipeline.runner): docs/build.md's block run as written on
k3dist/data/mini-k3 and its rank folders served on 2 ranks; the real K3's disk plan; calibration
text through the source's own tokenizer; a published mlx-lm build audited, sliced and
served equal to single-process mlx-lm; a non-loopback server without a key refused."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from k3dist import MINI_K3
from k3dist.bench.greedy import greedy
from k3dist.format import tokens
from k3dist.format.folder import REAL_K3_CONFIG, REAL_K3_INDEX
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import (
    calibtext,
    diskplan,
    mlxbuild,
    progress,
    runner,
    slicing,
    stage_cost,
    stage_graph,
)
from k3dist.serve import auth

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import load_model, quantize_model, save_config, save_model
from serving import Server, wait_logs
from util import REPO, generate_on_ranks, load_f32

MINI = MINI_K3


def readme_pipeline_block() -> str:
    text = (REPO / "docs" / "build.md").read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"```sh\n(.*?)```", text, re.S)]
    found = [b for b in blocks if "k3dist-pipeline --src k3dist/data/mini-k3" in b]
    assert len(found) == 1, "docs/build.md: one ```sh block runs the pipeline on the mini-K3"
    return found[0]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """docs/build.md's block, verbatim, in a fresh folder holding only data/, the package
    (its k3dist/data/ is the block's source; a k3dist/ folder in the working directory is
    what the stages' python -m imports, so it is the package itself) and .venv/ (this
    interpreter's)."""
    tmp = tmp_path_factory.mktemp("readme")
    (tmp / "data").symlink_to(REPO / "data")
    (tmp / "k3dist").symlink_to(REPO / "k3dist")
    (tmp / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    block = readme_pipeline_block()
    out = re.search(r"--out (\S+)", block).group(1)
    r = subprocess.run(
        ["bash", "-ec", block], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp, tmp / out, block, env, r


def test_readme_block_makes_rank_folders_and_a_summary(readme_run):
    tmp, out, _, _, r = readme_run
    print("\n" + r.stdout[-1500:])
    summary = json.loads((out / stage_graph.SUMMARY).read_text())
    stages = [s["stage"] for s in summary["stages"]]
    # no base build and no student build: both are read from the source in memory; the
    # graded build goes straight into the rank folders
    assert stages == ["plan", "tokens", "teacher", "calibrate", "graded"]
    for s in summary["stages"][1:]:
        assert not s["skipped"] and s["seconds"] > 0 and s["peak_rss"] > 0, s
        # the stage's own CPU and bytes through read/write (benchmarks/pipeline/rehearsal.py
        # --from-pipeline projects from them)
        assert 0 < s["cpu_s"] and s["rchar"] > 0 and s["wchar"] > 0, s
    for r_ in (0, 1):
        m = json.loads((out / f"rank{r_}" / "k3dist.json").read_text())
        assert m["rank"] == r_ and m["size"] == 2
    # scratch went once read: only the token set and the calibration scores remain
    assert sorted(p.name for p in (out / "work").iterdir()) == ["calib", "tokens.npz"]
    tokens = summary["tokens"]
    assert tokens["shares"]["domain"] == {"code": 0.5, "prose": 0.5}
    assert any("zh" in w for w in tokens["warnings"])
    # the peak the plan promised holds what was written
    assert summary["disk_plan"]["rank_folders_total"] > 0
    # OUT/progress.json: every stage done, the streaming ones with the bytes they read
    # (the stage's own rchar) against the planned bytes; quiet off a terminal
    prog = progress.read(out)
    assert [x["stage"] for x in prog["stages"]] == stages
    assert prog["current"] is None and prog["eta_s"] == 0
    by = {x["stage"]: x for x in prog["stages"]}
    for s in summary["stages"]:
        x = by[s["stage"]]
        assert x["state"] == "done" and x["eta_s"] == 0, x
        if s["stage"] in stage_cost.READS_PER_SOURCE_BYTE:
            assert x["bytes_done"] == s["rchar"] and x["bytes_total"] > 0, x
            assert x["rate_bytes_per_s"] > 0 and x["cpu_model_s"] > 0 and x["cpu_s"] > 0, x
    assert prog["cpu_factor"] > 0
    assert "ETA" not in r.stdout and "\r" not in r.stdout


def test_progress_lines_and_eta_follow_a_working_process(tmp_path):
    """A stage's progress on a terminal: before its CPU share is measured, the cost
    model's ETA, said as such; then the model's CPU seconds left over the share the
    process gets; the next stage from the model, scaled by how the finished stage's CPU
    seconds compared with its model; its bytes read against the plan."""
    import io

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(8 << 20))
    costs = {
        "teacher": stage_cost.StageCost(8 << 20, 1.5),
        "graded": stage_cost.StageCost(16 << 20, 2.0),
    }
    shown = progress.Progress(
        tmp_path, ["teacher", "graded"], costs, stream=io.StringIO(), tty=True, every_s=0.05,
        min_window_s=0.3,
    )  # fmt: skip
    before = progress.read(tmp_path)
    assert before["eta_s"] == 3.5 and before["eta_source"] == "model"
    assert [x["eta_source"] for x in before["stages"]] == ["model", "model"]
    # reads 1 MiB, then works 0.12 CPU seconds, 8 times
    code = (
        "import sys, time\n"
        "with open(sys.argv[1], 'rb', buffering=0) as f:\n"
        "    while f.read(1 << 20):\n"
        "        t = time.process_time()\n"
        "        while time.process_time() - t < 0.12:\n"
        "            pass\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(src)])
    watch = shown.watch("teacher", child.pid)
    early = progress.read(tmp_path)["stages"][0]
    mid = None
    while child.poll() is None:
        snap = progress.read(tmp_path)
        t = snap["stages"][0]
        if mid is None and t["eta_source"] == "measured" and t["cpu_s"] < 1.0:
            mid = snap
        time.sleep(0.02)
    watch.finish(True, src.stat().st_size, 1.2)
    # nothing measured yet: the model's CPU seconds at a share of 1, less the time it ran
    assert early["state"] == "running" and early["eta_source"] == "model", early
    assert early["eta_s"] == pytest.approx(1.5 - early["seconds"], abs=0.15)
    assert mid is not None
    t, g = mid["stages"]
    assert t["state"] == "running" and g["state"] == "pending"
    # ETA = the model's CPU seconds left / the share the process gets
    assert 0 < t["cpu_share"] <= 1.05, t
    assert t["eta_s"] == pytest.approx((1.5 - t["cpu_s"]) / t["cpu_share"], abs=0.11)
    assert g["eta_source"] == "model"
    assert g["eta_s"] == pytest.approx(2.0 / mid["cpu_share"], abs=0.11)
    assert mid["eta_s"] == pytest.approx(t["eta_s"] + g["eta_s"], abs=0.2)
    # a tenth of the way in, the ETA was recorded (a run's estimate checked at its end)
    end = progress.read(tmp_path)
    at = end["stages"][0]["at_10pct"]
    assert at["elapsed_s"] >= 0 and at["eta_s"] > 0 and at["eta_source"] in ("model", "measured")
    assert end["stages"][0]["state"] == "done" and end["stages"][0]["bytes_done"] == 8 << 20
    # graded: the model's 2 CPU s times this machine against teacher's model (1.2 / 1.5)
    assert end["cpu_factor"] == pytest.approx(0.8)
    assert end["stages"][1]["eta_s"] == pytest.approx(1.6 / end["cpu_share"], abs=0.1)
    text = shown.stream.getvalue()
    assert "[1/2] teacher" in text and "of 8.4 MB" in text
    assert "(model; run:" in text and "(measured; run:" in text
    assert text.endswith("\n")  # the stage's last line is left in place


def test_readme_block_again_skips_every_stage(readme_run):
    tmp, _, block, env, _ = readme_run
    r = subprocess.run(
        ["bash", "-ec", block], cwd=tmp, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("current, skipped") == 5, r.stdout


def test_adding_dwq_later_remakes_the_deleted_scratch_it_reads(readme_run):
    _, out, block, _, _ = readme_run
    argv = shlex.split(block.split("k3dist-pipeline", 1)[1])
    state = json.loads((out / stage_graph.STATE).read_text())
    a, _ = runner.parse(argv)
    a.out = str(out)
    assert runner.first_to_run(a, state, stage_graph.keys(a)) == len(stage_graph.stages(a))
    a, _ = runner.parse([*argv, "--dwq"])
    a.out = str(out)
    # DWQ reads the teacher (deleted once calibration read it) and a graded build (never
    # written without --dwq): everything from the teacher runs again
    first = runner.first_to_run(a, state, stage_graph.keys(a))
    assert stage_graph.stages(a)[first] == "teacher"


def test_dwq_rewrites_the_rank_folders_in_place(tmp_path):
    """--dwq on the mini: the graded build goes into the rank folders and DWQ rewrites
    them there (k3dist.pipeline.dwq, ranks=): no whole build is written; the same command
    again skips every stage; without --dwq the graded rank folders come back."""
    from k3dist.format import manifest, verify

    argv = shlex.split(readme_pipeline_block().split("k3dist-pipeline", 1)[1])
    i = argv.index("--out")
    argv[i + 1] = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "k3dist.pipeline.runner", *argv, "--dwq", "--dwq-steps", "2"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / stage_graph.SUMMARY).read_text())
    stages = ["plan", "tokens", "teacher", "calibrate", "graded", "dwq"]  # no slice stage
    assert [s["stage"] for s in summary["stages"]] == stages
    ranks = [out / f"rank{r_}" for r_ in (0, 1)]
    hashes = set()
    for rank in ranks:
        m = manifest.verify(rank, "rank")
        verify.verify_folder(rank, m, "full")
        hashes.add(m["build_hash"])
    state = json.loads((out / stage_graph.STATE).read_text())
    assert [s for s, _ in state["ranks_by"]] == ["graded", "dwq"]
    assert state["stages"]["dwq"]["dwq_blocks"]
    # scratch gone: no graded build, no DWQ build, no teacher
    assert sorted(p.name for p in (out / "work").iterdir()) == ["calib", "tokens.npz"]
    folders = sum(diskplan.du(r_) for r_ in ranks)
    teacher_b = state["stages"]["teacher"]["output_bytes"]
    # the measured peak: the rank folders, the teacher DWQ reads, a few files of scratch
    # (a whole build beside them would be another ~folders)
    assert summary["peak_disk_in_out_measured"] < folders + teacher_b + 3 * 2**20
    assert summary["peak_disk_in_out_measured"] <= summary["disk_plan"]["peak_out"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.count("current, skipped") == 6, r.stdout
    # without --dwq: the graded build again (only its stage runs)
    r = subprocess.run(cmd[:-3], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("current, skipped") == 4, r.stdout
    graded = {manifest.verify(r_, "rank")["build_hash"] for r_ in ranks}
    assert len(graded) == 1 and graded != hashes


def test_pipeline_rank_folders_serve_on_two_ranks(readme_run):
    tmp, out, _, _, _ = readme_run
    srv = Server(str(out / "rank{rank}"), tmp / "srv", ("--no-warmup",))
    try:
        c = srv.client().completions.create(
            model="kimi-k3", prompt="def add(a, b):\n", max_tokens=8, temperature=0
        )
        assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8
        logs = wait_logs(srv, 0, 1)  # rank 1 logs when its own generation ends
        assert logs[0] and logs[0] == logs[1]  # both ranks generated the same tokens
    finally:
        srv.stop()


def test_real_k3_disk_plan_from_config_and_index():
    a = stage_graph.Args(
        src=None,
        out="/nonexistent-k3dist-out",
        budget=480e9,
        config=str(REAL_K3_CONFIG),
        index=str(REAL_K3_INDEX),
    )
    d = runner.run(a, dry_run=True)["disk_plan"]
    writes = {s["stage"]: s["writes"] for s in d["stages"]}
    assert d["source_bytes"] == 1_560_860_324_864
    # (at 480e9 the quality grid's best lo is 2-bit g128: k3dist/data/quality-grid.json)
    # no base (1.495 TB) and no 2-bit student (559 GB): read from the source in memory;
    # the graded build written into the rank folders with one graded file of scratch
    assert list(writes) == ["plan", "tokens", "teacher", "calibrate", "graded"]
    assert d["rank_folders_total"] == 863_457_452_032
    assert writes["graded"] == 863_457_452_032 + 9_300_461_056  # + the largest layer
    assert (d["peak_out"], d["peak_stage"]) == (872_761_091_584, "graded")
    assert d["goal_bytes"] == 1_560_860_324_864 + int(1.1 * 863_457_452_032)
    assert d["peak_with_source"] == 2_433_621_416_448 and d["goal_met"]
    # --dwq: DWQ rewrites the rank folders in place, one rank file at a time (at most the
    # largest graded file), beside the teacher and the propagated state: met too
    a.dwq = True
    d = runner.run(a, dry_run=True)["disk_plan"]
    writes = {s["stage"]: s["writes"] for s in d["stages"]}
    assert list(writes) == ["plan", "tokens", "teacher", "calibrate", "graded", "dwq"]
    assert writes["graded"] == 863_457_452_032 + 9_300_461_056
    teacher_b = writes["teacher"]
    assert writes["dwq"] == 9_300_461_056 + 1_057_095_680 + (1 << 20)  # + states + small
    assert (d["peak_out"], d["peak_stage"]) == (881_789_003_264, "dwq")
    assert d["peak_out"] == 863_457_452_032 + teacher_b + writes["dwq"] + (1 << 20) + 2_129_920
    assert d["peak_with_source"] == 2_442_649_328_128 and d["goal_met"]


def test_refuses_with_the_numbers_when_the_disk_is_too_small(tmp_path):
    src = tmp_path / "k3"  # the real K3's config + index, no weights
    src.mkdir()
    shutil.copyfile(REAL_K3_CONFIG, src / "config.json")
    with open(src / "model.safetensors.index.json", "wb") as f:
        import gzip

        f.write(gzip.decompress(REAL_K3_INDEX.read_bytes()))
    if shutil.disk_usage(tmp_path).free > 900_000_000_000:
        pytest.skip("this filesystem holds the real K3's peak")
    a = stage_graph.Args(src=str(src), out=str(tmp_path / "out"), budget=480e9, dwq=True)
    with pytest.raises(CheckpointError, match=r"need 2\.95 GiB .* in DWQ .* raise --cap"):
        runner.run(a)  # 3 copies of 4,096 tokens' states: refused before any stage
    a = stage_graph.Args(src=str(src), out=str(tmp_path / "out"), budget=480e9)
    with pytest.raises(CheckpointError, match=r"needs 872\.8 GB at its peak \(during graded\)"):
        runner.run(a)
    assert not (tmp_path / "out").exists()  # nothing written


def test_calibration_text_through_the_source_tokenizer(tmp_path):
    lines = [
        {"text": f"def f{i}(x):\n    return x * {i}\n" * 20, "domain": "code"} for i in range(40)
    ]
    lines.append(
        {"text": "The quick brown fox jumps over the lazy dog. " * 3, "domain": "prose"}
    )  # one window of 40: 2.5 %
    (tmp_path / "mix.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    rec = calibtext.make(MINI, tmp_path / "t.npz", [str(tmp_path / "mix.jsonl")], 40, 32)
    got = np.load(tmp_path / "t.npz")
    assert got["inputs"].shape == (40, 32)
    assert (got["targets"][:, :-1] == got["inputs"][:, 1:]).all()
    # the source's own tiktoken model, read independently of mlx-lm, gives the same ids
    first = tokens.load_encoding(MINI).encode_ordinary(lines[0]["text"])
    assert got["inputs"][0].tolist() == first[:32]
    shares = rec["shares"]["domain"]
    assert shares["prose"] < calibtext.MIN_SHARE < shares["code"]
    assert any("domain 'prose'" in w for w in rec["warnings"]), rec["warnings"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(calibtext.CalibTextError, match=r"bad.jsonl:2: not JSON"):
        calibtext.read_sources([tmp_path / "bad.jsonl"])


def _publish(build: Path, out: Path) -> Path:
    """A K3 build as mlx-lm writes one: loaded with load_model, experts dequantized and
    re-quantized uniform affine 4-bit, saved with save_model/save_config; no k3dist.json."""
    model, config = load_model(build)
    swaps = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedSwitchLinear):
            w = mx.dequantize(
                m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode
            )
            f = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias=False)
            f.weight = w.astype(mx.bfloat16)
            swaps.append((name, f))
    model.update_modules(tree_unflatten(swaps))
    config.pop("quantization", None)
    model, config = quantize_model(
        model, config, 32, 4, quant_predicate=lambda p, m: "switch_mlp" in p
    )
    save_model(out, model)
    save_config(config, out / "config.json")
    for n in ("tiktoken.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(build / n, out / n)
    return out


def test_published_mlx_build_audited_sliced_and_served(mini_build, tmp_path):
    pub = _publish(mini_build, tmp_path / "pub")
    assert not (pub / "k3dist.json").exists()
    r = mlxbuild.audit_build(pub)
    assert r["ok"], r["findings"]
    assert "mlx_lm_model_names_and_shapes" in r["checks"] and r["cannot_verify"]
    assert r["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert not mlxbuild.audit_build(pub, ranks=3)["ok"]  # 64 experts over 3 ranks
    model, config = load_f32(pub)
    vocab = config["text_config"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab - 256, size=40).tolist()
    tokens, logits = greedy(model, prompt, 16)
    ranks = str(tmp_path / "ranks" / "rank{rank}")
    slicing.slice_all(pub, ranks, 2, progress=False)
    for i, x in enumerate(generate_on_ranks(ranks, tmp_path, prompt, 16)):
        assert x["tokens"].tolist() == tokens
        diff = float(np.abs(x["logits"] - logits).max())
        print(f"\nrank {i}: max |logit - single-process mlx-lm| = {diff:.3g}")
        assert diff < 1e-4


def test_open_bind_without_a_key_refuses_naming_the_fix(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))  # no ~/.k3dist-key here
    r = subprocess.run(
        [sys.executable, "launch/serve.py", "--config", "deploy/tb5.yaml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "refusing to start: api_key_file" in r.stderr and "write the key" in r.stderr
    (tmp_path / "open.yaml").write_text("host: 0.0.0.0\n")
    r = subprocess.run(
        [sys.executable, "launch/serve.py", "--config", str(tmp_path / "open.yaml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "no API key is set" in r.stderr and "api_key_file" in r.stderr
    assert "--allow-no-api-key" in r.stderr
    auth.check_exposure("0.0.0.0", None, allow_no_key=True)
    auth.check_exposure("127.0.0.1", None)
    auth.check_exposure("::1", None)
    auth.check_exposure("0.0.0.0", "a-long-key")
