"""Moonshot's folder -> per-rank folders ready to serve, in one resumable command.

    python -m k3dist.pipeline.runner --src SRC --out OUT [--ranks 2] \\
        [--budget B | --budget-total B | --target-bpw X] \\
        [--calib-text FILES... | --calib TOKENS.npz] [--dwq] [--dry-run] [--keep]

Without a budget the plan is the planner's default (``k3dist.pipeline.byte_budget``: the box's
usable memory), the plan whose lo bank the quality tables measure.

Stages, in order (each one resumable, skipped when its output is current):

1. ``plan``: the byte-budget plan (``k3dist.pipeline.byte_budget``) from the source's config and
   index: lo format, promotions, non-expert formats. Written first: the disk plan and
   every later stage read it.
2. ``tokens``: the calibration token set: ``--calib`` as given, or ``--calib-text``
   (default: the stdlib mix) through the SOURCE's own tokenizer
   (``k3dist.pipeline.calibtext``); each source's share lands in ``pipeline.json``.
3. ``teacher``: the token set streamed a layer at a time (``k3dist.pipeline.teacher``)
   through the SOURCE read as its MXFP4 base build (``k3dist.pipeline.view.SourceView``:
   experts in their source bytes, non-experts converted to the PLAN's formats per layer
   in memory by the converter's own code; never written): boundary states and
   log-probabilities.
4. ``calibrate``: per-expert scores and routes (``k3dist.pipeline.calibrate``) of the uniform
   lo-bank student, quantized from the source a layer at a time in memory
   (``student.LoView``, grade's own quantizer; never written), against the same base view;
   then the teacher is deleted (kept for ``--dwq``).
5. ``graded``: the graded build from the base view with the plan, the taylor scores
   (global allocation) and ``k_hi`` from the routes (``profiles.convert_profile``),
   written straight into one folder per rank, ``OUT/rank{rank}``
   (``k3dist.pipeline.direct``: one graded file at a time in scratch, sliced by
   ``k3dist.pipeline.slicing`` into every rank, deleted).
6. ``dwq`` (``--dwq``): block-aligned DWQ (``k3dist.pipeline.dwq``) of the graded build in
   the rank folders, its student read from the source (``dwq.graded_view``: the graded
   map of the folders' config); each block's files rewritten in every rank folder in
   place, one rank file at a time (``slicing.BuildSlicer.reslice``): the rank folders
   slicing the written DWQ build would give. Then the teacher and the DWQ scratch (its
   journal, state and small files) are deleted.

Peak disk for the real K3: ``--real-k3 --dry-run`` prints it
(``benchmarks/results/*/disk-plan-k3.json``, ``docs/build.md``).

Scratch lives in ``OUT/work``; ``--keep`` keeps it. Each stage runs in its own process
(its memory goes back to the system when it ends; its peak RSS and I/O bytes are its
own). ``pipeline.json`` records what ran (its key: the arguments that shape its output,
chained, so a changed early stage redoes the ones after it), ``summary.json`` per stage
wall time, peak RSS, bytes read and written.

The disk plan (:func:`disk_plan`) is printed before anything is written: what each stage
writes, what is deleted when, the peak beside the source, OUT's free space; the run is
refused when the peak does not fit. ``--dry-run`` prints only the plan; with
``--config C --index I`` (no ``--src``) it plans a checkpoint without its weights, e.g.
the real K3 from ``k3dist/data``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from k3dist.format.folder import REAL_K3_CONFIG, REAL_K3_INDEX
from k3dist.format.journal import write_json_atomic
from k3dist.format.manifest import MANIFEST
from k3dist.format.sfile import CheckpointError
from k3dist.pipeline import progress as progress_mod
from k3dist.pipeline import stage_cost
from k3dist.pipeline.diskplan import (
    account,
    calib_tokens,
    check_memory_caps,
    disk_plan,
    du,
    free_bytes,
    make_plan,
    print_disk_plan,
    read_config_index,
    tb,
)
from k3dist.pipeline.stage_graph import (
    DWQ_FACTS,
    RANK_PATTERN,
    READS,
    STAGE_FACTS,
    STATE,
    SUMMARY,
    Args,
    consumers_end,
    keys,
    ranks_by,
    stages,
    writes_ranks,
)

# ------------------------------------------------------------------------- stages


def base_view(a: Args, plan: dict):
    """The source read as the MXFP4 base build the plan implies (experts in their source
    bytes, non-experts in the plan's formats), a layer at a time: never written."""
    from k3dist.format.classes import CLASSES
    from k3dist.pipeline.view import SourceView

    return SourceView(a.src, {c: v["format"] for c, v in plan["nonexpert"].items() if c in CLASSES})


def _run_stage(a: Args, stage: str, plan: dict) -> dict:
    """The stage's work, in this (child) process. Returns facts for pipeline.json."""
    from k3dist.pipeline import calibrate, profiles, teacher

    tok = a.path("tokens")
    if stage == "tokens":
        from k3dist.pipeline import calibtext

        if a.calib:
            from k3dist.format import layout
            from k3dist.format.folder import load_config

            tokens = teacher.read_tokens(a.calib)
            vocab = layout.text_config(load_config(a.src))["vocab_size"]
            if tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
                raise CheckpointError(
                    f"--calib {a.calib}: token ids {int(tokens.min())}..{int(tokens.max())} "
                    f"outside the source's vocabulary (0..{vocab - 1}); make the token set "
                    "with this checkpoint's tokenizer (--calib-text FILES)"
                )
            tok.parent.mkdir(parents=True, exist_ok=True)
            tmp = tok.with_name(tok.name + ".partial")
            with open(tmp, "wb") as f:
                import numpy as np

                np.savez(f, inputs=tokens)
            tmp.replace(tok)
            return {"tokens": {"from": a.calib, "shape": list(tokens.shape)}}
        tok.parent.mkdir(parents=True, exist_ok=True)
        rec = calibtext.make(a.src, tok, a.calib_text, a.windows, a.seq)
        for w in rec["warnings"]:
            print(f"warning: {w}", file=sys.stderr)
        return {"tokens": rec}
    elif stage == "teacher":
        from k3dist.pipeline import stream

        teacher.run(
            base_view(a, plan),
            teacher.read_tokens(tok),
            a.path("teacher"),
            cap=stream.parse_bytes(a.cap),
            batch=a.batch,
            top_k=a.top_k,
        )
    elif stage == "calibrate":
        from k3dist.pipeline import stream, student

        base = base_view(a, plan)
        calibrate.calibrate(
            # the score student, quantized a layer at a time: the one the quality grid's
            # best row at the plan's bytes used (planner: calib_student)
            student.LoView(base, plan.get("calib_student") or plan["lo"]["format"]),
            base,
            a.path("teacher"),
            teacher.read_tokens(tok),
            a.path("calibrate"),
            batch=a.batch,
            cap=stream.parse_bytes(a.cap),
        )
    elif stage == "graded":
        cal = a.path("calibrate")
        profiles.convert_profile(
            a.src,
            a.path("graded"),  # one graded file of scratch
            "graded",
            base=base_view(a, plan),
            scores=cal / "scores-taylor.npz",
            routes=cal / "routes.npz",
            plan=plan,  # plan.json: the same plan, not made again
            rank_pattern=str(Path(a.out) / RANK_PATTERN),
            keep=a.keep,
        )
    elif stage == "dwq":
        from k3dist.pipeline import dwq, stream
        from k3dist.pipeline.rank_files import plan_placement

        cfg = dwq.DWQConfig(steps=a.dwq_steps, batch=a.dwq_batch)
        view = dwq.graded_view(base_view(a, plan), a.rank_dirs())  # the rank folders' build
        out = dwq.dwq(
            a.path("teacher"),
            view,
            teacher.read_tokens(tok),
            a.path("dwq"),  # scratch: the rank folders are rewritten in place
            cfg,
            cap=stream.parse_bytes(a.cap),
            ranks=a.rank_dirs(),
            # boxes of different memory: the plan's placement, as the graded stage sliced
            placement=plan_placement(plan, view.gmap.num_experts, view.gmap),
        )
        m = out / MANIFEST
        if m.exists():
            blocks = json.loads(m.read_text())["dwq"]["blocks"]
            return {"dwq_blocks": [{k: b.get(k) for k in DWQ_FACTS} for b in blocks]}
    return {}


def _io() -> dict:
    try:
        with open("/proc/self/io") as f:
            d = dict(line.split(": ") for line in f.read().splitlines())
        return {
            "read": int(d["read_bytes"]),
            "written": int(d["write_bytes"]),
            "rchar": int(d["rchar"]),
            "wchar": int(d["wchar"]),
        }
    except OSError:  # macOS: block counts
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)
        return {"read": r.ru_inblock * 512, "written": r.ru_oublock * 512}


