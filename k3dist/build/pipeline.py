"""Moonshot's folder -> per-rank folders ready to serve, in one resumable command.

    python -m k3dist.build.pipeline --src SRC --out OUT [--ranks 2] \\
        [--budget B | --budget-total B | --target-bpw X] \\
        [--calib-text FILES... | --calib TOKENS.npz] [--dwq] [--dry-run] [--keep]

Without a budget the plan is the planner's default (``k3dist.build.planner``: the box's
usable memory), the plan whose lo bank the quality tables measure.

Stages, in order (each one resumable, skipped when its output is current):

1. ``plan``: the byte-budget plan (``k3dist.build.planner``) from the source's config and
   index: lo format, promotions, non-expert formats. Written first: the disk plan and
   every later stage read it.
2. ``tokens``: the calibration token set: ``--calib`` as given, or ``--calib-text``
   (default: the stdlib mix) through the SOURCE's own tokenizer
   (``k3dist.build.calibtext``); each source's share lands in ``pipeline.json``.
3. ``teacher``: the token set streamed a layer at a time (``k3dist.build.teacher``)
   through the SOURCE read as its MXFP4 base build (``k3dist.build.view.SourceView``:
   experts in their source bytes, non-experts converted to the PLAN's formats per layer
   in memory by the converter's own code; never written): boundary states and
   log-probabilities.
4. ``calibrate``: per-expert scores and routes (``k3dist.build.calibrate``) of the uniform
   lo-bank student, quantized from the source a layer at a time in memory
   (``student.LoView``, grade's own quantizer; never written), against the same base view;
   then the teacher is deleted (kept for ``--dwq``).
5. ``graded``: the graded build from the base view with the plan, the taylor scores
   (global allocation) and ``k_hi`` from the routes (``profiles.convert_profile``),
   written straight into one folder per rank, ``OUT/rank{rank}``
   (``k3dist.build.direct``: one graded file at a time in scratch, sliced by
   ``k3dist.build.slicing`` into every rank, deleted).
6. ``dwq`` (``--dwq``): block-aligned DWQ (``k3dist.build.dwq``) of the graded build in
   the rank folders, its student read from the source (``dwq.graded_view``: the graded
   map of the folders' config); each block's files rewritten in every rank folder in
   place, one rank file at a time (``slicing.BuildSlicer.reslice``): the rank folders
   slicing the written DWQ build would give. Then the teacher and the DWQ scratch (its
   journal, state and small files) are deleted.

Peak disk for the real K3: ``--real-k3 --dry-run`` prints it
(``benchmarks/results/disk-plan-k3-*.json``, ``docs/build.md``).

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
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from k3dist.build import progress as progress_mod
from k3dist.format.folder import REAL_K3_CONFIG, REAL_K3_INDEX
from k3dist.format.journal import write_json_atomic
from k3dist.format.manifest import MANIFEST
from k3dist.format.sfile import CheckpointError

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


def writes_ranks(a: Args, stage: str) -> bool:
    """The stages whose output is the rank folders: ``graded`` (written straight into
    them, ``k3dist.build.direct``) and ``dwq`` (rewrites them in place)."""
    return stage in ("graded", "dwq")


def ranks_by(a: Args, ks: dict[str, str], upto: str) -> list[list[str]]:
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


# ------------------------------------------------------------------------- disk plan


def read_config_index(a: Args) -> tuple[dict, dict | None, int]:
    """(config, index, source bytes on disk) from --src or --config/--index."""
    if a.src:
        from k3dist.format.folder import INDEX_NAME, load_config, read_index

        src = Path(a.src)
        config = load_config(src)
        ip = src / INDEX_NAME
        index = read_index(ip) if ip.exists() else None
        files = [p for p in src.iterdir() if p.is_file()]
        on_disk = sum(p.stat().st_size for p in files)
        if not any(p.suffix == ".safetensors" for p in files) and index:
            on_disk = index.get("metadata", {}).get("total_size", on_disk)
        return config, index, on_disk
    if not (a.config and a.index):
        raise CheckpointError("give --src SRC, or --config C --index I (a plan without weights)")
    from k3dist.format.folder import read_index, read_json

    config, _ = read_json(a.config, "config")
    index = read_index(a.index)
    return config, index, index.get("metadata", {}).get("total_size", 0)


def account(a: Args, config: dict, index: dict | None):
    """Every tensor of the checkpoint in its planner class (once: the real K3 takes s)."""
    from k3dist.build import accounting

    return accounting.account(config, index, str(a.index or a.src))


def make_plan(a: Args, acc) -> dict:
    from k3dist.build import planner

    if sum(x is not None for x in (a.budget, a.budget_total, a.target_bpw)) > 1:
        raise CheckpointError(
            "give at most one of --budget BYTES (per rank), --budget-total BYTES or "
            "--target-bpw BITS (none: the planner's default, the box's usable memory)"
        )
    req = planner.PlanRequest(
        ranks=a.ranks,
        budget_per_rank=int(a.budget)
        if a.budget is not None
        else (int(a.budget_total) // a.ranks if a.budget_total is not None else None),
        target_expert_bpw=a.target_bpw,
        lo=a.lo,
    )
    return planner.make_plan(acc, planner.Box(), req)


def plan_kw(a: Args) -> dict:
    """profiles.plan_graded's arguments for the same plan as :func:`make_plan`."""
    return {
        "ranks": a.ranks,
        "budget": int(a.budget) if a.budget is not None else None,
        "budget_total": int(a.budget_total) if a.budget_total is not None else None,
        "target_bpw": a.target_bpw,
        "lo": a.lo,
    }


