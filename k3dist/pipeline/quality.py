"""The measured quality grid the planner chooses the lo bank by (issue 40).

``k3dist/data/quality-grid.json`` (written by ``benchmarks/quality/quality_grid.py``, its
provenance inside: command, commit, teacher, windows) holds, for the trained sparse
mini-K3, KL(teacher || graded build) at expert bits per weight x lo-bank format x the
student the sensitivity scores were computed on. Expert bpw is the coordinate that
carries over to the real K3: at a given bpw and lo format the promoted share is the same
on any model whose hi bank is MXFP4.

:meth:`QualityGrid.expected` interpolates a lo format's KL, p95 KL and top-1 flip at a
plan's expert bpw, linearly between the two measured rows around it, for each score
student, and keeps the student with the lowest KL (the one the pipeline must then
calibrate with). A point farther than :data:`EDGE_BPW` outside a format's measured
range has no expectation: the planner refuses it unless ``--lo`` names the format, and
then warns with :meth:`QualityGrid.nearest`.

Rows with ``dwq`` (the build distilled by the pipeline's ``--dwq``, off by default) never
choose: :meth:`QualityGrid.expected` interpolates the plain rows and reports beside them
the DWQ row measured at the same lo format, student and bytes (within :data:`EDGE_BPW`),
if the grid has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

GRID_PATH = Path(__file__).resolve().parent.parent / "data" / "quality-grid.json"
# Rows sit at the bpw their promotion counts give (a multiple of the ranks per layer), a
# few thousandths off the target; a plan this close past a format's last measured row
# takes that row's value (clamped), farther is outside the grid.
EDGE_BPW = 0.02


@dataclass(frozen=True)
class Row:
    id: str
    lo: str
    student: str | None  # None: the uniform lo build (nothing promoted, no scores)
    expert_bpw: float
    promoted_share: float
    kl: float
    kl_p95: float
    flip: float
    dwq: int = 0  # DWQ steps per block; 0: not distilled


@dataclass(frozen=True)
class Expected:
    lo: str
    expert_bpw: float
    student: str  # the score student the pipeline calibrates with
    kl: float
    kl_p95: float
    flip: float
    rows: tuple[str, ...]  # the measured rows it comes from (one: measured or clamped)
    # past the grid's last row of the format: that row's values, an upper bound on KL
    # (more promoted experts than it measured), not a measurement at these bytes
    beyond: bool = False
    dwq: Row | None = None  # the same point distilled (--dwq), where the grid measured it

    def cite(self) -> str:
        how = "measured" if len(self.rows) == 1 else "interpolated"
        with_dwq = (
            f"; with --dwq KL {self.dwq.kl:.4f} (p95 {self.dwq.kl_p95:.4f}), measured: "
            f"{self.dwq.id}"
            if self.dwq
            else ""
        )
        return (
            f"expected KL {self.kl:.4f} (p95 {self.kl_p95:.4f}, flip {self.flip:.3f}), "
            f"{how}: {' .. '.join(self.rows)}{with_dwq}"
        )

    def asdict(self) -> dict:
        return {
            "lo": self.lo,
            "expert_bpw": self.expert_bpw,
            "calib_student": self.student,
            "kl": round(self.kl, 6),
            "kl_p95": round(self.kl_p95, 6),
            "flip": round(self.flip, 5),
            "grid_rows": list(self.rows),
            "measured": len(self.rows) == 1 and not self.beyond,
            **({"extrapolated": "upper bound: beyond the grid's last row"} if self.beyond else {}),
            "dwq": None
            if self.dwq is None
            else {"kl": self.dwq.kl, "kl_p95": self.dwq.kl_p95, "row": self.dwq.id},
        }


class QualityGrid:
    """The grid file, read (module doc)."""

    def __init__(self, data: dict, path: str | Path = GRID_PATH):
        self.path = Path(path)
        self.provenance = data.get("provenance", {})
        self.rows = [
            Row(
                r["id"],
                r["lo"],
                r.get("student"),
                float(r["expert_bpw"]),
                float(r.get("promoted_share") or 0.0),
                float(r["kl"]),
                float(r["kl_p95"]),
                float(r["flip"]),
                int(r.get("dwq") or 0),
            )
            for r in data["rows"]
        ]
        if not self.rows:
            raise ValueError(f"{self.path}: no rows; run benchmarks/quality/quality_grid.py")

    @classmethod
    def load(cls, path: str | Path | None = None) -> QualityGrid:
        p = Path(path) if path is not None else GRID_PATH
        try:
            return cls(json.loads(p.read_text()), p)
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{p}: not a quality grid ({e}); write it with benchmarks/quality/quality_grid.py"
            ) from None

    @property
    def formats(self) -> list[str]:
        return sorted({r.lo for r in self.rows})

    def series(self, lo: str) -> dict[str, list[Row]]:
        """Per score student, the lo format's rows by expert bpw; the uniform row (no
        scores) starts every student's series."""
        rows = [r for r in self.rows if r.lo == lo and not r.dwq]
        uniform = [r for r in rows if r.student is None]
        out: dict[str, list[Row]] = {}
        for s in sorted({r.student for r in rows if r.student is not None}):
            out[s] = sorted(
                uniform + [r for r in rows if r.student == s], key=lambda r: r.expert_bpw
            )
        if not out and uniform:
            out[lo] = uniform
        return out

    def expected(self, lo: str, bpw: float) -> Expected | None:
        """The lowest-KL student's interpolated expectation at ``bpw``; None outside
        the grid (no row of ``lo`` within :data:`EDGE_BPW` of the range)."""
        best = None
        for student, rows in self.series(lo).items():
            e = _interpolate(lo, student, rows, bpw)
            if e is not None and (best is None or e.kl < best.kl):
                best = e
        if best is None:
            return None
        dwq = [
            r
            for r in self.rows
            if r.dwq
            and r.lo == lo
            and r.student in (None, best.student)
            and abs(r.expert_bpw - bpw) <= EDGE_BPW
        ]
        return replace(best, dwq=min(dwq, key=lambda r: abs(r.expert_bpw - bpw), default=None))

    def beyond(self, lo: str, bpw: float) -> Expected | None:
        """Past ``lo``'s measured range (more bpw than its last row): the best student's
        last row, marked ``beyond`` (KL at most that: the same lo bank with more of the
        experts in their MXFP4 bytes). None when ``bpw`` is not past it."""
        best = None
        for student, rows in self.series(lo).items():
            last = rows[-1]
            if bpw > last.expert_bpw + EDGE_BPW and (best is None or last.kl < best.kl):
                best = Expected(lo, bpw, student, last.kl, last.kl_p95, last.flip, (last.id,), True)
        return best

    def nearest(self, lo: str, bpw: float) -> Row:
        """The measured row closest in bpw, of ``lo`` if the grid has it."""
        plain = [r for r in self.rows if not r.dwq]
        rows = [r for r in plain if r.lo == lo] or plain
        return min(rows, key=lambda r: (abs(r.expert_bpw - bpw), r.kl))

    def summary(self) -> dict:
        p = self.provenance
        return {
            "file": "k3dist/data/quality-grid.json" if self.path == GRID_PATH else str(self.path),
            "command": p.get("command"),
            "commit": p.get("commit"),
            "windows_per_domain": p.get("windows_per_domain"),
            "rows": len(self.rows),
        }


def _interpolate(lo: str, student: str, rows: list[Row], bpw: float) -> Expected | None:
    if not rows or bpw < rows[0].expert_bpw - EDGE_BPW or bpw > rows[-1].expert_bpw + EDGE_BPW:
        return None

    def at(r: Row) -> Expected:
        return Expected(lo, bpw, student, r.kl, r.kl_p95, r.flip, (r.id,))

    if bpw <= rows[0].expert_bpw:
        return at(rows[0])
    if bpw >= rows[-1].expert_bpw:
        return at(rows[-1])
    for a, b in zip(rows, rows[1:], strict=False):
        if a.expert_bpw <= bpw <= b.expert_bpw:
            if b.expert_bpw == a.expert_bpw:
                return at(min(a, b, key=lambda r: r.kl))
            t = (bpw - a.expert_bpw) / (b.expert_bpw - a.expert_bpw)

            def lerp(x: float, y: float, t: float = t) -> float:
                return x + t * (y - x)

            return Expected(
                lo,
                bpw,
                student,
                lerp(a.kl, b.kl),
                lerp(a.kl_p95, b.kl_p95),
                lerp(a.flip, b.flip),
                (a.id, b.id),
            )
    return None