def child(a: Args, stage: str, stats: Path) -> None:
    from k3dist.pipeline.rss import peak_rss
    from k3dist.pipeline.stream import StreamError

    plan = json.loads(a.path("plan").read_text())
    t0 = time.perf_counter()
    try:
        facts = _run_stage(a, stage, plan)
    except (CheckpointError, StreamError, ValueError) as e:
        raise SystemExit(f"error: stage {stage}: {e}") from None
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    write_json_atomic(
        stats,
        {
            "seconds": round(time.perf_counter() - t0, 2),
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "peak_rss": peak_rss(),
            "io": _io(),
            "facts": facts,
        },
    )


def first_to_run(a: Args, state: dict, ks: dict[str, str]) -> int:
    """Index of the first stage to run: the first one not current, moved back to the
    stage that made any scratch a stage from there on reads and that was deleted (e.g.
    adding --dwq after a finished run needs the teacher and the graded build again)."""
    order = stages(a)
    i = next((n for n, s in enumerate(order) if not _done(a, state, s, ks[s])), len(order))
    changed = True
    while changed:
        changed = False
        for s in order[i:]:
            for x in READS[s]:
                rec = state["stages"].get(x, {})
                if rec.get("deleted") and order.index(x) < i:
                    i, changed = order.index(x), True
    return i