def calib_tokens(a: Args) -> int:
    """Tokens of the calibration set: --calib's, else --windows x --seq."""
    from k3dist.build import teacher

    if a.calib and Path(a.calib).exists():
        return int(teacher.read_tokens(a.calib).size)
    return a.windows * a.seq


def largest_graded_file(acc, plan: dict) -> int:
    """Bytes of the largest file of the graded build (one conversion unit: a decoder
    layer, the head, the vision tower): its experts in the plan's banks, its non-expert
    tensors at their class's planned bytes (a class's bytes shared by source size)."""
    from k3dist.format.qformat import MXFP4, QFormat

    hi_b = acc.expert_bytes(MXFP4)
    lo_b = acc.expert_bytes(QFormat.parse(plan["lo"]["format"]))
    unit: dict[str, float] = {}
    for c, specs in acc.tensors.items():
        if c == "experts":
            continue
        total = sum(t.nbytes for t in specs) or 1
        planned = plan["nonexpert"].get(c, {}).get("bytes", total)
        for t in specs:
            unit[t.group] = unit.get(t.group, 0) + planned * t.nbytes / total
    for layer in acc.moe_layers:
        p = int(plan["promoted_per_layer"].get(str(layer), 0))
        g = f"layer.{layer}"
        unit[g] = unit.get(g, 0) + p * hi_b + (acc.num_experts - p) * lo_b
    return int(max(unit.values())) + (1 << 20)  # + its header


