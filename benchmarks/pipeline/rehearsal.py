"""The dress rehearsal at Kimi K3's real counts (issue 26): every build stage on the
``k3counts`` preset (93 layers, 896 experts top-16, 497,220 tensors in Moonshot's 96
shards, only the widths shrunk), each run as its own command and measured: wall time,
peak RSS, bytes read and written, and the counts it scales with; then each projected to
the real K3 (1.56 TB).

    python benchmarks/pipeline/rehearsal.py --work /work/rehearsal [--stages synth,audit,...]
        [--out benchmarks/results/DATE/rehearsal.json]
    python benchmarks/pipeline/rehearsal.py --from-pipeline OUT/summary.json --out FILE

``--from-pipeline`` runs nothing: it reads the one-command pipeline's ``summary.json``
(``python -m k3dist.pipeline.runner`` on the preset: per stage wall and CPU seconds, peak
RSS, bytes through read/write and to disk) and projects each stage to the real K3 from
the pipeline's own disk plan of the real index (what each stage writes; it reads what
its inputs wrote).

Each stage runs in a child process (``python -c`` wrapper around the stage's own
``python -m`` command or script) that reports its own ``/proc/self/io`` (rchar/wchar:
bytes through read/write calls, page cache included) and ``getrusage`` at exit; the peak
RSS is the child's ``ru_maxrss`` from ``wait4``. Stages whose outputs exist are resumed
by the stage itself (journals), so a re-run of a finished stage measures its resume
cost; ``--fresh`` deletes a stage's output first. The stage list is data (``stages``):
the one-command pipeline can replace it later.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Runs the stage in this process so /proc/self/io and getrusage are the stage's own.
CHILD = r"""
import atexit, json, resource, runpy, sys, time
out, kind, target, *args = sys.argv[1:]
t0 = time.perf_counter()
def report():
    io = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
    ru = resource.getrusage(resource.RUSAGE_SELF)
    json.dump({"rchar": int(io["rchar"]), "wchar": int(io["wchar"]),
               "read_bytes": int(io["read_bytes"]), "write_bytes": int(io["write_bytes"]),
               "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
               "wall_s": time.perf_counter() - t0}, open(out, "w"))
atexit.register(report)
sys.argv = [target, *args]
if kind == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


@dataclass
class Stage:
    name: str
    argv: list[str]  # ["-m", module, *args] or [script, *args]
    outputs: list[str] = field(default_factory=list)  # paths under work, removed by --fresh
    scales_with: str = ""