def _done(a: Args, state: dict, stage: str, key: str) -> bool:
    """Recorded done with this key, and its output present (or deleted as scratch after
    its last reader finished)."""
    rec = state["stages"].get(stage)
    if not rec or rec.get("key") != key or not rec.get("done"):
        return False
    if writes_ranks(stage):
        ks, by = keys(a), state.get("ranks_by")
        # graded's folders stay current under this run's DWQ (done or partly)
        current = by == ranks_by(ks, stage) or (
            stage == "graded" and a.dwq and by == ranks_by(ks, "dwq")
        )
        return current and all((r / MANIFEST).exists() for r in a.rank_dirs())
    if rec.get("deleted"):
        return True
    p = a.path(stage)
    if stage == "calibrate":
        return (p / "calibrate.json").exists()
    if p.is_dir():
        return (p / MANIFEST).exists()
    return p.exists()


def _delete(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def run(a: Args, dry_run: bool = False) -> dict:
    out = Path(a.out)
    config, index, source_bytes = read_config_index(a)
    if not dry_run:
        check_memory_caps(a, config, calib_tokens(a))
    acc = account(a, config, index)
    plan = make_plan(a, acc)
    d = disk_plan(a, acc, plan, source_bytes)
    from k3dist.pipeline.byte_budget import quality_line

    print(
        f"plan: lo {plan['lo']['format']}, {100 * plan['promoted_fraction']:.1f}% promoted, "
        f"expert bpw {plan['expert_bpw']}, {plan['bytes_per_rank']['total'] / 1e9:,.1f} GB per "
        f"rank; {quality_line(plan)}"
    )
    if plan["quality"]["warning"]:
        print(f"warning: {plan['quality']['warning']}", file=sys.stderr)
    free = free_bytes(out)
    already = du(out) if out.exists() else 0
    print_disk_plan(d, free, already)
    if dry_run:
        return {"disk_plan": d, "free": free}
    if a.src is None:
        raise CheckpointError("--config/--index plan only (--dry-run); give --src to build")
    if d["peak_out"] > free + already:
        raise CheckpointError(
            f"{out}: the pipeline needs {tb(d['peak_out'])} at its peak (during "
            f"{d['peak_stage']}) and OUT's filesystem has {tb(free)} free (+ "
            f"{tb(already)} already written there); free space, choose another --out, or "
            "drop --keep"
        )
    out.mkdir(parents=True, exist_ok=True)
    sp = out / STATE
    ks = keys(a)
    state = json.loads(sp.read_text()) if sp.exists() else {"stages": {}}
    state["args"] = asdict(a)
    state["disk_plan"] = d
    summary = []
    order = stages(a)
    load0 = os.getloadavg()
    disk = DiskWatch(out)
    disk.start()
    shown = progress_mod.Progress(out, order, stage_cost.plan(order, source_bytes, a.dwq_steps))
    try:
        _run_stages(a, plan, state, sp, ks, order, summary, first_to_run(a, state, ks), shown)
    finally:
        disk.stop()
    result = {
        "command": ["python", "-m", "k3dist.pipeline.runner", *sys.argv[1:]],
        "out": str(out),
        "ranks": [str(r) for r in a.rank_dirs()],
        "stages": summary,
        "disk_plan": d,
        "peak_disk_in_out_measured": disk.peak,
        "disk_sample_s": DiskWatch.every_s,
        "loadavg_1m": {
            "start": round(load0[0], 2),
            "end": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
        },
        "tokens": state["stages"].get("tokens", {}).get("tokens"),
    }
    write_json_atomic(out / SUMMARY, result)
    print_summary(summary)
    print(
        f"peak disk in OUT, sampled every {DiskWatch.every_s} s: {tb(disk.peak)} (planned "
        f"{tb(d['peak_out'])})"
    )
    print(f"rank folders: {', '.join(result['ranks'])}; summary: {out / SUMMARY}")
    return result


class DiskWatch(threading.Thread):
    """Samples the bytes under OUT (file sizes) every ``every_s``: the measured peak."""

    every_s = 1.0

    def __init__(self, out: Path):
        super().__init__(daemon=True)
        self.out, self.peak = out, du(out)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            try:
                self.peak = max(self.peak, du(self.out))
            except OSError:  # a file went between listing and stat
                pass

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, du(self.out))


