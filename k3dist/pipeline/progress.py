"""The pipeline's progress: per stage, bytes done of bytes to do and an ETA; a
whole-run ETA; the same in ``OUT/progress.json`` for a script to watch.

A stage runs in its own process, measured from outside (``/proc/PID``): the bytes it has
read (``rchar`` of ``io``; the streaming stages' bytes to do are planned by the stage
cost model, ``k3dist.pipeline.stage_cost``) and the CPU seconds it has used (``stat``).
The ETA counts work in CPU seconds: the model says how many a stage needs (times
``cpu_factor``, this machine against the model, from the stages done), the stage's
process says how many it has used and how many it gets a wall second now (its CPU share
over the last ``SHARE_WINDOW_S``: what a loaded machine changes). Each ETA says where it
came from (``eta_source``):

- ``measured``: a running stage with its share measured: the CPU seconds left over its
  share now (once it has used more than the model said: its bytes left over its byte rate);
- ``model``: a stage not started (its CPU seconds over the share of the last stage that
  ran; 1 before any), or one in its first seconds (the same, less the time it has run).

Bytes are not the clock: on the rehearsal preset a sixth of the source is index and
headers, read at the start, and the vocabulary-wide tensors come last. Where ``/proc`` is
missing (macOS) nothing is measured and every ETA is the model's. On a terminal one line
per stage is rewritten in place once a second and left at its final state; otherwise
nothing is printed (progress.json is still written).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TextIO

from k3dist.format.journal import write_json_atomic
from k3dist.pipeline.stage_cost import StageCost, cpu_factor

PROGRESS = "progress.json"
# The stage's CPU share is measured over this many of its last seconds (a load that
# changes shows within it), once its samples span MIN_WINDOW_S.
SHARE_WINDOW_S, MIN_WINDOW_S = 30.0, 3.0


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


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its threads (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        costs: dict[str, StageCost],
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        every_s: float = 1.0,
        min_window_s: float = MIN_WINDOW_S,
    ):
        self.path = Path(out) / PROGRESS
        self.order, self.every_s, self.min_window_s = order, every_s, min_window_s
        self.costs = {s: costs.get(s, StageCost(None, 0.0)) for s in order}
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.stages = {
            s: {
                "stage": s,
                "state": "pending",
                "bytes_done": 0,
                "bytes_total": self.costs[s].bytes_total,
                "seconds": 0.0,
                "rate_bytes_per_s": None,
                "cpu_s": None,
                "cpu_model_s": None,
                "cpu_share": None,
                "eta_s": None,
                "eta_source": None,
            }
            for s in order
        }
        self.share = 1.0  # CPU seconds a wall second, of the last stage that ran
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self._write()

    def factor(self) -> float:
        """This machine's CPU seconds against the model's: the streaming stages done
        (the token set's tokenizer is other work: its CPU seconds say little of theirs)."""
        return cpu_factor(
            [
                (r["cpu_s"], self.costs[s].cpu_s)
                for s, r in self.stages.items()
                if r["state"] == "done" and r["cpu_s"] and r["bytes_total"]
            ]
        )

    def _eta(self, rec: dict) -> tuple[float | None, str | None]:
        """(ETA, where it came from) of one stage."""
        if rec["state"] in ("done", "skipped", "failed"):
            return 0.0, None
        work, share = rec["cpu_model_s"], rec["cpu_share"]
        if rec["state"] == "running" and share:
            left = work - rec["cpu_s"]
            if left <= 0:  # more work than modelled: what its bytes say is left
                total, rate = rec["bytes_total"], rec["rate_bytes_per_s"]
                done = rec["bytes_done"]
                left = max(0.0, total - done) / rate * share if total and rate else 0.0
            return left / share, "measured"
        return max(0.0, work / self.share - rec["seconds"]), "model"

    def _snapshot(self) -> dict:
        factor = self.factor()
        stages = []
        for s in self.order:
            rec = self.stages[s]
            if rec["state"] in ("pending", "running"):
                rec["cpu_model_s"] = round(self.costs[s].cpu_s * factor, 2)
            eta, source = self._eta(rec)
            rec["eta_s"] = None if eta is None else round(eta, 1)
            rec["eta_source"] = source
            stages.append(dict(rec))
        etas = [r["eta_s"] for r in stages]
        sources = {r["eta_source"] for r in stages} - {None}
        return {
            "updated": time.time(),
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "eta_s": None if any(e is None for e in etas) else round(sum(etas), 1),
            "eta_source": "model" if "model" in sources else "measured" if sources else None,
            "cpu_factor": round(factor, 3),
            "cpu_share": round(self.share, 3),
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
            tail += (
                f", ETA {_hms(rec['eta_s'])} ({rec['eta_source']}; run: {_hms(snap['eta_s'])} left)"
            )
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
        self.cpu: deque[tuple[float, float]] = deque()  # (seconds, CPU seconds) samples
        self._done = threading.Event()
        with self.p.lock:
            self.p.stages[stage]["state"] = "running"
        # the stage's line at once (the model's ETA), not at the first tick: a loaded
        # machine may not run the thread before the share is measured
        self.p._show(stage, self._sample(), final=False)
        self.start()

    def _measure(self, rec: dict, read: int | None, cpu: float | None) -> None:
        """The stage's bytes read and CPU seconds so far: its rates, its CPU share over
        the last SHARE_WINDOW_S, and its ETA a tenth of the way."""
        secs = rec["seconds"]
        if read is not None:
            rec["bytes_done"] = read
            if secs > 0 and read:
                rec["rate_bytes_per_s"] = round(read / secs)
        if cpu is not None:
            rec["cpu_s"] = round(cpu, 2)
            self.cpu.append((secs, cpu))
            while len(self.cpu) > 2 and secs - self.cpu[1][0] >= SHARE_WINDOW_S:
                self.cpu.popleft()
            (_, c0), span = self.cpu[0], secs - self.cpu[0][0]
            if span >= self.p.min_window_s:
                rec["cpu_share"] = round((cpu - c0) / span, 4) or None
                if rec["cpu_share"]:
                    self.p.share = rec["cpu_share"]
        total = rec["bytes_total"]
        if total and read is not None and read >= total / 10 and "at_10pct" not in rec:
            # what the ETA said a tenth of the way in: against the stage's final
            # seconds, how good the estimate was
            eta, source = self.p._eta(rec)
            rec["at_10pct"] = {"elapsed_s": secs, "eta_s": eta, "eta_source": source}

    def _sample(self) -> dict:
        read = rchar(self.pid) if self.pid is not None else None
        cpu = cpu_seconds(self.pid) if self.pid is not None else None
        with self.p.lock:
            rec = self.p.stages[self.stage]
            rec["seconds"] = round(time.monotonic() - self.t0, 2)
            self._measure(rec, read, cpu)
            return self.p._write()

    def run(self) -> None:
        while not self._done.wait(self.p.every_s):
            try:
                snap = self._sample()
            except OSError:
                continue  # progress.json could not be written this second
            self.p._show(self.stage, snap, final=False)

    def finish(
        self, ok: bool = True, read_bytes: int | None = None, cpu_s: float | None = None
    ) -> None:
        """The stage's process ended; ``read_bytes``, ``cpu_s``: its own final counts
        (the stats it wrote), which /proc no longer shows once it has exited."""
        self._done.set()
        self.join()
        with self.p.lock:
            rec = self.p.stages[self.stage]
            rec["seconds"] = round(time.monotonic() - self.t0, 2)
            if read_bytes is not None:
                rec["bytes_done"] = read_bytes
                if rec["seconds"] > 0:
                    rec["rate_bytes_per_s"] = round(read_bytes / rec["seconds"])
            if cpu_s is not None:
                rec["cpu_s"] = cpu_s
                if rec["seconds"] > 1 and cpu_s > 0:
                    self.p.share = cpu_s / rec["seconds"]
            rec["state"] = "done" if ok else "failed"
            snap = self.p._write()
        self.p._show(self.stage, snap, final=True)


def read(out: Path) -> dict:
    """``OUT/progress.json`` as written last."""
    return json.loads((Path(out) / PROGRESS).read_text())