def stages(work: Path, target_bpw: float, dwq_steps: int) -> list[Stage]:
    w = str(work)
    src, mx4, two = f"{w}/src", f"{w}/mxfp4", f"{w}/2bit"
    tok, teacher, cal = f"{w}/calib.npz", f"{w}/teacher", f"{w}/calib"
    graded, dwq = f"{w}/graded", f"{w}/graded-dwq"
    return [
        Stage(
            "synth",
            ["-m", "k3dist.factory.synth", "--out", src, "--preset", "k3counts"],
            [src],
            "tensors (497,220) + bytes",
        ),
        Stage(
            "audit",
            ["-m", "k3dist.pipeline.checkpoint", "audit", src, "--json"],
            [],
            "tensors (headers of 96 shards)",
        ),
        Stage(
            "convert-mxfp4",
            ["-m", "k3dist.pipeline.convert", "--src", src, "--out", mx4],
            [mx4],
            "bytes (copied expert by expert) + tensors",
        ),
        Stage(
            "convert-2bit",
            [
                "-m",
                "k3dist.pipeline.profiles",
                "--src",
                src,
                "--out",
                two,
                "--profile",
                "2bit",
                "--mxfp4",
                mx4,
            ],
            [two],
            "expert parameters (re-quantized)",
        ),
        Stage(
            "windows",
            [
                "-m",
                "k3dist.factory.windows",
                "--split",
                "calib",
                "--windows",
                "4",
                "--seq",
                "128",
                "--out",
                tok,
                "--tokenizer",
                src,
            ],
            [tok],
            "tokens",
        ),
        Stage(
            "teacher",
            [
                "-m",
                "k3dist.pipeline.teacher",
                "--build",
                mx4,
                "--tokens",
                tok,
                "--out",
                teacher,
                "--top-k",
                "64",
            ],
            [teacher],
            "weight bytes read once + tokens x active params",
        ),
        Stage(
            "calibrate",
            [
                "-m",
                "k3dist.pipeline.calibrate",
                "--student",
                two,
                "--teacher-build",
                mx4,
                "--teacher",
                teacher,
                "--tokens",
                tok,
                "--out",
                cal,
            ],
            [cal],
            "weight bytes read twice (fwd + bwd) + tokens x active params",
        ),
        Stage(
            "plan",
            [
                "-m",
                "k3dist.pipeline.plan",
                "--src",
                src,
                "--target-bpw",
                str(target_bpw),
                "--dry-run",
                "--json",
                "--out",
                f"{w}/plan.json",
            ],
            [f"{w}/plan.json"],
            "experts (82,432) + tensors",
        ),
        Stage(
            "grade",
            [
                "-m",
                "k3dist.pipeline.profiles",
                "--src",
                src,
                "--out",
                graded,
                "--profile",
                "graded",
                "--target-bpw",
                str(target_bpw),
                "--scores",
                f"{cal}/scores-taylor.npz",
                "--routes",
                f"{cal}/routes.npz",
                "--mxfp4",
                f"{w}/mxfp4-plan",
            ],
            [graded, f"{w}/mxfp4-plan"],
            "bytes (an MXFP4 base in the plan's non-expert formats, then re-quantized)",
        ),
        Stage(
            "dwq",
            [
                "-m",
                "k3dist.pipeline.dwq",
                "--teacher",
                teacher,
                "--student",
                graded,
                "--tokens",
                tok,
                "--out",
                dwq,
                "--steps",
                str(dwq_steps),
                "--window-batch",
                "2",
                "--valid-windows",
                "2",
            ],
            [dwq],
            "steps x blocks x (tokens x active params) + expert parameters",
        ),
        Stage(
            "slice",
            [
                "slicing/rank_split.py",
                "--all",
                "--size",
                "2",
                "--build",
                dwq,
                "--out",
                f"{w}/ranks/rank{{rank}}",
                "--attention",
                "split",
            ],
            [f"{w}/ranks"],
            "bytes (byte-range copies) + tensors",
        ),
    ]


# ----------------------------------------------------------------------------- projection
# Constants for the real K3 on an M3 Ultra (assumptions, stated; the same as docs/build.md's
# verify section: ~6.5 GB/s internal SSD, ~2 GB/s SHA-256 per performance core with
# ARMv8 SHA-2; GPU: half of the 80-core M3 Ultra's ~28 TFLOP/s peak, achieved).
SSD_BPS = 6.5e9
SHA256_BPS = 2.0e9
GPU_FLOPS = 14e12
REAL_TOKENS = 4096  # the pipeline's default calibration set: 16 windows x 256 tokens
DWQ_STEPS, DWQ_BATCH, DWQ_SEQ = 240, 8, 256  # the DWQ that met issue 13's goal
PLAN = REPO / "benchmarks/results/2026-12-02/plan-k3.json"


def real_sizes() -> dict[str, float]:
    """Bytes of the real K3's source, its builds and its active parameters per token."""
    from k3dist.factory import synth
    from k3dist.format import layout

    cfg = synth.real_config()
    tc = cfg["text_config"]
    specs = layout.source_specs(cfg)
    src = sum(s.nbytes for s in specs)
    experts = sum(s.nbytes for s in specs if s.family == "experts")
    nonexpert = src - experts
    n_exp = len(layout.moe_layers(tc)) * tc["num_experts"]
    expert_params = n_exp * 3 * tc["moe_intermediate_size"] * tc["routed_expert_hidden_size"]
    embed = tc["vocab_size"] * tc["hidden_size"]
    active = (
        len(layout.moe_layers(tc)) * tc["num_experts_per_token"] * expert_params / n_exp
        + nonexpert / 2
        - embed
    )
    graded = json.loads(PLAN.read_text())["build_bytes"] if PLAN.exists() else None
    return {
        "source": src,
        "mxfp4": src,
        "2bit": nonexpert + expert_params * 2.5 / 8,
        "graded": graded,
        "graded-dwq": graded,
        "ranks": graded,
        "expert_params": expert_params,
        "active_params": active,
        "experts": n_exp,
        "tensors": len(specs),
        "layers": tc["num_hidden_layers"],
    }


