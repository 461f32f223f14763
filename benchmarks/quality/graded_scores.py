"""The quality table of issue 12: graded and uniform low-bit builds of the trained
mini-K3 against its MXFP4 teacher (``python -m k3dist.bench.evaluate``).

Steps (each reused when its output exists) under ``runs/quality/``:

1. the MXFP4 build of ``k3dist/data/mini-k3`` (``k3dist.pipeline.convert``) and the uniform
   lo-bank builds (``k3dist.pipeline.promote --per-layer 0``);
2. the calibration token set (``k3dist.factory.windows``, the ``calib`` split), the
   streamed teacher on it (``k3dist.pipeline.teacher``) and the sensitivity scores on the
   uniform 2-bit build (``k3dist.pipeline.calibrate``: output-error, fisher, taylor,
   frequency, random);
3. graded builds promoting 5 / 10 / 20 % of each MoE layer's experts by every score,
   ``k_hi`` per layer from the calibration routes (observed maximum), and the
   ``--global`` variants (the same number of promotions chosen over all layers at once,
   in pairs: two ranks) for the sensitivity scores; ``mixed2`` (``profiles --profile
   mixed2``); and the overflow policy at ``k_hi`` 2 for ``--fallback-for``'s global
   20 % build: routes past ``k_hi`` dropped, or served by a 2-bit fallback copy;
4. block-aligned DWQ (``k3dist.pipeline.dwq``, issue 13) of the ``--dwq-for`` builds against
   the same streamed teacher on the calibration windows: rows ``<build>-dwq``;
5. ``evaluate`` of every build on the held-out windows.

The mini-K3's routed experts are 96 x 96, so only group size 32 divides their columns:
g64 / g128 formats cannot store them (``grade`` refuses).

    python benchmarks/quality/graded_scores.py --windows 12 \\
        --out benchmarks/results/DATE/quality.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _steps as steps  # noqa: E402
import numpy as np  # noqa: E402
from _steps import run  # noqa: E402

RUNS = Path("runs/quality")
UNIFORM = ("1bit-g32", "2bit-g32", "3bit-g32")
LEVELS = (5, 10, 20)
SCORES = ("output-error", "fisher", "taylor", "frequency", "random")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=12, help="held-out windows per domain")
    ap.add_argument("--calib-windows", type=int, default=8, help="calibration windows per domain")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="random promotion scores")
    ap.add_argument("--scores", default=",".join(SCORES))
    ap.add_argument(
        "--global-for",
        default="output-error,fisher,taylor",
        help="scores that also get global-budget rows",
    )
    ap.add_argument(
        "--fallback-for",
        default="taylor",
        help="the score whose global 20%% build gets the k_hi 2 drop/fallback rows",
    )
    ap.add_argument(
        "--dwq-for",
        default="",
        help="comma-separated row names (e.g. 2bit-g32,graded-10-global-taylor) "
        "that also get a DWQ row",
    )
    ap.add_argument("--dwq-steps", type=int, default=60)
    ap.add_argument(
        "--dwq-calib-windows",
        type=int,
        default=32,
        help="calibration windows per domain for DWQ (8 overfits: the -calib8 rows)",
    )
    ap.add_argument("--dwq-lr", type=float, default=1e-3)
    ap.add_argument("--dwq-input", default="student", choices=("student", "teacher"))
    ap.add_argument(
        "--dwq-other-input-for",
        default="",
        help="rows that also get DWQ from the other input (``-dwq-<input>-input``)",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    RUNS.mkdir(parents=True, exist_ok=True)
    mxfp4 = steps.mxfp4("k3dist/data/mini-k3", RUNS / "mxfp4")
    students: list[steps.Row] = []
    for fmt in UNIFORM:
        out = steps.uniform(mxfp4, fmt, RUNS / fmt, "data/mini-k3-routing.npz")
        students.append((out, fmt, "-"))
    mixed2 = RUNS / "mixed2"
    if not (mixed2 / "k3dist.json").exists():
        run(
            "k3dist.pipeline.profiles",
            *("--src", "k3dist/data/mini-k3", "--out", str(mixed2), "--profile", "mixed2"),
            *("--mxfp4", str(mxfp4)),
        )
    students.append((mixed2, "mixed2", "-"))
    calib_tokens = steps.windows(
        RUNS / f"calib-{a.calib_windows}x{a.seq}.npz", a.seq, a.calib_windows
    )
    teacher = steps.streamed_teacher(mxfp4, calib_tokens, RUNS / f"teacher-{calib_tokens.stem}")
    calib = steps.calibration(
        RUNS / "2bit-g32",
        mxfp4,
        teacher,
        calib_tokens,
        RUNS / f"calib-2bit-g32-{calib_tokens.stem}",
        a.seed,
    )
    E = len(next(iter(np.load(calib / "scores-frequency.npz").values())))
    scores = a.scores.split(",")
    glob = [s for s in a.global_for.split(",") if s]
    routes = ("--routes", str(calib / "routes.npz"))
    for pct in LEVELS:
        n = round(pct * E / 100)
        for score in scores:
            for mode in ("per-layer", *(("global",) if score in glob else ())):
                name = f"graded-{pct}" + ("-global" if mode == "global" else "")
                sc = calib / f"scores-{score}.npz"
                opts = (*routes, *(("--global",) if mode == "global" else ()))
                out = steps.graded(mxfp4, RUNS / f"{name}-{score}", sc, n, "2bit-g32", *opts)
                students.append((out, name, score))
    if a.fallback_for:
        n = round(20 * E / 100)
        sc = calib / f"scores-{a.fallback_for}.npz"
        for fb in (False, True):
            name = "graded-20-global-khi2" + ("-fallback" if fb else "")
            opts = ("--k-hi", "2", "--global", *(("--lo-fallback",) if fb else ()))
            out = steps.graded(mxfp4, RUNS / f"{name}-{a.fallback_for}", sc, n, "2bit-g32", *opts)
            students.append((out, name, a.fallback_for))
    other = {"student": "teacher", "teacher": "student"}[a.dwq_input]
    dwq_tokens = RUNS / f"calib-{a.dwq_calib_windows}x{a.seq}.npz"
    dwq_teacher = RUNS / f"teacher-{dwq_tokens.stem}"
    if a.dwq_for:
        steps.windows(dwq_tokens, a.seq, a.dwq_calib_windows)
        steps.streamed_teacher(mxfp4, dwq_tokens, dwq_teacher)
    jobs = [(w, a.dwq_input, "-dwq") for w in filter(None, a.dwq_for.split(","))]
    jobs += [
        (w, other, f"-dwq-{other}-input") for w in filter(None, a.dwq_other_input_for.split(","))
    ]
    for want, mode, suffix in jobs:
        found = [(p, n, sc) for p, n, sc in students if p.name == want]
        if not found:
            raise SystemExit(
                f"--dwq-for {want}: no such row (builds: {[p.name for p, _, _ in students]})"
            )
        path, name, score = found[0]
        out = RUNS / f"{want}-dwq-{mode}-{a.dwq_steps}-{dwq_tokens.stem}"
        opts = ("--lr", str(a.dwq_lr), "--input", mode, "--valid-windows", "4")
        steps.dwq(dwq_teacher, path, dwq_tokens, out, a.dwq_steps, *opts)
        students.append((out, f"{name}{suffix}", score))
    out = Path(a.out)
    figures = ("--markdown", str(out.with_suffix(".md")), "--plot", str(out.with_suffix(".png")))
    run(*steps.evaluate_cmd(mxfp4, a.windows, a.seq, students, out, *figures))


if __name__ == "__main__":
    main()
