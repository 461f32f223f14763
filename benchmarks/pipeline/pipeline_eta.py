"""How good the pipeline's ETA is: the one-command pipeline run on a source while
``OUT/progress.json`` is read every ``--every`` seconds; per stage, what the ETA said
before the stage started (the cost model) and a tenth of the way in (the stage's own
``at_10pct`` record), against the seconds the stage took.

    nice -n 10 .venv/bin/python benchmarks/pipeline/pipeline_eta.py --src SRC --work DIR \\
        [--out benchmarks/results/DATE/pipeline-eta.json] -- PIPELINE FLAGS...

The flags after ``--`` go to ``python -m k3dist.pipeline.runner`` (``--src`` and
``--out`` are this script's). The issue's goal: the ETA a tenth of the way into a stage
within 25 % of the stage's time (``error_at_10pct``: (elapsed + ETA) / seconds - 1, when
a tenth of its planned bytes were read; ``at_10pct_of_time``: the same a tenth of its
time in). The 1-minute load average is recorded at every read of progress.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from k3dist.bench import record
from k3dist.pipeline import progress

GOAL = 0.25


def watch(cmd: list[str], out: Path, every: float, limit_s: float) -> tuple[int, list[dict]]:
    """Run the pipeline; progress.json as read every ``every`` s (time since start)."""
    t0 = time.monotonic()
    polls: list[dict] = []
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        while child.poll() is None:
            if time.monotonic() - t0 > limit_s:
                raise TimeoutError(f"the pipeline ran past --limit-s {limit_s}")
            try:
                snap = progress.read(out)
            except (OSError, ValueError):  # not written yet
                snap = None
            if snap is not None:
                t, load = round(time.monotonic() - t0, 2), round(os.getloadavg()[0], 2)
                polls.append({"t": t, "load": load, "snap": snap})
            time.sleep(every)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    return child.returncode, polls


def judge(polls: list[dict], final: dict) -> list[dict]:
    """Per streaming stage: the model's ETA just before it started, its at_10pct
    record and the errors of both against its seconds."""
    rows = []
    for rec in final["stages"]:
        s = rec["stage"]
        if not rec.get("bytes_total") or rec["state"] != "done":
            continue
        before = [
            p["snap"]
            for p in polls
            if next(x for x in p["snap"]["stages"] if x["stage"] == s)["state"] == "pending"
        ]
        pre = next(x for x in before[-1]["stages"] if x["stage"] == s) if before else None
        at = rec.get("at_10pct") or {}
        total = at.get("elapsed_s", 0) + (at.get("eta_s") or 0) if at else None
        err = None if total is None else round(total / rec["seconds"] - 1, 3)
        model = pre["eta_s"] if pre else None
        running = [
            (p, x)
            for p in polls
            for x in p["snap"]["stages"]
            if x["stage"] == s and x["state"] == "running"
        ]
        # a tenth of the stage's time in: the poll nearest it, its elapsed + ETA
        tenth = (
            min(running, key=lambda px: abs(px[1]["seconds"] - rec["seconds"] / 10))
            if running
            else None
        )
        t_est = None if tenth is None else tenth[1]["seconds"] + (tenth[1]["eta_s"] or 0)
        rows.append(
            {
                "stage": s,
                "seconds": rec["seconds"],
                "bytes_read": rec["bytes_done"],
                "bytes_planned": rec["bytes_total"],
                # the stage's CPU seconds against the model's, and its CPU share at the end
                "cpu_s": rec.get("cpu_s"),
                "cpu_model_s": rec.get("cpu_model_s"),
                "cpu_share_end": rec.get("cpu_share"),
                "model_eta_before_start_s": model,
                "model_error": None if model is None else round(model / rec["seconds"] - 1, 3),
                "at_10pct": at,
                "estimate_at_10pct_s": None if total is None else round(total, 2),
                "error_at_10pct": err,
                "within_goal": err is not None and abs(err) <= GOAL,
                "at_10pct_of_time": None
                if t_est is None
                else {
                    "elapsed_s": tenth[1]["seconds"],
                    "eta_s": tenth[1]["eta_s"],
                    "eta_source": tenth[1]["eta_source"],
                    "error": round(t_est / rec["seconds"] - 1, 3),
                },
                "loadavg_1m": record.stats([p["load"] for p, _ in running]) if running else None,
                # the stage's own series: seconds into the run, 1-min load, bytes read, ETA
                # and its source
                "series": [
                    [p["t"], p["load"], x["bytes_done"], x["eta_s"], x["eta_source"]]
                    for p, x in running
                ],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--work", required=True, type=Path, help="the pipeline's OUT (emptied)")
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--limit-s", type=float, default=3600)
    ap.add_argument("--out", type=Path)
    ap.add_argument("flags", nargs="*", help="after --: the pipeline's flags")
    a = ap.parse_args()
    if a.work.exists():
        shutil.rmtree(a.work)
    cmd = [sys.executable, "-m", "k3dist.pipeline.runner", "--src", a.src, "--out", str(a.work)]
    cmd += a.flags
    load0 = os.getloadavg()
    rc, polls = watch(cmd, a.work, a.every, a.limit_s)
    load1 = os.getloadavg()
    if rc != 0:
        raise SystemExit(f"the pipeline failed (exit {rc}): {' '.join(cmd)}")
    final = progress.read(a.work)
    rows = judge(polls, final)
    first = polls[0]["snap"] if polls else {}
    report = {
        **record.environment(),
        "pipeline_command": record.command_line(cmd),
        "loadavg": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in load1]},
        "goal": f"|error_at_10pct| <= {GOAL} for every streaming stage",
        "goal_met": bool(rows) and all(r["within_goal"] for r in rows),
        "run_seconds": final["elapsed_s"],
        "run_eta_at_start_s": first.get("eta_s"),
        "run_eta_at_start_source": first.get("eta_source"),
        "machine_factor_end": final.get("machine_factor"),
        "polls": len(polls),
        "stages": rows,
    }
    record.emit(report, a.out, indent=1)


if __name__ == "__main__":
    main()