def _run_stages(
    a: Args,
    plan: dict,
    state: dict,
    sp: Path,
    ks: dict,
    order: list[str],
    summary: list,
    first: int,
    shown: progress_mod.Progress,
) -> None:
    """Each stage in order: skipped when current, else run in a child process;
    ``shown``: where each stands (progress.json, and the terminal when there is one)."""
    for n, stage in enumerate(order, 1):
        if n - 1 < first:
            if not shown.tty:  # on a terminal the progress line says it
                print(f"[{n}/{len(order)}] {stage}: current, skipped")
            shown.skipped(stage)
            rec = state["stages"][stage]
            summary.append(
                {"stage": stage, "skipped": True, **{k: rec.get(k) for k in STAGE_FACTS}}
            )
            continue
        _clear_stale(a, state, sp, ks, stage)
        if not shown.tty:
            print(f"[{n}/{len(order)}] {stage} ...", flush=True)
        t0 = time.perf_counter()
        stats = _execute(a, plan, state, sp, stage, shown)
        rec = _record(a, state, sp, ks[stage], stage, stats, time.perf_counter() - t0)
        summary.append({"stage": stage, "skipped": False, **{k: rec.get(k) for k in STAGE_FACTS}})


def _clear_stale(a: Args, state: dict, sp: Path, ks: dict, stage: str) -> None:
    """Before ``stage`` runs: remove its output made from other inputs (the tool would
    refuse it) and, for a stage writing the rank folders, claim them for this run."""
    key = ks[stage]
    rec = state["stages"].get(stage)
    if rec and rec.get("deleted"):
        rec.pop("deleted")
    if rec and rec.get("key") != key:
        _delete(a.path(stage))
    want, by = ranks_by(ks, stage), state.get("ranks_by")
    if stage == "graded" and by != want:
        for r in a.rank_dirs():  # rank folders of another run: the slicer would refuse
            _delete(r)
    elif stage == "dwq" and by not in (want, ranks_by(ks, "graded")):
        raise CheckpointError(  # graded ran or was current just before
            f"{a.out}: the rank folders are not this run's graded build ({by}); delete "
            f"them and run again"
        )
    if writes_ranks(stage):  # dwq: rewrites the graded rank folders in place
        state["ranks_by"] = want
        write_json_atomic(sp, state)