def disk_plan(a: Args, acc, plan: dict, source_bytes: int) -> dict:
    """Bytes each stage writes, what is freed after it, the peak beside the source."""
    from k3dist.build import stream, teacher

    tc = acc.tc
    vision = acc.classes.get("vision", {}).get("source_bytes", 0)
    ntok = calib_tokens(a)
    H, V = tc["hidden_size"], tc["vocab_size"]
    states = 0
    for b in teacher.boundaries(tc):
        d = stream.blocks_before(tc, b)
        states += ntok * (H * 4 * (d + 1) + 4 * d)
    logits = ntok * (V * 4 if a.top_k == 0 else a.top_k * 8)
    per_rank = [
        plan["bytes_per_rank"]["nonexpert"] + plan["bytes_per_rank"]["routed_experts"]
        for _ in range(a.ranks)
    ]
    per_rank[0] += vision
    writes = {
        "plan": 1 << 20,
        "tokens": ntok * 8 + (1 << 20),
        "teacher": states + logits,
        # the student's block-input states and their cotangents, deleted at the end
        "calibrate": 2 * stream.state_bytes(tc, ntok) * (len(teacher.boundaries(tc)) - 1),
        # the rank folders, plus one graded file of scratch
        "graded": sum(per_rank) + largest_graded_file(acc, plan),
        # rank files rewritten in place: one at a time beside its old self (at most a
        # graded file), the propagated state, the DWQ build's small files
        "dwq": largest_graded_file(acc, plan) + stream.state_bytes(tc, ntok) + (1 << 20),
    }
    keep_after = {"calibrate": 1 << 20}  # scores + routes stay; its work folder goes
    keep_after["graded"] = sum(per_rank)  # its graded file of scratch goes
    keep_after["dwq"] = 1 << 20  # the rewritten file replaced its old self
    frees = consumers_end(a)
    rows, held, peak, peak_at = [], 0, 0, ""
    alive: dict[str, int] = {}
    for s in stages(a):
        alive[s] = writes[s]
        held = sum(alive.values())
        if held > peak:
            peak, peak_at = held, s
        if s in keep_after:
            alive[s] = keep_after[s]
        freed = 0
        if not a.keep:
            for scratch, last in frees.items():
                if last == s and scratch in alive:
                    freed += alive.pop(scratch)
        rows.append(
            {
                "stage": s,
                "writes": writes[s],
                "held_after": sum(alive.values()),
                "freed_after": freed,
            }
        )
    ranks_total = sum(per_rank)
    goal = source_bytes + int(GOAL_FACTOR * ranks_total)
    return {
        "source_bytes": source_bytes,
        "stages": rows,
        "peak_out": peak,
        "peak_stage": peak_at,
        "peak_with_source": source_bytes + peak,
        "rank_folders": per_rank,
        "rank_folders_total": ranks_total,
        "goal_bytes": goal,
        "goal_met": source_bytes + peak <= goal,
        "tokens": ntok,
        "keep": a.keep,
    }


def check_memory_caps(a: Args, config: dict, tokens: int) -> None:
    """Before anything runs: the token set's states fit --cap in every stage that holds
    them (teacher 1 copy, calibration 2, DWQ 3), not hours later in the stage itself."""
    from k3dist.build import stream
    from k3dist.format import layout

    tc = layout.text_config(config)
    copies = 3 if a.dwq else 2
    try:
        stream.check_cap(
            tc,
            tokens,
            stream.parse_bytes(a.cap),
            copies,
            "the token set's states in " + ("DWQ" if a.dwq else "calibration"),
        )
    except stream.StreamError as e:
        raise CheckpointError(f"{e} (--windows x --seq tokens, --cap)") from None


def _free_bytes(out: Path) -> int:
    p = out.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _tb(n: float) -> str:
    if n >= 1e12:
        return f"{n / 1e12:,.3f} TB"
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB"


def print_disk_plan(d: dict, free: int | None, already: int = 0) -> None:
    print(
        f"disk plan ({d['tokens']:,} calibration tokens; scratch "
        f"{'kept (--keep)' if d['keep'] else 'deleted once read'}):"
    )
    print(f"  {'stage':<10} {'writes':>12} {'freed after':>12} {'held after':>12}")
    for r in d["stages"]:
        print(
            f"  {r['stage']:<10} {_tb(r['writes']):>12} {_tb(r['freed_after']):>12} "
            f"{_tb(r['held_after']):>12}"
        )
    print(
        f"  peak in OUT {_tb(d['peak_out'])} (during {d['peak_stage']}); with the source "
        f"({_tb(d['source_bytes'])}) {_tb(d['peak_with_source'])}"
    )
    print(
        f"  rank folders {' + '.join(_tb(x) for x in d['rank_folders'])} = "
        f"{_tb(d['rank_folders_total'])}; goal source + {GOAL_FACTOR} x rank folders = "
        f"{_tb(d['goal_bytes'])}: {'met' if d['goal_met'] else 'NOT met'} "
        f"({(d['peak_with_source']) / max(d['goal_bytes'], 1):.2f} x the goal)"
    )
    if free is not None:
        print(f"  free on OUT's filesystem {_tb(free)} (+ {_tb(already)} already in OUT)")


# ------------------------------------------------------------------------- stages


def base_view(a: Args, plan: dict):
    """The source read as the MXFP4 base build the plan implies (experts in their source
    bytes, non-experts in the plan's formats), a layer at a time: never written."""
    from k3dist.build.view import SourceView
    from k3dist.format.classes import CLASSES

    return SourceView(a.src, {c: v["format"] for c, v in plan["nonexpert"].items() if c in CLASSES})


