"""The pipeline's progress: per stage, bytes done of bytes to do and an ETA; a
whole-run ETA; the same in ``OUT/progress.json`` for a script to watch.

A stage runs in its own process; its progress is measured from outside, as the bytes
that process has read (``rchar`` of ``/proc/PID/io``: every stage that takes long is
bound by streaming the source). What a stage will read, and how long it will take
before anything is measured, comes from the stage cost model
(``k3dist.pipeline.stage_cost``). Each ETA says where it came from (``eta_source``):

- ``model``: a stage not started, or one still in its start-up (it has read less than
  the source's metadata, ``StageCost.startup_bytes``, and ``WARM_FRACTION`` of its
  bytes beyond): the model's seconds for it on this machine
  (``stage_cost.machine_factor`` from the stages done so far) less the time it has run;
- ``measured``: past its start-up, (bytes to do - bytes read) / the rate it has read at
  since then (the start-up's imports and opens left out).

Where ``/proc`` is missing (macOS) the bytes are unknown and a running stage keeps the
model's ETA. On a terminal one line per stage is rewritten in place once a second and
left at its final state; otherwise nothing is printed (progress.json is still written).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from k3dist.format.journal import write_json_atomic
from k3dist.pipeline.stage_cost import StageCost, machine_factor

PROGRESS = "progress.json"
# The share of a stage's planned bytes read before its rate counts: its start-up
# (imports, the source's headers, the token set) reads at another pace than its stream.
WARM_FRACTION = 0.05


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
        costs: dict[str, StageCost],
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        every_s: float = 1.0,
    ):
        self.path = Path(out) / PROGRESS
        self.order, self.every_s = order, every_s
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
                "model_s": None,
                "eta_s": None,
                "eta_source": None,
            }
            for s in order
        }
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self._write()

    def factor(self) -> float:
        """This machine against the cost model's reference: the stages done in this run
        (the token set's too: on the reference run it took seconds of its own)."""
        return machine_factor(
            [
                (r["seconds"], self.costs[s].seconds)
                for s, r in self.stages.items()
                if r["state"] == "done"
            ]
        )

    def _eta(self, rec: dict) -> tuple[float | None, str | None]:
        """(ETA, where it came from) of one stage."""
        if rec["state"] in ("done", "skipped", "failed"):
            return 0.0, None
        rate, total = rec.get("warm_rate_bytes_per_s"), rec["bytes_total"]
        if rec["state"] == "running" and rate and total:
            return max(0.0, total - rec["bytes_done"]) / rate, "measured"
        model = rec["model_s"]
        return max(0.0, model - rec["seconds"]), "model"

    def _snapshot(self) -> dict:
        factor = self.factor()
        stages = []
        for s in self.order:
            rec = self.stages[s]
            if rec["state"] in ("pending", "running"):
                rec["model_s"] = round(self.costs[s].seconds * factor, 1)
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
            "machine_factor": round(factor, 3),
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
        self.warm: tuple[float, int] | None = None  # (seconds, bytes) past the start-up
        self._done = threading.Event()
        with self.p.lock:
            self.p.stages[stage]["state"] = "running"
        self._sample()
        self.start()

    def _measure(self, rec: dict, now: int) -> None:
        """The stage read ``now`` bytes so far: its rates, and its ETA a tenth of the way."""
        rec["bytes_done"] = now
        secs = rec["seconds"]
        if secs > 0 and now:
            rec["rate_bytes_per_s"] = round(now / secs)
        total = rec["bytes_total"]
        if not total:
            return
        if (
            self.warm is None
            and now >= self.p.costs[self.stage].startup_bytes + WARM_FRACTION * total
        ):
            self.warm = (secs, now)
        elif self.warm is not None and secs > self.warm[0] and now > self.warm[1]:
            rec["warm_rate_bytes_per_s"] = round((now - self.warm[1]) / (secs - self.warm[0]))
        if now >= total / 10 and "at_10pct" not in rec:
            # what the ETA said a tenth of the way in: against the stage's final
            # seconds, how good the estimate was
            eta, source = self.p._eta(rec)
            rec["at_10pct"] = {"elapsed_s": secs, "eta_s": eta, "eta_source": source}

    def _sample(self) -> dict:
        now = rchar(self.pid) if self.pid is not None else None
        with self.p.lock:
            rec = self.p.stages[self.stage]
            rec["seconds"] = round(time.monotonic() - self.t0, 2)
            if now is not None:
                self._measure(rec, now)
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
            rec.pop("warm_rate_bytes_per_s", None)
            rec["state"] = "done" if ok else "failed"
            snap = self.p._write()
        self.p._show(self.stage, snap, final=True)


def read(out: Path) -> dict:
    """``OUT/progress.json`` as written last."""
    return json.loads((Path(out) / PROGRESS).read_text())