def _execute(
    a: Args, plan: dict, state: dict, sp: Path, stage: str, shown: progress_mod.Progress
) -> dict:
    """Run ``stage`` (``plan`` here, the others in a child process, watched by
    ``shown``); its stats (seconds, peak RSS, I/O, facts). A failed child: the state is
    saved and the error names the command that resumes."""
    if stage == "plan":
        watch = shown.watch(stage, None)
        write_json_atomic(a.path("plan"), plan)
        watch.finish()
        return {"seconds": 0.0, "peak_rss": None, "io": {}, "facts": {}}
    stats_path = Path(a.out) / f".stage-{stage}.json"
    stats_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "k3dist.pipeline.runner",
        "--_stage",
        stage,
        "--_args",
        json.dumps(asdict(a)),
        "--_stats",
        str(stats_path),
    ]
    child = subprocess.Popen(cmd)
    watch = shown.watch(stage, child.pid)
    try:
        rc = child.wait()
    finally:
        ok = child.returncode == 0 and stats_path.exists()
        got = json.loads(stats_path.read_text()) if ok else {}
        watch.finish(ok, got.get("io", {}).get("rchar"), got.get("cpu_s"))
    if rc != 0 or not stats_path.exists():
        write_json_atomic(sp, state)
        raise CheckpointError(
            f"stage {stage} failed (exit {rc}); its output so far is kept and the "
            f"same command resumes it: python -m k3dist.pipeline.runner "
            f"{' '.join(sys.argv[1:])}"
        )
    stats = json.loads(stats_path.read_text())
    stats_path.unlink()
    return stats


def _record(
    a: Args, state: dict, sp: Path, key: str, stage: str, stats: dict, seconds: float
) -> dict:
    """``stage`` done: its record in the state (saved), and the scratch it was the last
    reader of deleted (unless --keep)."""
    outb = sum(du(r) for r in a.rank_dirs()) if writes_ranks(stage) else du(a.path(stage))
    io = stats["io"]
    rec = {
        "key": key,
        "done": True,
        "seconds": round(seconds, 2),
        "peak_rss": stats["peak_rss"],
        "read_bytes": io.get("read"),
        "written_bytes": io.get("written"),
        "rchar": io.get("rchar"),
        "wchar": io.get("wchar"),
        "cpu_s": stats.get("cpu_s"),
        "output_bytes": outb,
        **stats["facts"],
    }
    state["stages"][stage] = rec
    if not a.keep:
        for scratch, last in consumers_end(a).items():
            if last == stage and scratch in state["stages"]:
                _delete(a.path(scratch))
                state["stages"][scratch]["deleted"] = True
    write_json_atomic(sp, state)
    return rec


def print_summary(rows: list[dict]) -> None:
    def gb(x):
        return "-" if x is None else f"{x / 1e6:,.1f} MB" if x < 1e9 else f"{x / 1e9:,.2f} GB"

    print(
        f"{'stage':<10} {'wall s':>8} {'peak RSS':>11} {'read':>11} {'written':>11} {'output':>11}"
    )
    for r in rows:
        s = "skipped" if r["skipped"] else f"{r['seconds']:.1f}"
        print(
            f"{r['stage']:<10} {s:>8} {gb(r['peak_rss']):>11} {gb(r['read_bytes']):>11} "
            f"{gb(r['written_bytes']):>11} {gb(r['output_bytes']):>11}"
        )