def _run_stage(a: Args, stage: str, plan: dict) -> dict:
    """The stage's work, in this (child) process. Returns facts for pipeline.json."""
    from k3dist.build import calibrate, profiles, teacher

    tok = a.path("tokens")
    if stage == "tokens":
        from k3dist.build import calibtext

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
        from k3dist.build import stream

        teacher.run(
            base_view(a, plan),
            teacher.read_tokens(tok),
            a.path("teacher"),
            cap=stream.parse_bytes(a.cap),
            batch=a.batch,
            top_k=a.top_k,
        )
    elif stage == "calibrate":
        from k3dist.build import stream, student

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
        from k3dist.build import dwq, stream

        cfg = dwq.DWQConfig(steps=a.dwq_steps, batch=a.dwq_batch)
        out = dwq.dwq(
            a.src,  # the teacher build's name only: DWQ reads the teacher's states
            a.path("teacher"),
            dwq.graded_view(base_view(a, plan), a.rank_dirs()),  # the rank folders' build
            teacher.read_tokens(tok),
            a.path("dwq"),  # scratch: the rank folders are rewritten in place
            cfg,
            cap=stream.parse_bytes(a.cap),
            ranks=a.rank_dirs(),
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
    from k3dist.build.rss import peak_rss
    from k3dist.build.stream import StreamError

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


def reads(a: Args) -> dict[str, list[str]]:
    """stage -> the earlier outputs it reads."""
    return {
        "plan": [],
        "tokens": [],
        "teacher": ["tokens"],
        "calibrate": ["teacher", "tokens"],
        "graded": ["calibrate"],
        "dwq": ["teacher", "graded", "tokens"],
    }


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
            for x in reads(a)[s]:
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
    if writes_ranks(a, stage):
        ks, by = keys(a), state.get("ranks_by")
        # graded's folders stay current under this run's DWQ (done or partly)
        current = by == ranks_by(a, ks, stage) or (
            stage == "graded" and a.dwq and by == ranks_by(a, ks, "dwq")
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
    from k3dist.build.planner import quality_line

    print(
        f"plan: lo {plan['lo']['format']}, {100 * plan['promoted_fraction']:.1f}% promoted, "
        f"expert bpw {plan['expert_bpw']}, {plan['bytes_per_rank']['total'] / 1e9:,.1f} GB per "
        f"rank; {quality_line(plan)}"
    )
    if plan["quality"]["warning"]:
        print(f"warning: {plan['quality']['warning']}", file=sys.stderr)
    free = _free_bytes(out)
    already = _du(out) if out.exists() else 0
    print_disk_plan(d, free, already)
    if dry_run:
        return {"disk_plan": d, "free": free}
    if a.src is None:
        raise CheckpointError("--config/--index plan only (--dry-run); give --src to build")
    if d["peak_out"] > free + already:
        raise CheckpointError(
            f"{out}: the pipeline needs {_tb(d['peak_out'])} at its peak (during "
            f"{d['peak_stage']}) and OUT's filesystem has {_tb(free)} free (+ "
            f"{_tb(already)} already written there); free space, choose another --out, or "
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
    shown = progress_mod.Progress(
        out,
        order,
        {
            s: round(source_bytes * progress_mod.READS_PER_SOURCE_BYTE[s])
            for s in order
            if s in progress_mod.READS_PER_SOURCE_BYTE
        },
    )
    try:
        _run_stages(a, plan, state, sp, ks, order, summary, first_to_run(a, state, ks), shown)
    finally:
        disk.stop()
    result = {
        "command": ["python", "-m", "k3dist.build.pipeline", *sys.argv[1:]],
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
        f"peak disk in OUT, sampled every {DiskWatch.every_s} s: {_tb(disk.peak)} (planned "
        f"{_tb(d['peak_out'])})"
    )
    print(f"rank folders: {', '.join(result['ranks'])}; summary: {out / SUMMARY}")
    return result


class DiskWatch(threading.Thread):
    """Samples the bytes under OUT (file sizes) every ``every_s``: the measured peak."""

    every_s = 1.0

    def __init__(self, out: Path):
        super().__init__(daemon=True)
        self.out, self.peak = out, _du(out)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            try:
                self.peak = max(self.peak, _du(self.out))
            except OSError:  # a file went between listing and stat
                pass

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, _du(self.out))


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
    out = Path(a.out)
    for n, stage in enumerate(order, 1):
        key = ks[stage]
        if n - 1 < first:
            rec = state["stages"][stage]
            if not shown.tty:  # on a terminal the progress line says it
                print(f"[{n}/{len(order)}] {stage}: current, skipped")
            shown.skipped(stage)
            summary.append(
                {
                    "stage": stage,
                    "skipped": True,
                    **{k: rec.get(k) for k in STAGE_FACTS},
                }
            )
            continue
        rec = state["stages"].get(stage)
        if rec and rec.get("deleted"):
            rec.pop("deleted")
        if rec and rec.get("key") != key:
            _delete(a.path(stage))  # made from other inputs: the tool would refuse it
        want, by = ranks_by(a, ks, stage), state.get("ranks_by")
        if stage == "graded" and by != want:
            for r in a.rank_dirs():  # rank folders of another run: the slicer would refuse
                _delete(r)
        elif stage == "dwq" and by not in (want, ranks_by(a, ks, "graded")):
            raise CheckpointError(  # graded ran or was current just before
                f"{out}: the rank folders are not this run's graded build ({by}); delete "
                f"them and run again"
            )
        if writes_ranks(a, stage):  # dwq: rewrites the graded rank folders in place
            state["ranks_by"] = want
            write_json_atomic(sp, state)
        if not shown.tty:
            print(f"[{n}/{len(order)}] {stage} ...", flush=True)
        t0 = time.perf_counter()
        if stage == "plan":
            watch = shown.watch(stage, None)
            write_json_atomic(a.path("plan"), plan)
            stats = {"seconds": 0.0, "peak_rss": None, "io": {}, "facts": {}}
            watch.finish()
        else:
            stats_path = out / f".stage-{stage}.json"
            stats_path.unlink(missing_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "k3dist.build.pipeline",
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
                watch.finish(ok, got.get("io", {}).get("rchar"))
            if rc != 0 or not stats_path.exists():
                write_json_atomic(sp, state)
                raise CheckpointError(
                    f"stage {stage} failed (exit {rc}); its output so far is kept and the "
                    f"same command resumes it: python -m k3dist.build.pipeline "
                    f"{' '.join(sys.argv[1:])}"
                )
            stats = json.loads(stats_path.read_text())
            stats_path.unlink()
        outb = sum(_du(r) for r in a.rank_dirs()) if writes_ranks(a, stage) else _du(a.path(stage))
        rec = {
            "key": key,
            "done": True,
            "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss": stats["peak_rss"],
            "read_bytes": stats["io"].get("read"),
            "written_bytes": stats["io"].get("written"),
            "rchar": stats["io"].get("rchar"),
            "wchar": stats["io"].get("wchar"),
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
        summary.append(
            {
                "stage": stage,
                "skipped": False,
                **{k: rec.get(k) for k in STAGE_FACTS},
            }
        )


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
    ap = argparse.ArgumentParser(
        description="Moonshot's K3 folder -> per-rank folders in one "
        "resumable command (module doc: python -m pydoc "
        "k3dist.build.pipeline)."
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
    ap.add_argument("--ranks", type=int, default=2)
    b = ap.add_mutually_exclusive_group()
    b.add_argument(
        "--budget",
        type=float,
        help="bytes per rank (weights + KV + activations; default: the planner's, what a "
        "512 GB box wires less its runtime reserve)",
    )
    b.add_argument("--budget-total", type=float, help="bytes over all ranks")
    b.add_argument("--target-bpw", type=float, help="routed-expert bits per weight")
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
        "(default: the stdlib mix, k3dist.build.calibtext)",
    )
    ap.add_argument("--windows", type=int, default=16, help="calibration windows (--calib-text)")
    ap.add_argument("--seq", type=int, default=256, help="tokens a window (--calib-text)")
    ap.add_argument("--batch", type=int, default=4, help="windows per teacher/calibration call")
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
        ranks=ns.ranks,
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
