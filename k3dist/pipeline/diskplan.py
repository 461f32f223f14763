"""The pipeline's disk plan, before anything is written: the source's config and index,
the byte-budget plan, the peak disk of every stage against the goal, memory caps."""

from __future__ import annotations

import shutil
from pathlib import Path

from k3dist.format.sfile import CheckpointError
from k3dist.pipeline.stage_graph import GOAL_FACTOR, Args, consumers_end, stages

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
    from k3dist.pipeline import accounting

    return accounting.account(config, index, str(a.index or a.src))


def make_plan(a: Args, acc) -> dict:
    from k3dist.config.box import Box, parse_boxes
    from k3dist.pipeline import byte_budget

    try:
        boxes = parse_boxes(a.boxes) if a.boxes else None
        req = byte_budget.plan_request(
            a.ranks,
            a.budget,
            a.budget_total,
            a.target_bpw,
            auto=True,
            lo=a.lo,
            boxes=boxes,
            expert_split=a.expert_split,
        )
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return byte_budget.make_plan(acc, Box(), byte_budget.Limits.of(byte_budget.shipped()), req)


def calib_tokens(a: Args) -> int:
    """Tokens of the calibration set: --calib's, else --windows x --seq."""
    from k3dist.pipeline import teacher

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
    from k3dist.pipeline import stream, teacher

    tc = acc.tc
    vision = acc.classes.get("vision", {}).get("source_bytes", 0)
    ntok = calib_tokens(a)
    H, V = tc["hidden_size"], tc["vocab_size"]
    states = 0
    for b in teacher.boundaries(tc):
        d = stream.blocks_before(tc, b)
        states += ntok * (H * 4 * (d + 1) + 4 * d)
    logits = ntok * (V * 4 if a.top_k == 0 else a.top_k * 8)
    per_rank = [  # boxes of different memory: each its own experts
        plan["bytes_per_rank"]["nonexpert"] + b["routed_experts"]
        for b in plan.get("per_box") or [plan["bytes_per_rank"]] * a.ranks
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
    from k3dist.format import layout
    from k3dist.pipeline import stream

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


def free_bytes(out: Path) -> int:
    p = out.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tb(n: float) -> str:
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
            f"  {r['stage']:<10} {tb(r['writes']):>12} {tb(r['freed_after']):>12} "
            f"{tb(r['held_after']):>12}"
        )
    print(
        f"  peak in OUT {tb(d['peak_out'])} (during {d['peak_stage']}); with the source "
        f"({tb(d['source_bytes'])}) {tb(d['peak_with_source'])}"
    )
    print(
        f"  rank folders {' + '.join(tb(x) for x in d['rank_folders'])} = "
        f"{tb(d['rank_folders_total'])}; goal source + {GOAL_FACTOR} x rank folders = "
        f"{tb(d['goal_bytes'])}: {'met' if d['goal_met'] else 'NOT met'} "
        f"({(d['peak_with_source']) / max(d['goal_bytes'], 1):.2f} x the goal)"
    )
    if free is not None:
        print(f"  free on OUT's filesystem {tb(free)} (+ {tb(already)} already in OUT)")