# stage -> (builds read, build written, FLOPs per token x tokens factor, what dominates)
def stage_model(name: str, r: dict) -> tuple[list[str], list[str], float]:
    f = 2 * r["active_params"]  # forward FLOPs per token
    return {
        "audit": ([], [], 0.0),
        "convert-mxfp4": (["source"], ["mxfp4"], 0.0),
        "convert-2bit": (["mxfp4"], ["2bit"], 0.0),
        "teacher": (["mxfp4"], [], f * REAL_TOKENS),
        "calibrate": (["2bit", "mxfp4"], [], 3 * f * REAL_TOKENS),
        "plan": ([], [], 0.0),
        # the graded profile first builds its own MXFP4 base (the plan's non-expert formats)
        "grade": (["source", "mxfp4"], ["mxfp4", "graded"], 0.0),
        "dwq": (
            ["mxfp4", "graded"],
            ["graded-dwq"],
            3 * f * DWQ_STEPS * DWQ_BATCH * DWQ_SEQ + f * REAL_TOKENS,
        ),
        "slice": (["graded-dwq"], ["ranks"], 0.0),
    }.get(name, ([], [], 0.0))


def project(stage: dict, r: dict) -> dict | None:
    """The stage on the real K3: disk (read + write at SSD_BPS), SHA-256 of what it
    writes (twice: file and tensor digests, one thread), compute (GPU_FLOPS), and the
    overhead that scales with counts, which the preset has at the real counts: its own
    CPU seconds (an upper bound: they include the preset's small byte and compute work;
    for the token stages, the CPU of a run on a quarter of the tokens where measured)."""
    if stage["stage"] not in (
        "audit",
        "convert-mxfp4",
        "convert-2bit",
        "teacher",
        "calibrate",
        "plan",
        "grade",
        "dwq",
        "slice",
    ):
        return None
    reads, write, flops = stage_model(stage["stage"], r)
    read_b = sum(r[b] for b in reads)
    write_b = sum(r[b] for b in write)
    terms = {
        "disk_read_s": read_b / SSD_BPS,
        "disk_write_s": write_b / SSD_BPS,
        "sha256_s": 2 * write_b / SHA256_BPS,
        "compute_s": flops / GPU_FLOPS,
        "count_overhead_s": min(
            stage.get("cpu_s", stage["wall_s"]), stage.get("small_tokens", {}).get("cpu_s", 1e30)
        ),
    }
    dominant = max(terms, key=terms.get)
    out = {
        "real_read_gb": round(read_b / 1e9, 1),
        "real_written_gb": round(write_b / 1e9, 1),
        **{k: round(v, 1) for k, v in terms.items()},
        "total_s": round(sum(terms.values()), 1),
        "dominant": dominant,
    }
    if read_b:
        out["overhead_vs_disk_read"] = round(terms["count_overhead_s"] / terms["disk_read_s"], 3)
    return out


