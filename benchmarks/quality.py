"""The quality table of issue 12: graded and uniform low-bit builds of the trained
mini-K3 against its MXFP4 teacher (``python -m k3dist.bench.evaluate``).

Builds (reused when present) under ``runs/quality/``: the MXFP4 build of ``data/mini-k3``
(``k3dist.build.convert``), uniform lo-bank formats (``k3dist.build.grade --per-layer 0``)
and graded builds promoting 5 / 10 / 20 % of each MoE layer's experts (and 40 % over a
1-bit lo bank: the equal-bytes partner of uniform 2-bit) by ``frequency`` (the shipped
calibration routing counts ``data/mini-k3-routing.npz``) or ``random`` (seeded scores).
The mini-K3's routed experts are 96 x 96, so only group size 32 divides their columns:
g64 / g128 formats cannot store them (``grade`` refuses).

    python benchmarks/quality.py --windows 8 --out benchmarks/results/quality-DATE.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

PY = sys.executable
RUNS = Path("runs/quality")
COUNTS = Path("data/mini-k3-routing.npz")
UNIFORM = ("1bit-g32", "2bit-g32", "3bit-g32")
# (percent promoted, lo format, k_hi; None: --k-hi). 40 % over 1-bit is at the bytes of
# uniform 2-bit g32; with k_hi 4 (= top-k) nothing can drop, so it isolates the drops.
GRADED = (
    (5, "2bit-g32", None),
    (10, "2bit-g32", None),
    (20, "2bit-g32", None),
    (40, "1bit-g32", None),
    (40, "1bit-g32", 4),
)
SCORES = ("frequency", "random")


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run([PY, "-m", *cmd], check=True)


def random_scores(counts: Path, out: Path, seed: int) -> Path:
    """Seeded random scores, one per expert of every layer of ``counts``."""
    rng = np.random.default_rng(seed)
    layers = np.load(counts)
    np.savez(out, **{k: rng.permutation(len(v)).astype(np.int64) for k, v in layers.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per domain")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--k-hi", type=int, default=2, help="hi routes per token (top-4 model)")
    ap.add_argument("--seed", type=int, default=0, help="random promotion scores")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    RUNS.mkdir(parents=True, exist_ok=True)
    mxfp4 = RUNS / "mxfp4"
    if not (mxfp4 / "k3dist.json").exists():
        run("k3dist.build.convert", "--src", "data/mini-k3", "--out", str(mxfp4))
    scores = {
        "frequency": COUNTS,
        "random": random_scores(COUNTS, RUNS / f"random-{a.seed}.npz", a.seed),
    }
    E = len(next(iter(np.load(COUNTS).values())))
    students: list[tuple[Path, str, str]] = []  # (build, name, score)
    grade = ("k3dist.build.grade", "--build", str(mxfp4))
    for fmt in UNIFORM:
        out = RUNS / fmt
        run(
            *grade,
            "--k-hi",
            str(a.k_hi),
            "--out",
            str(out),
            "--scores",
            str(COUNTS),
            "--per-layer",
            "0",
            "--lo",
            fmt,
        )
        students.append((out, fmt, "-"))
    for pct, lo, k_hi in GRADED:
        for score in SCORES:
            name = f"graded-{pct}" + ("" if lo == "2bit-g32" else f"-{lo}")
            name += "" if k_hi is None else f"-khi{k_hi}"
            out = RUNS / f"{name}-{score}"
            n = round(pct * E / 100)
            run(
                *grade,
                "--k-hi",
                str(k_hi or a.k_hi),
                "--out",
                str(out),
                "--scores",
                str(scores[score]),
                "--per-layer",
                str(n),
                "--lo",
                lo,
            )
            students.append((out, name, score))
    out = Path(a.out)
    ev = [
        "k3dist.bench.evaluate",
        "--teacher",
        str(mxfp4),
        "--windows",
        str(a.windows),
        "--seq",
        str(a.seq),
        "--out",
        str(out),
        "--markdown",
        str(out.with_suffix(".md")),
        "--plot",
        str(out.with_suffix(".png")),
    ]
    for path, name, score in students:
        ev += ["--student", str(path), "--name", name, "--score", score]
    run(*ev)


if __name__ == "__main__":
    main()
