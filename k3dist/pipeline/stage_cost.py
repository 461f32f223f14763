"""What a pipeline stage will cost before it starts: the bytes it will read and the CPU
seconds of work it will do, from the rehearsal preset's runs.

The model: the pipeline on ``k3dist-synth --preset k3counts`` (805.5 MB of source, 4
windows of 64 tokens, DWQ 4 steps, 2-core Linux). Each streaming stage read a multiple
of the source's bytes (``READS_PER_SOURCE_BYTE``, its ``rchar`` over the source:
``benchmarks/results/2026-12-04/rehearsal-pipeline.json``) and did a number of CPU
seconds of work (``REFERENCE_CPU_S``, its process's user + system seconds:
``benchmarks/results/2026-12-06/pipeline-eta-bytes.json``, ``summary_stages``), scaled
here by the source's bytes (and DWQ's by its steps). CPU seconds measure work whatever
else runs on the machine; what the load changes is how many of them a wall second gives a
stage, which ``k3dist.pipeline.progress`` measures as the stage runs. ``cpu_factor``:
this machine's CPU seconds for the same work against the model's, from the stages done
so far (1 before any).
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes a stage reads per byte of the source (rchar / the source's bytes) on the
# reference run: teacher streams the source once (+ the token set), calibrate twice
# (student and teacher) with the teacher's states, graded re-quantizes lo and copies hi,
# DWQ reads the source for its student and the rank folders.
READS_PER_SOURCE_BYTE = {"teacher": 1.21, "calibrate": 4.37, "graded": 1.97, "dwq": 1.94}
# CPU seconds of each stage on the reference source (805,513,478 bytes on disk), this
# code (2026-12-06), DWQ at REFERENCE_DWQ_STEPS steps
REFERENCE_SOURCE_BYTES = 805_513_478
REFERENCE_CPU_S = {
    "tokens": 5.44,
    "teacher": 27.72,
    "calibrate": 123.48,
    "graded": 28.76,
    "dwq": 153.21,
}
REFERENCE_DWQ_STEPS = 4


@dataclass(frozen=True)
class StageCost:
    """A stage's plan: bytes it will read (None: it streams nothing) and CPU seconds."""

    bytes_total: int | None
    cpu_s: float


def plan(stages: list[str], source_bytes: int, dwq_steps: int) -> dict[str, StageCost]:
    """Each stage's modelled bytes and CPU seconds (``plan``: none, it is written here)."""
    out = {}
    scale = source_bytes / REFERENCE_SOURCE_BYTES
    for s in stages:
        total = (
            round(source_bytes * READS_PER_SOURCE_BYTE[s]) if s in READS_PER_SOURCE_BYTE else None
        )
        cpu = REFERENCE_CPU_S.get(s, 0.0) * (scale if s != "tokens" else 1.0)
        if s == "dwq":
            cpu *= max(1, dwq_steps) / REFERENCE_DWQ_STEPS
        out[s] = StageCost(total, round(cpu, 2))
    return out


def cpu_factor(done: list[tuple[float, float]]) -> float:
    """This machine's CPU seconds against the model's: (measured, modelled) of the
    stages done so far in this run; 1.0 before any."""
    measured = sum(m for m, s in done if s > 0)
    modelled = sum(s for _, s in done if s > 0)
    return measured / modelled if measured > 0 and modelled > 0 else 1.0