# ------------------------------------------------------- the one-command pipeline's stages
# stage -> (what the count overhead scales with, the real stages' outputs it reads,
# whether what it writes goes through StreamWriter's two SHA-256 digests, FLOPs factor)
# The pipeline's stages on the real K3 (k3dist.pipeline.runner): what each scales with,
# and the bytes (names in real_pipeline_writes, summed) it reads, writes and hashes. The
# source is read through view.SourceView, never written as a base build. Graded writes
# each graded file as scratch, reads it back into the rank folders and deletes it: the
# scratch bytes are about the rank folders' (the non-expert copies aside). StreamWriter
# hashes a file's bytes once in wall time (file and tensor digests on two threads of
# their own); graded's scratch hashes nothing; DWQ rewrites every rank file in place.
PIPELINE_MODEL: dict[str, tuple[str, list[str], list[str], list[str]]] = {
    "tokens": ("tokens (the 163,840-entry tokenizer loaded, text tokenized)", [], ["tokens"], []),
    "teacher": (
        "source bytes read once + tokens x active params",
        ["source"],
        ["teacher"],
        [],
    ),
    # calibrate makes each layer 5 times (student: forward, the block's recompute, the
    # vjp; teacher: forward, vjp), 2 of them from disk on a 512 GB box: the student and
    # teacher views read the same source bytes back to back, and the vjp re-reads a
    # layer read in its block's recompute (<= 12 layers, ~200 GB: the page cache)
    "calibrate": (
        "source bytes read twice (student re-quantized to the lo bank in memory, teacher) "
        "+ tokens x active params (fwd + bwd) + expert parameters (dense expert gradients)",
        ["source", "source", "teacher"],
        ["calibrate"],
        [],
    ),
    "graded": (
        "source bytes (lo re-quantized, hi copied) + experts (82,432); scratch a file at a "
        "time, sliced into the rank folders",
        ["source", "rank_folders"],
        ["rank_folders", "rank_folders"],
        ["rank_folders"],
    ),
    "dwq": (
        "steps x blocks x (tokens x active params) + the rank folders rewritten in place",
        ["source", "teacher", "rank_folders"],
        ["rank_folders"],
        ["rank_folders"],
    ),
}
REAL_PIPELINE_ARGS = [
    "--real-k3",
    "--dry-run",
    "--target-bpw",
    "2.5944",
    "--dwq",
    "--windows",
    "16",
    "--seq",
    "256",
]


def constants(bytes_source: str) -> dict:
    """The projection's constants and where each comes from (``bytes_source``: where
    the real K3's byte counts come from)."""
    return {
        "ssd_bytes_per_s": SSD_BPS,
        "sha256_bytes_per_s_per_core": SHA256_BPS,
        "gpu_flops_achieved": GPU_FLOPS,
        "real_tokens": REAL_TOKENS,
        "dwq": [DWQ_STEPS, DWQ_BATCH, DWQ_SEQ],
        "sources": "SSD and SHA-256: README 'Weights checked before serving' (assumed "
        "M3 Ultra); GPU: half the ~28 TFLOP/s peak of an 80-core M3 Ultra (assumed); "
        + bytes_source,
    }


def real_pipeline_writes() -> dict[str, int]:
    """Bytes each pipeline stage writes on the real K3: the pipeline's own disk plan
    (``python -m k3dist.pipeline.runner`` + REAL_PIPELINE_ARGS: the real config and
    index shipped in k3dist/data, the real plan's expert bpw, 4,096 calibration tokens)."""
    from k3dist.pipeline import diskplan, runner

    a, _ = runner.parse(REAL_PIPELINE_ARGS)
    config, index, source_bytes = diskplan.read_config_index(a)
    acc = diskplan.account(a, config, index)
    plan = diskplan.make_plan(a, acc)
    d = diskplan.disk_plan(a, acc, plan, source_bytes)
    return {
        "source": source_bytes,
        "rank_folders": d["rank_folders_total"],
        **{r["stage"]: r["writes"] for r in d["stages"]},
    }


def measured_apart(co: dict) -> dict[str, float]:
    """Per stage, the count overhead ``benchmarks/pipeline/count_overhead.py`` measured apart
    from token compute, re-quantization and SHA-256 (its JSON): CPU seconds outside
    ``mx.eval``, the stage's own view build included."""
    out, view = co["cpu_s_outside_eval"], co["cpu_s_outside_eval"]["view_build"]
    parts = {
        "teacher": view + out["teacher_after_view"],
        "calibrate": view + out["calibrate"],
    }
    if "graded" in out:
        parts["graded"] = view + co["graded"]["outside_eval_less_sha256_s"]
    return parts


