"""The quality table at the real K3 plan's operating points (issue 27): uniform and
graded low-bit builds of a mini-K3 whose experts are 128 wide (``data/mini-k3-sparse``,
so 2-bit g64/g128 and 3-bit g64 exist) against its MXFP4 teacher
(``python -m k3dist.bench.evaluate``: mean and p95 KL per token, top-1 flip, per-domain
perplexity, expert bpw and bytes, measured ``k_hi`` drop rate).

Steps under ``--runs`` (default ``runs/quality-bits``; each reused when its output exists):

1. the MXFP4 build of ``--src`` (``k3dist.pipeline.convert``) and the uniform builds
   ``2bit-g128`` (2.25 bpw), ``2bit-g64`` (2.5), ``2bit-g32`` (3.0), ``3bit-g64`` (3.5)
   (``k3dist.pipeline.promote --per-layer 0``);
2. the calibration token set (``calib`` split), the streamed teacher on it and the
   sensitivity scores on the uniform 2-bit g64 build (``k3dist.pipeline.calibrate``);
3. graded builds at a target expert bpw with a given lo bank (``--graded``, e.g.
   ``2.6:2bit-g64``): the promoted count is what the target buys over the lo format
   (``(target - lo) / (4.25 - lo)`` of the experts), chosen over all layers at once by
   the score (``--global``, per layer a multiple of 2: two ranks), ``k_hi`` per layer the
   calibration routes' observed maximum;
4. block-aligned DWQ (``k3dist.pipeline.dwq``) of the ``--dwq-for`` rows against the teacher
   on ``--dwq-calib-windows`` calibration windows: rows ``<row>-dwq``;
5. ``evaluate`` of every row on the same held-out windows: the rows of steps 1-3 in a
   second process while DWQ trains (two cores), the DWQ rows after it; one report.

    python benchmarks/quality/quality_bits.py --src data/mini-k3-sparse --windows 8 \\
        --graded 2.5944:2bit-g64,2.5944:2bit-g128,2.5:2bit-g128,3.0:2bit-g64 \\
        --dwq-for graded-2.5944-2bit-g128,graded-2.5-2bit-g128,2bit-g64 --dwq-steps 30 \\
        --dwq-calib-windows 16 --out benchmarks/results/2026-12-02/quality-bits-b.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3dist.bench import evaluate  # noqa: E402
from k3dist.format import layout  # noqa: E402
from k3dist.format.folder import load_config  # noqa: E402

import _steps as steps  # noqa: E402
from _steps import PY, run  # noqa: E402

UNIFORM = ("2bit-g128", "2bit-g64", "2bit-g32", "3bit-g64")
GRADED = ("2.6:2bit-g64", "2.6:2bit-g128", "3.0:2bit-g64")


def merge(parts: list[dict]) -> dict:
    """One report from evaluations of disjoint rows on the same teacher and windows."""
    first = parts[0]
    for p in parts[1:]:
        same = ("teacher", "split", "seq", "windows_per_domain", "tokens_per_domain")
        if any(p[k] != first[k] for k in same):
            raise SystemExit(
                "evaluations disagree on the teacher or the windows: "
                f"{[{k: q[k] for k in same} for q in parts]}"
            )
    return {
        **first,
        "rows": [r for p in parts for r in p["rows"]],
        "seconds": round(sum(p["seconds"] for p in parts), 1),
        "command": [p.get("command") for p in parts],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default="data/mini-k3-sparse", help="Moonshot-format mini-K3")
    ap.add_argument("--runs", type=Path, default=Path("runs/quality-bits"))
    ap.add_argument("--windows", type=int, default=12, help="held-out windows per domain")
    ap.add_argument("--calib-windows", type=int, default=8, help="calibration windows/domain")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--uniform", default=",".join(UNIFORM))
    ap.add_argument("--graded", default=",".join(GRADED), help="comma-separated TARGET_BPW:LO rows")
    ap.add_argument("--score", default="taylor", help="promotion score (calibrate's)")
    ap.add_argument(
        "--calib-student",
        default="2bit-g64",
        help="the uniform row whose errors the scores measure",
    )
    ap.add_argument(
        "--dwq-for",
        default="",
        help="comma-separated row names to DWQ; "
        "ROW:bf16 with bf16 Adam state (dwq --state bf16), ROW:s1 with batch "
        "seed 1 (DWQ's run-to-run noise): rows ROW-dwq, ROW-dwq-bf16, ROW-dwq-s1",
    )
    ap.add_argument("--dwq-steps", type=int, default=60)
    ap.add_argument("--dwq-calib-windows", type=int, default=32)
    ap.add_argument("--dwq-lr", type=float, default=1e-3)
    ap.add_argument("--dwq-batch", type=int, default=None)
    ap.add_argument("--dwq-valid-windows", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    runs = a.runs
    runs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def stage(name: str, t: float) -> None:
        timings[name] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    mxfp4 = steps.mxfp4(a.src, runs / "mxfp4")
    E = layout.text_config(load_config(mxfp4))["num_experts"]
    zeros = steps.zero_scores(mxfp4, runs / "zeros.npz")
    rows: list[steps.Row] = []
    for fmt in filter(None, a.uniform.split(",")):
        rows.append((steps.uniform(mxfp4, fmt, runs / fmt, zeros), fmt, "-"))
    stage("convert+uniform", t)

    t = time.perf_counter()
    calib_tokens = runs / f"calib-{a.calib_windows}x{a.seq}.npz"
    steps.windows(calib_tokens, a.seq, a.calib_windows, tokenizer=mxfp4)
    teacher = steps.streamed_teacher(mxfp4, calib_tokens, runs / f"teacher-{calib_tokens.stem}")
    calib = steps.calibration(
        runs / a.calib_student,
        mxfp4,
        teacher,
        calib_tokens,
        runs / f"calib-{a.calib_student}-{calib_tokens.stem}",
        a.seed,
        *("--scores", ",".join(dict.fromkeys([a.score, "frequency"]))),
    )
    stage("calibrate", t)

    t = time.perf_counter()
    for spec in filter(None, a.graded.split(",")):
        target, lo = spec.split(":")
        n = steps.promoted_per_layer(float(target), lo, E)
        name = f"graded-{target}-{lo}"
        out = steps.graded(
            mxfp4,
            runs / f"{name}-{a.score}",
            calib / f"scores-{a.score}.npz",
            n,
            lo,
            *("--routes", str(calib / "routes.npz"), "--global", "--ranks", "2"),
        )
        rows.append((out, name, a.score))
    stage("grade", t)

    report = Path(a.out)
    plain_out = runs / f"{report.stem}-plain.json"  # the parts stay under --runs
    cmd = steps.evaluate_cmd(mxfp4, a.windows, a.seq, rows, plain_out)
    print(
        f"+ [{time.strftime('%H:%M:%S')}] (in the background)",
        " ".join(cmd),
        file=sys.stderr,
        flush=True,
    )
    t_plain = time.perf_counter()
    plain = subprocess.Popen([PY, "-m", *cmd])
    plain_rows = len(rows)

    t = time.perf_counter()
    dwq_for = [w for w in a.dwq_for.split(",") if w]
    if dwq_for:
        dwq_tokens = runs / f"calib-{a.dwq_calib_windows}x{a.seq}.npz"
        dwq_teacher = runs / f"teacher-{dwq_tokens.stem}"
        steps.windows(dwq_tokens, a.seq, a.dwq_calib_windows, tokenizer=mxfp4)
        steps.streamed_teacher(mxfp4, dwq_tokens, dwq_teacher)
        for item in dwq_for:
            want, *opts = item.split(":")
            found = [r for r in rows if r[1] == want]
            if not found:
                raise SystemExit(f"--dwq-for {want}: no such row ({[r[1] for r in rows]})")
            path, name, score = found[0]
            state = "bf16" if "bf16" in opts else "float32"
            seed = next((int(o[1:]) for o in opts if o[:1] == "s" and o[1:].isdigit()), 0)
            if set(opts) - {"bf16", f"s{seed}"}:
                raise SystemExit(f"--dwq-for {item}: options are :bf16 and :s<seed>")
            tag = "".join(f"-{o}" for o in opts)
            out = runs / f"{path.name}-dwq-{a.dwq_steps}-{dwq_tokens.stem}{tag}"
            steps.dwq(
                dwq_teacher,
                path,
                dwq_tokens,
                out,
                a.dwq_steps,
                *("--lr", str(a.dwq_lr), "--valid-windows", str(a.dwq_valid_windows)),
                *("--state", state, "--seed", str(seed)),
                *(("--window-batch", str(a.dwq_batch)) if a.dwq_batch else ()),
            )
            rows.append((out, f"{name}-dwq{tag}", score))
    stage("dwq", t)

    t = time.perf_counter()
    parts = []
    if rows[plain_rows:]:
        dwq_out = runs / f"{report.stem}-dwq.json"
        run(*steps.evaluate_cmd(mxfp4, a.windows, a.seq, rows[plain_rows:], dwq_out))
        parts.append(json.loads(dwq_out.read_text()))
    stage("evaluate-dwq", t)
    if plain.wait() != 0:
        raise SystemExit(f"the background evaluation failed (exit {plain.returncode})")
    stage("evaluate-plain", t_plain)
    parts.insert(0, json.loads(plain_out.read_text()))
    rep = merge(parts)
    report.with_suffix(".md").write_text(evaluate.markdown(rep))
    evaluate.plot(rep, report.with_suffix(".png"))
    rep["pipeline"] = {
        "command": "python benchmarks/quality/quality_bits.py " + " ".join(sys.argv[1:]),
        "src": a.src,
        "stage_seconds": timings,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    report.write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
