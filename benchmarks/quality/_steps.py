"""The pipeline steps the quality benchmarks run, each written once: ``graded_scores.py``,
``quality_bits.py`` and ``quality_grid.py`` build their rows with these (each tool run
as ``python -m``; a step whose output folder or file exists is reused), and the
arithmetic of a graded row's promoted share."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from k3dist.format import layout
from k3dist.format.folder import load_config

import numpy as np

PY = sys.executable
MXFP4_BPW = 4.25
Row = tuple[Path, str, str]  # (build, name, score)


def run(*cmd: str) -> None:
    print(f"+ [{time.strftime('%H:%M:%S')}]", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run([PY, "-m", *cmd], check=True)


def lo_bpw(fmt: str) -> float:
    """Bits per weight of an affine ``<b>bit-g<g>`` format (bf16 scale and bias)."""
    bits, group = fmt.split("bit-g")
    return int(bits) + 32 / int(group)


def promoted_per_layer(target: float, lo: str, experts: int) -> int:
    """Experts per layer to promote for ``target`` expert bpw over the ``lo`` format."""
    share = (target - lo_bpw(lo)) / (MXFP4_BPW - lo_bpw(lo))
    if not 0 <= share <= 1:
        raise SystemExit(f"--graded {target}:{lo}: target outside [{lo_bpw(lo)}, {MXFP4_BPW}]")
    return round(share * experts)


def built(out: Path, *cmd: str) -> Path:
    """``out``, made by ``cmd`` unless it holds a finished build (its ``k3dist.json``)."""
    if not (out / "k3dist.json").exists():
        run(*cmd)
    return out


def mxfp4(src: str, out: Path) -> Path:
    """The MXFP4 build of the Moonshot-format ``src``: the teacher."""
    return built(out, "k3dist.pipeline.convert", "--src", src, "--out", str(out))


def zero_scores(build: Path, out: Path) -> Path:
    """Scores of 0 for every expert of ``build``: a uniform build promotes nothing, so
    any scores will do."""
    if not out.exists():
        tc = layout.text_config(load_config(build))
        zeros = np.zeros(tc["num_experts"], np.float32)
        np.savez(out, **{f"layer_{i}": zeros for i in layout.moe_layers(tc)})
    return out


def uniform(teacher: Path, fmt: str, out: Path, scores: str | Path) -> Path:
    """The uniform ``fmt`` build of the MXFP4 ``teacher`` (nothing promoted)."""
    return built(
        out,
        *("k3dist.pipeline.promote", "--build", str(teacher), "--k-hi", "1"),
        *("--out", str(out), "--scores", str(scores), "--per-layer", "0", "--lo", fmt),
    )


def graded(
    teacher: Path, out: Path, scores: str | Path, per_layer: int, lo: str, *opts: str
) -> Path:
    """A graded build of the MXFP4 ``teacher``: ``per_layer`` experts of each MoE layer
    promoted by ``scores`` over the ``lo`` bank; ``opts``: promote's other flags."""
    return built(
        out,
        *("k3dist.pipeline.promote", "--build", str(teacher), "--out", str(out)),
        *("--scores", str(scores), "--per-layer", str(per_layer), "--lo", lo, *opts),
    )


def windows(out: Path, seq: int, n: int, tokenizer: Path | None = None) -> Path:
    """``n`` calibration windows of ``seq`` tokens per domain (``tokenizer``: a build's;
    None: the mini's own)."""
    if not out.exists():
        run(
            "k3dist.factory.windows",
            *("--split", "calib", "--seq", str(seq), "--windows", str(n), "--out", str(out)),
            *(("--tokenizer", str(tokenizer)) if tokenizer is not None else ()),
        )
    return out


def streamed_teacher(build: Path, tokens: Path, out: Path) -> Path:
    """The MXFP4 ``build``'s outputs on ``tokens``, streamed (``k3dist.pipeline.teacher``)."""
    cmd = ("--build", str(build), "--tokens", str(tokens), "--out", str(out))
    return built(out, "k3dist.pipeline.teacher", *cmd)


def calibration(
    student: Path, build: Path, teacher: Path, tokens: Path, out: Path, seed: int, *opts: str
) -> Path:
    """Sensitivity scores and routes on the uniform ``student`` against the streamed
    ``teacher`` of the MXFP4 ``build``; ``opts``: calibrate's other flags."""
    if not (out / "calibrate.json").exists():
        run(
            "k3dist.pipeline.calibrate",
            *("--student", str(student), "--teacher-build", str(build)),
            *("--teacher", str(teacher), "--tokens", str(tokens), "--out", str(out)),
            *("--seed", str(seed), *opts),
        )
    return out


def dwq(teacher: Path, student: Path, tokens: Path, out: Path, steps: int, *opts: str) -> Path:
    """``student`` distilled block by block against the streamed ``teacher``
    (``k3dist.pipeline.dwq``); ``opts``: its other flags."""
    return built(
        out,
        *("k3dist.pipeline.dwq", "--teacher", str(teacher), "--student", str(student)),
        *("--tokens", str(tokens), "--out", str(out), "--steps", str(steps), *opts),
    )


def evaluate_cmd(
    teacher: Path, windows: int, seq: int, rows: list[Row], out: Path, *opts: str
) -> list[str]:
    """``k3dist.bench.evaluate`` of ``rows`` against the MXFP4 ``teacher`` on ``windows``
    held-out windows per domain; ``opts``: its other flags."""
    cmd = ["k3dist.bench.evaluate", "--teacher", str(teacher), "--windows", str(windows)]
    cmd += ["--seq", str(seq), "--out", str(out), *opts]
    for path, name, score in rows:
        cmd += ["--student", str(path), "--name", name, "--score", score]
    return cmd