def project_pipeline(
    row: dict, writes: dict[str, int], r: dict, apart: dict[str, float] | None = None
) -> dict | None:
    """A pipeline stage on the real K3, as :func:`project`: disk read and write at SSD_BPS,
    SHA-256 of what StreamWriter hashes (PIPELINE_MODEL), compute at GPU_FLOPS,
    and the count overhead: the preset stage's CPU seconds (an upper bound: it includes
    the preset's own compute and bytes); ``apart`` (:func:`measured_apart`) adds the
    overhead measured apart from them."""
    if row["stage"] not in PIPELINE_MODEL:
        return None
    _, reads, wrote, hashed = PIPELINE_MODEL[row["stage"]]
    f = 2 * r["active_params"]
    flops = {
        "teacher": f * REAL_TOKENS,
        "calibrate": 3 * f * REAL_TOKENS,
        "dwq": 3 * f * DWQ_STEPS * DWQ_BATCH * DWQ_SEQ + f * REAL_TOKENS,
    }.get(row["stage"], 0.0)
    read_b = sum(writes[x] for x in reads)
    write_b = sum(writes[x] for x in wrote)
    terms = {
        "disk_read_s": read_b / SSD_BPS,
        "disk_write_s": write_b / SSD_BPS,
        "sha256_s": sum(writes[x] for x in hashed) / SHA256_BPS,
        "compute_s": flops / GPU_FLOPS,
        "count_overhead_s": row.get("cpu_s") or row["wall_s"],
    }
    out = {
        "real_read_gb": round(read_b / 1e9, 1),
        "real_written_gb": round(write_b / 1e9, 1),
        **{k: round(v, 1) for k, v in terms.items()},
        "total_s": round(sum(terms.values()), 1),
        "dominant": max(terms, key=terms.get),
    }
    if read_b:
        out["overhead_vs_disk_read"] = round(terms["count_overhead_s"] / terms["disk_read_s"], 3)
    if apart and row["stage"] in apart:
        out["count_overhead_apart_s"] = round(apart[row["stage"]], 1)
        if read_b:
            out["apart_vs_disk_read"] = round(apart[row["stage"]] / terms["disk_read_s"], 3)
    return out


def from_pipeline(summary_path: Path, out: str, count_overhead: Path | None = None) -> dict:
    """The per-stage table from one run of the one-command pipeline on the preset
    (its OUT/summary.json), each stage projected to the real K3."""
    summary = json.loads(summary_path.read_text())
    r = real_sizes()
    writes = real_pipeline_writes()
    co = json.loads(count_overhead.read_text()) if count_overhead else None
    apart = measured_apart(co) if co else None
    rows = []
    for st in summary["stages"]:
        if st["stage"] == "plan":
            continue
        row = {
            "stage": st["stage"],
            "skipped": st["skipped"],
            "wall_s": st["seconds"],
            "cpu_s": st.get("cpu_s"),
            "peak_rss_mb": round(st["peak_rss"] / 2**20, 1) if st.get("peak_rss") else None,
            "read_mb": round(st["rchar"] / 1e6, 1) if st.get("rchar") is not None else None,
            "written_mb": round(st["wchar"] / 1e6, 1) if st.get("wchar") is not None else None,
            "disk_read_mb": round((st.get("read_bytes") or 0) / 1e6, 1),
            "disk_written_mb": round((st.get("written_bytes") or 0) / 1e6, 1),
            "output_mb": round((st.get("output_bytes") or 0) / 1e6, 1),
            "scales_with": PIPELINE_MODEL.get(st["stage"], ("",))[0],
        }
        row["real_k3"] = project_pipeline(row, writes, r, apart)
        rows.append(row)
    report = {
        "command": "python benchmarks/pipeline/rehearsal.py " + " ".join(sys.argv[1:]),
        "pipeline_command": " ".join(summary["command"]),
        "summary": str(summary_path),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_1m": summary.get("loadavg_1m"),
        "peak_disk_in_out_measured": summary.get("peak_disk_in_out_measured"),
        "disk_plan_preset": summary.get("disk_plan"),
        "tokens_preset": (summary.get("tokens") or {}).get("shape"),
        "real_k3": r,
        "real_k3_stage_writes": writes,
        "count_overhead": {"file": str(count_overhead), "command": co["command"]} if co else None,
        "real_k3_pipeline_args": REAL_PIPELINE_ARGS,
        "constants": constants(
            "bytes each stage writes on the real K3: the pipeline's own disk plan "
            "(python -m k3dist.pipeline.runner " + " ".join(REAL_PIPELINE_ARGS) + "); "
            "a stage reads what its inputs wrote (k3dist.pipeline.stage_graph.READS, plus the "
            "base the DWQ teacher runs on)"
        ),
        "stages": rows,
    }
    tmp = Path(out + ".partial")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)
    return report


