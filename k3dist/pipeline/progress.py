"""The pipeline's progress: per stage, bytes done of bytes to do and an ETA from the
measured rate; a whole-run ETA; the same in ``OUT/progress.json`` for a script to watch.

A stage runs in its own process; its progress is measured from outside, as the bytes
that process has read (``rchar`` of ``/proc/PID/io``: every stage that takes long is
bound by streaming the source). What a stage will read is planned as a multiple of the
source's bytes (``READS_PER_SOURCE_BYTE``). A stage's ETA is (planned - read) / the
rate it has read at so far; a stage not started yet is estimated at the rate the run
has read at so far. Where ``/proc`` is missing (macOS) the bytes are unknown and only
elapsed times are shown. On a terminal one line per stage is rewritten in place once a
second and left at its final state; otherwise nothing is printed (progress.json is
still written).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from k3dist.format.journal import write_json_atomic

PROGRESS = "progress.json"
# Bytes a stage reads per byte of the source (its rchar / the source's bytes), measured
# on the rehearsal preset (benchmarks/results/2026-12-04/rehearsal-pipeline.json:
# read_mb / 805.5 MB of source): teacher streams the source once (+ the token set),
# calibrate twice (student and teacher) with the teacher's states, graded re-quantizes
# lo and copies hi, DWQ reads the source for its student and the rank folders.
READS_PER_SOURCE_BYTE = {"teacher": 1.21, "calibrate": 4.37, "graded": 1.97, "dwq": 1.94}


def rchar(pid: int) -> int | None:
    """Bytes process ``pid`` has read through read() (Linux); None without /proc."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _hms(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    return (
        f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def _gb(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class Progress:
    """The run's stages and where each stands; ``watch`` follows one stage's process."""

    def __init__(
        self,
        out: Path,
        order: list[str],
        totals: dict[str, int | None],
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        every_s: float = 1.0,
    ):
        self.path = Path(out) / PROGRESS
        self.order, self.every_s = order, every_s
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.stages = {
            s: {"stage": s, "state": "pending", "bytes_done": 0, "bytes_total": totals.get(s)}
            for s in order
        }
        for rec in self.stages.values():
            rec.update(seconds=0.0, rate_bytes_per_s=None, eta_s=None)
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self._write()

    # -- the run's rate: bytes per second over the stages that read, measured so far
    def _rate(self) -> float | None:
        b = sum(r["bytes_done"] for r in self.stages.values() if r["bytes_total"])
        t = sum(r["seconds"] for r in self.stages.values() if r["bytes_total"])
        return b / t if b and t > 0 else None

    def _eta(self, rec: dict) -> float | None:
        total, done = rec["bytes_total"], rec["bytes_done"]
        if rec["state"] in ("done", "skipped"):
            return 0.0
        if not total:
            return None if rec["state"] == "running" else 0.0
        rate = rec["rate_bytes_per_s"] if rec["state"] == "running" else self._rate()
        if not rate:
            return None
        return max(0.0, total - done) / rate

    def _snapshot(self) -> dict:
        stages = []
        for s in self.order:
            rec = self.stages[s]
            rec["eta_s"] = self._eta(rec)
            stages.append(dict(rec))
        etas = [r["eta_s"] for r in stages]
        return {
            "updated": time.time(),
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "eta_s": None if any(e is None for e in etas) else round(sum(etas), 1),
            "current": next((r["stage"] for r in stages if r["state"] == "running"), None),
            "stages": stages,
        }

    def _write(self) -> dict:
        snap = self._snapshot()
        write_json_atomic(self.path, snap)
        return snap

    def line(self, stage: str, snap: dict) -> str:
        rec = next(r for r in snap["stages"] if r["stage"] == stage)
        n = self.order.index(stage) + 1
        head = f"[{n}/{len(self.order)}] {stage:<10}"
        if rec["state"] == "skipped":
            return f"{head} current, skipped"
        done, total = rec["bytes_done"], rec["bytes_total"]
        amount = f"{_gb(done)} of {_gb(total)}" if total else f"{_gb(done)} read"
        pct = f" {min(100, 100 * done / total):3.0f}%" if total else ""
        what = "done in" if rec["state"] == "done" else "elapsed"
        tail = f"{what} {_hms(rec['seconds'])}"
        if rec["state"] == "running":
            tail += f", ETA {_hms(rec['eta_s'])} (run: {_hms(snap['eta_s'])} left)"
        return f"{head}{pct} {amount}, {tail}"

    def _show(self, stage: str, snap: dict, final: bool) -> None:
        if not self.tty:
            return
        self.stream.write("\r\033[K" + self.line(stage, snap) + ("\n" if final else ""))
        self.stream.flush()

    def skipped(self, stage: str) -> None:
        with self.lock:
            self.stages[stage]["state"] = "skipped"
            snap = self._write()
        self._show(stage, snap, final=True)

    def watch(self, stage: str, pid: int | None) -> Watch:
        return Watch(self, stage, pid)


class Watch(threading.Thread):
    """Samples one stage's process (``pid``: None for work done in this process) until
    ``finish``; updates the stage, progress.json and the terminal line."""

    def __init__(self, progress: Progress, stage: str, pid: int | None):
        super().__init__(daemon=True, name=f"k3dist-progress-{stage}")
        self.p, self.stage, self.pid = progress, stage, pid
        self.t0 = time.monotonic()
        self._done = threading.Event()
        with self.p.lock:
            self.p.stages[stage]["state"] = "running"
        self._sample()
        self.start()

    def _sample(self) -> dict:
        now = rchar(self.pid) if self.pid is not None else None
        with self.p.lock:
            rec = self.p.stages[self.stage]
            rec["seconds"] = round(time.monotonic() - self.t0, 2)
            if now is not None:
                rec["bytes_done"] = now
                if rec["seconds"] > 0 and now:
                    rec["rate_bytes_per_s"] = round(now / rec["seconds"])
                total = rec["bytes_total"]
                if total and now >= total / 10 and "at_10pct" not in rec:
                    # what the ETA said a tenth of the way in: against the stage's
                    # final seconds, how good the estimate was
                    eta = self.p._eta(rec)
                    rec["at_10pct"] = {"elapsed_s": rec["seconds"], "eta_s": eta}
            return self.p._write()

    def run(self) -> None:
        while not self._done.wait(self.p.every_s):
            try:
                snap = self._sample()
            except OSError:
                continue  # progress.json could not be written this second
            self.p._show(self.stage, snap, final=False)

    def finish(self, ok: bool = True, read_bytes: int | None = None) -> None:
        """The stage's process ended; ``read_bytes``: its own final count (the stats it
        wrote), which /proc no longer shows once it has exited."""
        self._done.set()
        self.join()
        with self.p.lock:
            rec = self.p.stages[self.stage]
            rec["seconds"] = round(time.monotonic() - self.t0, 2)
            if read_bytes is not None:
                rec["bytes_done"] = read_bytes
                if rec["seconds"] > 0:
                    rec["rate_bytes_per_s"] = round(read_bytes / rec["seconds"])
            rec["state"] = "done" if ok else "failed"
            snap = self.p._write()
        self.p._show(self.stage, snap, final=True)


def read(out: Path) -> dict:
    """``OUT/progress.json`` as written last."""
    return json.loads((Path(out) / PROGRESS).read_text())
