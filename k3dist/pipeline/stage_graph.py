"""The pipeline's stage graph: its arguments (``Args``), the stages in order, what each
reads and writes, when scratch may go, and the keys that say a stage's output is current."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

STATE = "pipeline.json"
SUMMARY = "summary.json"
# what summary.json keeps of each stage's record, run or skipped
STAGE_FACTS = (
    "seconds",
    "cpu_s",
    "peak_rss",
    "read_bytes",
    "written_bytes",
    "rchar",
    "wchar",
    "output_bytes",
)
RANK_PATTERN = "rank{rank}"
DWQ_FACTS = ("layers", "valid_before", "valid_after", "steps")  # per block, in pipeline.json
GOAL_FACTOR = 1.1  # peak disk <= source + 1.1 x rank folders


@dataclass
class Args:
    src: str | None
    out: str
    ranks: int = 2
    budget: float | None = None
    budget_total: float | None = None
    target_bpw: float | None = None
    lo: str = "auto"  # the lo-bank format; auto: the quality grid's best at the plan's bytes
    calib: str | None = None
    calib_text: list[str] | None = None
    windows: int = 16
    seq: int = 256
    batch: int = 4
    cap: str = "2GiB"
    top_k: int = 0
    dwq: bool = False
    dwq_steps: int = 60
    dwq_batch: int = 2
    keep: bool = False
    config: str | None = None
    index: str | None = None
    boxes: str | None = None  # boxes of different memory (plan --boxes); ranks follows
    expert_split: str = "memory"  # with boxes (k3dist.pipeline.expert_split)

    @property
    def work(self) -> Path:
        return Path(self.out) / "work"

    def path(self, stage: str) -> Path:
        return {
            "plan": Path(self.out) / "plan.json",
            "tokens": self.work / "tokens.npz",
            "teacher": self.work / "teacher",
            "calibrate": self.work / "calib",
            "graded": self.work / "graded",
            "dwq": self.work / "dwq",
        }[stage]

    def rank_dirs(self) -> list[Path]:
        return [Path(self.out) / RANK_PATTERN.format(rank=r) for r in range(self.ranks)]


def stages(a: Args) -> list[str]:
    s = ["plan", "tokens", "teacher", "calibrate", "graded"]
    return [*s, "dwq"] if a.dwq else s


def writes_ranks(stage: str) -> bool:
    """The stages whose output is the rank folders: ``graded`` (written straight into
    them, ``k3dist.pipeline.direct``) and ``dwq`` (rewrites them in place)."""
    return stage in ("graded", "dwq")


def ranks_by(ks: dict[str, str], upto: str) -> list[list[str]]:
    """What state["ranks_by"] holds once ``upto`` has written the rank folders: the
    stages that wrote them, in order, with their keys."""
    return [[s, ks[s]] for s in ("graded", "dwq")[: 1 + (upto == "dwq")]]


# scratch -> the stage after which nothing reads it any more
def consumers_end(a: Args) -> dict[str, str]:
    out = {"teacher": "dwq" if a.dwq else "calibrate"}
    return out | {"dwq": "dwq"} if a.dwq else out


def stage_params(a: Args, stage: str) -> dict:
    """What shapes a stage's output (besides the stages before it)."""
    return {
        "plan": {
            "src": a.src,
            "ranks": a.ranks,
            "budget": a.budget,
            "budget_total": a.budget_total,
            "target_bpw": a.target_bpw,
            **({"lo": a.lo} if a.lo != "auto" else {}),
            **({"boxes": a.boxes, "expert_split": a.expert_split} if a.boxes else {}),
        },
        "tokens": {
            "calib": _file_id(a.calib) if a.calib else None,
            "calib_text": [_file_id(p) for p in a.calib_text or []],
            "windows": a.windows,
            "seq": a.seq,
        },
        "teacher": {"batch": a.batch, "top_k": a.top_k},
        "calibrate": {"batch": a.batch},
        "graded": {"ranks": a.ranks},  # the rank folders
        "dwq": {"steps": a.dwq_steps, "batch": a.dwq_batch},
    }[stage]


def _file_id(p: str) -> str:
    """A path with its size and mtime: a changed input file changes the key."""
    q = Path(p)
    if q.is_file():
        st = q.stat()
        return f"{q.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    return str(q.resolve())


def keys(a: Args) -> dict[str, str]:
    out, prev = {}, ""
    for s in stages(a):
        blob = json.dumps([prev, s, stage_params(a, s)], sort_keys=True)
        prev = out[s] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return out


# stage -> the earlier outputs it reads
READS = {
    "plan": [],
    "tokens": [],
    "teacher": ["tokens"],
    "calibrate": ["teacher", "tokens"],
    "graded": ["calibrate"],
    "dwq": ["teacher", "graded", "tokens"],
}
