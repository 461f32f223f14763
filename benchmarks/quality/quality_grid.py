"""The quality grid the planner chooses the lo bank by (issue 40): graded builds of the
trained sparse mini-K3 (``data/mini-k3-sparse``, experts 128 wide) at a grid of expert
bits per weight x lo-bank format x the student the sensitivity scores come from, each
against the MXFP4 teacher on the same held-out windows (``k3dist.bench.evaluate``: mean
KL, p95 KL, top-1 flip).

A row is ``(target bpw, lo, student)``:

- at the lo format's own bpw the uniform lo build (nothing promoted; no student);
- above it, a graded build promoting ``(target - lo) / (4.25 - lo)`` of the experts
  (``_steps.promoted_per_layer``), chosen over all layers at once by the taylor
  score of ``k3dist.pipeline.calibrate`` run on the uniform ``student`` build (``lo``: the lo
  bank itself, what the pipeline did before issue 40; or a richer one, e.g. ``2bit-g64``),
  per layer a multiple of 2 (two ranks), ``k_hi`` per layer from the student's
  calibration routes: the steps ``benchmarks/quality/quality_bits.py`` takes.

A row ``TARGET:LO:STUDENT:dwq`` is that build distilled by the pipeline's DWQ
(``k3dist.pipeline.dwq`` with its defaults: ``--dwq-steps`` per block, batch 2, on
``--dwq-calib-windows`` calibration windows per domain, the pipeline's 16): id
``<row>+dwq``, ``dwq`` the steps. The planner never chooses by a DWQ row (DWQ is the
pipeline's ``--dwq``, off by default); it reports it beside the plain row.

Rows run in the order given (``--rows``, or the product of ``--bpw``, ``--lo`` and
``--students`` in that order) and the report is rewritten after each, so a grid cut
short holds only rows that were measured. ``--package`` also writes the compact copy the
planner reads (``k3dist/data/quality-grid.json``, ``k3dist.pipeline.quality``) with the
provenance: command, commit, teacher, windows.

    nice -n 10 python benchmarks/quality/quality_grid.py --runs runs/quality-grid --windows 4 \\
        --bpw 2.1,2.25,2.37,2.5,2.6 --lo 1bit-g64,2bit-g128,2bit-g64 \\
        --students lo,2bit-g64 --out benchmarks/results/2026-12-05/quality-grid.json \\
        --package k3dist/data/quality-grid.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k3dist.bench import evaluate  # noqa: E402
from k3dist.format import layout  # noqa: E402
from k3dist.format.folder import load_config  # noqa: E402

import _steps as steps  # noqa: E402
from _steps import MXFP4_BPW, lo_bpw, promoted_per_layer  # noqa: E402

SCORE = "taylor"


Spec = tuple  # (target, lo, student or "-", dwq: bool)


def row_specs(a: argparse.Namespace) -> list[Spec]:
    """``(target, lo, student, dwq)`` in run order, de-duplicated: a uniform row once per
    lo, the lo-bank student once when the richer student is the lo format itself."""
    if a.rows:
        specs = []
        for item in a.rows.split(","):
            t, lo, s, *opt = item.split(":")
            if opt not in ([], ["dwq"]):
                raise SystemExit(f"--rows {item}: TARGET:LO:STUDENT or TARGET:LO:STUDENT:dwq")
            specs.append((float(t), lo, lo if s == "lo" else s, bool(opt)))
    else:
        specs = [
            (float(t), lo, lo if s == "lo" else s, False)
            for t in a.bpw.split(",")
            for lo in a.lo.split(",")
            for s in a.students.split(",")
        ]
    out, seen = [], set()
    for t, lo, s, dwq in specs:
        if t < lo_bpw(lo) - 1e-9 or t > MXFP4_BPW:
            continue  # bytes the lo format cannot be graded to
        key = (t, lo, "-", dwq) if abs(t - lo_bpw(lo)) < 1e-9 else (t, lo, s, dwq)
        if key not in seen:
            seen.add(key)
            out.append(key)
    return out


def row_id(target: float, lo: str, student: str, dwq: bool) -> str:
    rid = f"{lo}@{target}" + ("" if student == "-" else f"/scores:{student}")
    return rid + ("+dwq" if dwq else "")


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "k3dist", "benchmarks"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_copy(rep: dict) -> dict:
    """What the planner reads: provenance and per row the coordinates and the measures."""
    keep = ("id", "lo", "student", "target_bpw", "expert_bpw", "promoted_share")
    keep += ("kl", "kl_p95", "flip", "k_hi_drop_rate", "dwq")
    return {
        "what": "KL(teacher || graded build) of the trained sparse mini-K3 at expert bpw x "
        "lo format x score student (benchmarks/quality/quality_grid.py; "
        "k3dist.pipeline.quality reads it)",
        "provenance": rep["provenance"],
        "rows": [{k: r.get(k) for k in keep} for r in rep["rows"]],
    }


class Builds:
    """The grid's builds under ``runs`` (each reused when its output exists): the MXFP4
    teacher, uniform lo builds, per student the calibration, graded builds, DWQ'd ones."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.runs = a, a.runs
        self.mxfp4 = steps.mxfp4(a.src, self.runs / "mxfp4")
        self.experts = layout.text_config(load_config(self.mxfp4))["num_experts"]
        self.zeros = steps.zero_scores(self.mxfp4, self.runs / "zeros.npz")

    def tokens(self, windows: int) -> tuple[Path, Path]:
        """The calibration token set of ``windows`` per domain and its streamed teacher."""
        toks = self.runs / f"calib-{windows}x{self.a.seq}.npz"
        steps.windows(toks, self.a.seq, windows, tokenizer=self.mxfp4)
        return toks, steps.streamed_teacher(self.mxfp4, toks, self.runs / f"teacher-{toks.stem}")

    def uniform(self, fmt: str) -> Path:
        return steps.uniform(self.mxfp4, fmt, self.runs / fmt, self.zeros)

    def calibration(self, student: str) -> Path:
        toks, teacher = self.tokens(self.a.calib_windows)
        out = self.runs / f"calib-{student}-{toks.stem}"
        opts = ("--scores", SCORE)
        return steps.calibration(
            self.uniform(student), self.mxfp4, teacher, toks, out, self.a.seed, *opts
        )

    def graded(self, target: float, lo: str, student: str) -> Path:
        calib = self.calibration(student)
        n = promoted_per_layer(target, lo, self.experts)
        path = self.runs / f"graded-{target}-{lo}-s-{student}"
        opts = ("--routes", str(calib / "routes.npz"), "--global", "--ranks", "2")
        return steps.graded(self.mxfp4, path, calib / f"scores-{SCORE}.npz", n, lo, *opts)

    def dwq(self, base: Path) -> Path:
        """``base`` distilled as the pipeline's ``--dwq`` does (its steps and batch)."""
        toks, teacher = self.tokens(self.a.dwq_calib_windows)
        out = self.runs / f"{base.name}-dwq-{self.a.dwq_steps}-{toks.stem}"
        return steps.dwq(teacher, base, toks, out, self.a.dwq_steps)

    def build(self, target: float, lo: str, student: str, dwq: bool) -> Path:
        path = self.uniform(lo) if student == "-" else self.graded(target, lo, student)
        return self.dwq(path) if dwq else path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default="data/mini-k3-sparse", help="Moonshot-format mini-K3")
    ap.add_argument("--runs", type=Path, default=Path("runs/quality-grid"))
    ap.add_argument("--windows", type=int, default=4, help="held-out windows per domain")
    ap.add_argument("--calib-windows", type=int, default=4, help="calibration windows/domain")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bpw", default="2.1,2.25,2.37,2.5,2.6,2.8,3.0")
    ap.add_argument("--lo", default="1bit-g64,2bit-g128,2bit-g64,3bit-g64")
    ap.add_argument("--students", default="lo,2bit-g64", help="'lo': the lo bank itself")
    ap.add_argument("--rows", default="", help="TARGET:LO:STUDENT[:dwq],... not the product")
    ap.add_argument("--dwq-steps", type=int, default=60, help="DWQ steps per block (pipeline's)")
    ap.add_argument("--dwq-calib-windows", type=int, default=16, help="DWQ windows/domain")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--package", type=Path, default=None, help="also the planner's copy")
    a = ap.parse_args()
    runs = a.runs
    runs.mkdir(parents=True, exist_ok=True)
    specs = row_specs(a)
    t0 = time.perf_counter()

    rep: dict = {
        "rows": [],
        "provenance": {
            "command": "python benchmarks/quality/quality_grid.py " + " ".join(sys.argv[1:]),
            "commit": git_commit(),
            "src": a.src,
            "score": SCORE,
            "calib_windows_per_domain": a.calib_windows,
            "eval_split": evaluate.SPLIT,
            "windows_per_domain": a.windows,
            "seq": a.seq,
            "grid": [list(s[:3]) + (["dwq"] if s[3] else []) for s in specs],
        },
    }
    if a.out.exists():  # resume: rows already measured with the same windows
        old = json.loads(a.out.read_text())
        if old["provenance"]["windows_per_domain"] == a.windows:
            rep["rows"] = old["rows"]
            # every command that wrote rows, each with its commit
            prev = old["provenance"].get("runs") or [
                {k: old["provenance"][k] for k in ("command", "commit")}
            ]
            rep["provenance"]["runs"] = prev + [
                {k: rep["provenance"][k] for k in ("command", "commit")}
            ]
            rep["provenance"]["grid"] = old["provenance"]["grid"] + [
                s for s in rep["provenance"]["grid"] if s not in old["provenance"]["grid"]
            ]
    done = {r["id"] for r in rep["rows"]}
    b = Builds(a)
    for target, lo, student, dwq in specs:
        rid = row_id(target, lo, student, dwq)
        if rid in done:
            continue
        t = time.perf_counter()
        path = b.build(target, lo, student, dwq)
        score = None if student == "-" else SCORE
        t_build = time.perf_counter() - t
        ev = evaluate.evaluate(
            b.mxfp4,
            [path],
            a.windows,
            a.seq,
            [score],
            [rid],
            work=runs / f"eval-teacher-{a.windows}x{a.seq}",
            progress=False,
        )
        row = ev["rows"][0]
        row.update(
            id=rid,
            lo=lo,
            student=None if student == "-" else student,
            target_bpw=target,
            promoted_share=row.get("promoted_share", 0.0),
            seconds={"build": round(t_build, 1), "evaluate": ev["seconds"]},
            loadavg=os.getloadavg()[0],
        )
        if dwq:
            row.update(dwq=a.dwq_steps, dwq_calib_windows_per_domain=a.dwq_calib_windows)
        rep["teacher"] = ev["teacher"]
        rep["tokens_per_domain"] = ev["tokens_per_domain"]
        rep["rows"].append(row)
        rep["seconds"] = round(time.perf_counter() - t0, 1)
        a.out.write_text(json.dumps(rep, indent=1) + "\n")
        if a.package:
            a.package.write_text(json.dumps(package_copy(rep), indent=1) + "\n")
        print(
            f"[{time.strftime('%H:%M:%S')}] {rid}: KL {row['kl']:.5f} p95 {row['kl_p95']:.5f} "
            f"flip {row['flip']:.4f} bpw {row['expert_bpw']} "
            f"(build {t_build:.0f} s, evaluate {ev['seconds']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()
