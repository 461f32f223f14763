"""What a pipeline stage will cost before it starts: the bytes it will read and the
seconds it will take, from a model of its rate.

The model is the rehearsal preset's run (``benchmarks/results/rehearsal-pipeline-2026-12-04.json``:
the pipeline on ``k3dist-synth --preset k3counts``, 805.5 MB of source, 4 windows of 64
tokens, DWQ 4 steps, on a 2-core Linux box): each streaming stage read a multiple of the
source's bytes (``READS_PER_SOURCE_BYTE``, its ``rchar`` over the source) at a rate of its
own (``REFERENCE_RATE``, bytes read over wall seconds, start-up included; DWQ's at
``REFERENCE_DWQ_STEPS`` steps, its time scales with the steps). A stage is planned at
that rate, times how this machine compares: the run's finished stages' measured seconds
over their modelled seconds (``machine_factor``; 1 until one has finished).

The measured rate replaces the model once a stage has read past its start-up
(``k3dist.pipeline.progress``); the model is what there is before that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Bytes a stage reads per byte of the source (rchar / the source's bytes) on the
# reference run: teacher streams the source once (+ the token set), calibrate twice
# (student and teacher) with the teacher's states, graded re-quantizes lo and copies hi,
# DWQ reads the source for its student and the rank folders.
READS_PER_SOURCE_BYTE = {"teacher": 1.21, "calibrate": 4.37, "graded": 1.97, "dwq": 1.94}
# Bytes read per wall second on the reference run (read_mb / wall_s of each stage).
REFERENCE_RATE = {
    "teacher": 976.9e6 / 28.67,
    "calibrate": 3518.8e6 / 134.28,
    "graded": 1590.4e6 / 40.78,
    "dwq": 1565.0e6 / 202.19,
}
REFERENCE_DWQ_STEPS = 4
# Stages that stream nothing: their wall seconds on the reference run (tokens: the
# tokenizer loaded and the text tokenized; plan: written in the parent).
REFERENCE_SECONDS = {"plan": 0.0, "tokens": 5.32}


@dataclass(frozen=True)
class StageCost:
    """A stage's plan: bytes it will read (None: it streams nothing), seconds on the
    reference machine, and the bytes its start-up reads before it streams (opening the
    source: its index and every shard's header)."""

    bytes_total: int | None
    seconds: float
    startup_bytes: int = 0


def metadata_bytes(src: str | Path | None) -> int:
    """The source's index file and safetensors headers (8 bytes of length + the JSON):
    what opening it reads. 0 without a source. A few MB of the real K3's 1.56 TB, but a
    sixth of the rehearsal preset's (the real tensor count, the widths shrunk)."""
    if src is None:
        return 0
    n = 0
    for p in Path(src).iterdir():
        if p.name.endswith(".index.json"):
            n += p.stat().st_size
        elif p.suffix == ".safetensors":
            with open(p, "rb") as f:
                head = f.read(8)
            n += 8 + (int.from_bytes(head, "little") if len(head) == 8 else 0)
    return n


def plan(
    stages: list[str], source_bytes: int, dwq_steps: int, startup_bytes: int = 0
) -> dict[str, StageCost]:
    """Each stage's modelled bytes and reference seconds."""
    out = {}
    for s in stages:
        if s in READS_PER_SOURCE_BYTE:
            total = round(source_bytes * READS_PER_SOURCE_BYTE[s])
            secs = total / REFERENCE_RATE[s]
            if s == "dwq":
                secs *= max(1, dwq_steps) / REFERENCE_DWQ_STEPS
            out[s] = StageCost(total, round(secs, 2), startup_bytes)
        else:
            out[s] = StageCost(None, REFERENCE_SECONDS.get(s, 0.0))
    return out


def machine_factor(done: list[tuple[float, float]]) -> float:
    """This machine against the reference: (measured s, modelled s) of the stages done
    so far in this run; 1.0 before any."""
    measured = sum(m for m, s in done if s > 0)
    modelled = sum(s for _, s in done if s > 0)
    return measured / modelled if measured > 0 and modelled > 0 else 1.0