def parse(argv: list[str] | None = None) -> tuple[Args, argparse.Namespace]:
    from k3dist.pipeline import byte_budget, stream

    ap = argparse.ArgumentParser(
        description="Moonshot's K3 folder -> per-rank folders in one "
        "resumable command (module doc: python -m pydoc "
        "k3dist.pipeline.runner)."
    )
    ap.add_argument("--src", help="Moonshot-format checkpoint folder")
    ap.add_argument("--config", help="config.json (with --index, --dry-run: no weights)")
    ap.add_argument("--index", help="model.safetensors.index.json[.gz] (with --config)")
    ap.add_argument(
        "--real-k3",
        action="store_true",
        help="--config/--index of the real K3 shipped in k3dist/data",
    )
    ap.add_argument("--out", help="output folder: OUT/rank{rank}, OUT/work (scratch)")
    _box_args(ap)
    byte_budget.add_budget_args(ap, auto=True)
    ap.add_argument(
        "--lo",
        default="auto",
        help="lo-bank format; auto (default): the lowest KL the quality grid measured at the "
        "plan's bytes (a format or bytes outside the grid only when named here, warned)",
    )
    c = ap.add_mutually_exclusive_group()
    c.add_argument("--calib", help="a token set (.npy/.npz 'inputs') in the source's vocabulary")
    c.add_argument(
        "--calib-text",
        nargs="+",
        metavar="FILE",
        help="text / JSONL files or folders, tokenized with the source's tokenizer "
        "(default: the stdlib mix, k3dist.pipeline.calibtext)",
    )
    ap.add_argument("--windows", type=int, default=16, help="calibration windows (--calib-text)")
    ap.add_argument("--seq", type=int, default=256, help="tokens a window (--calib-text)")
    stream.add_window_batch(ap, 4, "calibration windows per teacher/calibration call")
    ap.add_argument("--cap", default="2GiB", help="memory cap for the token set's states")
    ap.add_argument("--top-k", type=int, default=0, help="teacher log-probs kept (0: all)")
    ap.add_argument("--dwq", action="store_true", help="distil the graded build (DWQ)")
    ap.add_argument("--dwq-steps", type=int, default=60, help="DWQ steps per block")
    ap.add_argument("--dwq-batch", type=int, default=2, help="DWQ windows per step")
    ap.add_argument("--keep", action="store_true", help="keep scratch (OUT/work)")
    ap.add_argument("--dry-run", action="store_true", help="print the disk plan only")
    ap.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    ap.add_argument("--_stage", help=argparse.SUPPRESS)
    ap.add_argument("--_args", help=argparse.SUPPRESS)
    ap.add_argument("--_stats", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns._stage:
        return Args(**json.loads(ns._args)), ns
    if ns.real_k3:
        ns.config, ns.index = str(REAL_K3_CONFIG), str(REAL_K3_INDEX)
    if ns.src and (ns.config or ns.index):
        ap.error("--src or --config/--index, not both")
    if not ns.src and not ns.dry_run:
        ap.error("--src is needed to build (--config/--index: --dry-run only)")
    if not ns.out:
        if not ns.dry_run:
            ap.error("--out is needed")
        ns.out = "."
    a = Args(
        src=ns.src,
        out=ns.out,
        ranks=_ranks(ap, ns),
        boxes=ns.boxes,
        expert_split=ns.expert_split,
        budget=ns.budget,
        budget_total=ns.budget_total,
        target_bpw=ns.target_bpw,
        lo=ns.lo,
        calib=ns.calib,
        calib_text=ns.calib_text,
        windows=ns.windows,
        seq=ns.seq,
        batch=ns.batch,
        cap=ns.cap,
        top_k=ns.top_k,
        dwq=ns.dwq,
        dwq_steps=ns.dwq_steps,
        dwq_batch=ns.dwq_batch,
        keep=ns.keep,
        config=ns.config,
        index=ns.index,
    )
    return a, ns


def _box_args(ap: argparse.ArgumentParser) -> None:
    """--ranks, --boxes, --deployment and --expert-split: the boxes the plan is for."""
    ap.add_argument("--ranks", type=int, help="ranks of one box size (default 2)")
    ap.add_argument(
        "--boxes",
        help="boxes of different memory, one per rank: GiB[:wired_limit_mb] each, e.g. "
        "512,256,256 (k3dist-plan --boxes); --ranks follows; the rank folders placed by it",
    )
    ap.add_argument(
        "--deployment",
        metavar="YAML",
        help="a deployment's boxes as --boxes (deploy/tb5-3.yaml: each box's memory and "
        "wired limit); one without boxes gives --ranks its size",
    )
    ap.add_argument(
        "--expert-split",
        choices=("memory", "equal"),
        default="memory",
        help="with --boxes: experts by each box's room (default) or equal",
    )


def _ranks(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """--ranks, or the number of --boxes or --deployment's (they must agree when both are
    given); --deployment's boxes become ``ns.boxes`` (``GiB:wired_limit_mb`` each)."""
    if ns.deployment:
        from k3dist.config.box import boxes_spec
        from k3dist.config.deployment import DeploymentError, load_deployment

        if ns.boxes:
            ap.error("--boxes or --deployment, not both")
        try:
            dep = load_deployment(ns.deployment)
        except (DeploymentError, FileNotFoundError) as e:
            ap.error(f"--deployment: {e}")
        ns.boxes, ns.ranks = boxes_spec(dep.box_list()) if dep.boxes else None, ns.ranks or dep.size
    if not ns.boxes:
        return ns.ranks or 2
    from k3dist.config.box import parse_boxes

    try:
        n = len(parse_boxes(ns.boxes))
    except ValueError as e:
        ap.error(f"--boxes: {e}")
    if ns.ranks not in (None, n):
        ap.error(f"--ranks {ns.ranks} but --boxes names {n} boxes")
    return n


def main(argv: list[str] | None = None) -> None:
    a, ns = parse(argv)
    if ns._stage:
        child(a, ns._stage, Path(ns._stats))
        return
    try:
        r = run(a, dry_run=ns.dry_run)
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if ns.dry_run and ns.json:
        print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