def run_stage(st: Stage, log_dir: Path) -> dict:
    rep = log_dir / f"{st.name}.io.json"
    rep.unlink(missing_ok=True)
    target = st.argv if st.argv[0] == "-m" else ["-p", str(REPO / st.argv[0]), *st.argv[1:]]
    cmd = [sys.executable, "-c", CHILD, str(rep), *target]
    t0 = time.perf_counter()
    with open(log_dir / f"{st.name}.log", "w") as log:
        p = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, TQDM_MININTERVAL="5"),
        )
        _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    out = {
        "stage": st.name,
        "command": "python "
        + " ".join(a if not a.startswith(str(REPO)) else os.path.relpath(a, REPO) for a in st.argv),
        "exit": code,
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(ru.ru_maxrss / 1024, 1),
        "scales_with": st.scales_with,
    }
    if rep.exists():
        io = json.loads(rep.read_text())
        out.update(
            read_mb=round(io["rchar"] / 1e6, 1),
            written_mb=round(io["wchar"] / 1e6, 1),
            disk_read_mb=round(io["read_bytes"] / 1e6, 1),
            disk_written_mb=round(io["write_bytes"] / 1e6, 1),
            cpu_s=round(io["user_s"] + io["sys_s"], 2),
        )
    if code:
        out["log_tail"] = (log_dir / f"{st.name}.log").read_text()[-2000:]
    return out


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def write_report(args, prior: dict[str, dict]) -> dict:
    order = [s.name for s in stages(args.work, args.target_bpw, args.dwq_steps)]
    r = real_sizes()
    rows = sorted(prior.values(), key=lambda s: order.index(s["stage"]))
    small = json.loads(Path(args.small_runs).read_text()) if args.small_runs else {}
    for row in rows:
        if row["stage"] in small:
            row["small_tokens"] = small[row["stage"]]
        row["real_k3"] = project(row, r)
    report = {
        "command": "python benchmarks/pipeline/rehearsal.py " + " ".join(sys.argv[1:]),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "preset": "k3counts (python -m k3dist.factory.synth --preset k3counts)",
        "preset_bytes": {
            p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            for p in (
                args.work / n for n in ("src", "mxfp4", "2bit", "graded", "graded-dwq", "ranks")
            )
            if p.exists()
        },
        "real_k3": {k: v for k, v in r.items()},
        "constants": constants("graded build bytes: benchmarks/results/2026-12-02/plan-k3.json"),
        "stages": rows,
    }
    tmp = Path(args.out + ".partial")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)
    return report


def table(report: dict) -> str:
    """The rehearsal table: measured on the preset, projected to the real K3."""
    lines = [
        "| stage | preset wall s (cpu s) | peak RSS MB | read / written MB | scales with "
        "| real K3: read / written GB | disk s | sha256 s | compute s | count overhead s "
        "(of disk read) | measured apart s (of disk read) | dominant |",
        "|" + "---|" * 12,
    ]
    for s in report["stages"]:
        p = s.get("real_k3")
        if not p:
            continue
        frac = p.get("overhead_vs_disk_read")
        apart = p.get("count_overhead_apart_s")
        apart = "" if apart is None else f"{apart:.0f} ({100 * p['apart_vs_disk_read']:.1f} %)"
        lines.append(
            f"| {s['stage']} | {s['wall_s']:.0f} ({s.get('cpu_s') or 0:.0f}) | "
            f"{s['peak_rss_mb'] or 0:.0f} | {s.get('read_mb') or 0:.0f} / "
            f"{s.get('written_mb') or 0:.0f} "
            f"| {s['scales_with']} | {p['real_read_gb']:.0f} / {p['real_written_gb']:.0f} | "
            f"{p['disk_read_s'] + p['disk_write_s']:.0f} | {p['sha256_s']:.0f} | "
            f"{p['compute_s']:.0f} | {p['count_overhead_s']:.0f}"
            f"{f' ({100 * frac:.0f} %)' if frac is not None else ''} | {apart} | "
            f"{p['dominant'].removesuffix('_s')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="folder for every stage's output")
    ap.add_argument("--stages", help="comma-separated subset (default: all, in order)")
    ap.add_argument("--fresh", action="store_true", help="delete each stage's output first")
    ap.add_argument(
        "--target-bpw",
        type=float,
        default=2.5944,
        help="routed-expert bits per weight: the real K3 plan's "
        "(benchmarks/results/2026-12-02/plan-k3.json), scale-free",
    )
    ap.add_argument("--dwq-steps", type=int, default=2)
    ap.add_argument("--out", help="also write the JSON here (merged by stage)")
    ap.add_argument(
        "--small-runs",
        help="JSON {stage: {tokens, cpu_s, command}}: teacher / "
        "calibrate on fewer tokens, separating count overhead from token compute",
    )
    ap.add_argument(
        "--table",
        action="store_true",
        help="print the rehearsal table from --out and exit (no stage runs)",
    )
    ap.add_argument(
        "--from-pipeline",
        type=Path,
        metavar="SUMMARY",
        help="no stage runs: the table from the one-command pipeline's OUT/summary.json "
        "(python -m k3dist.pipeline.runner on the preset), projected; written to --out",
    )
    ap.add_argument(
        "--count-overhead",
        type=Path,
        metavar="JSON",
        help="with --from-pipeline: benchmarks/pipeline/count_overhead.py's report on the same "
        "preset, the count overhead measured apart from compute and SHA-256",
    )
    args = ap.parse_args()
    if args.from_pipeline:
        if not args.out:
            ap.error("--from-pipeline needs --out")
        print(table(from_pipeline(args.from_pipeline, args.out, args.count_overhead)))
        return
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return

    if args.work is None:
        ap.error("--work is needed to run stages")
    args.work.mkdir(parents=True, exist_ok=True)
    log_dir = args.work / "logs"
    log_dir.mkdir(exist_ok=True)
    todo = stages(args.work, args.target_bpw, args.dwq_steps)
    if args.stages:
        names = args.stages.split(",")
        unknown = set(names) - {s.name for s in todo}
        if unknown:
            raise SystemExit(
                f"unknown stages {sorted(unknown)}; choose from {[s.name for s in todo]}"
            )
        todo = [s for s in todo if s.name in names]
    prior = {}
    if args.out and Path(args.out).exists():
        prior = {s["stage"]: s for s in json.loads(Path(args.out).read_text())["stages"]}
    for st in todo:
        if args.fresh:
            for o in st.outputs:
                p = Path(o)
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        before = load_avg()
        r = run_stage(st, log_dir)
        r["load_before"], r["load_after"] = before, load_avg()
        print(json.dumps(r), flush=True)
        prior[st.name] = r
        if args.out:
            write_report(args, prior)
        if r["exit"]:
            raise SystemExit(
                f"stage {st.name} failed (exit {r['exit']}); log: {log_dir / (st.name + '.log')}"
            )


if __name__ == "__main__":
    main()
