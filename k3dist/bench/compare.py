"""k3dist expert parallelism against mlx-lm's own tensor- and pipeline-parallel modes
and a single process, in one ``mlx.launch`` run (``benchmarks/speed/ep_vs_tp_pp.py``).

Method:

- Every timed block starts after a barrier (``collectives.barrier``); decode steps are
  timed synchronously (``stepping``).
- Expert parallelism's compute is *measured*: the same steps with the MoE
  ``all_sum`` bypassed (``model.set_collectives(False)``: wrong numbers, the same
  work); communication is total minus that, paired round by round. It includes
  waiting for the slower rank (load imbalance), which is what a placement changes.
- Tensor/pipeline parallel communication is *estimated*: each collective a step
  issues (counted from the model's structure) times a microbenchmark of that
  collective at that payload.
- Modes are timed in interleaved rounds (order rotated each round) so that drift
  on a shared machine lands on all of them; ratios are taken per round, then the
  median.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3dist.bench.baselines import load_pipeline, load_single, load_tensor_parallel
from k3dist.bench.builds import slice_for_rank
from k3dist.bench.collectives import barrier, collective_plan, price_plan
from k3dist.bench.record import launcher, memory, repo_path, stats, weight_bytes
from k3dist.bench.routing import balance, router_selections, selection_counts
from k3dist.bench.stepping import Mode, decode_steps, prefill, random_prompt
from k3dist.format import layout, placement
from k3dist.format.folder import load_config
from k3dist.model.forms import resolve_form
from k3dist.serve import introspect, loader

import mlx.core as mx
import numpy as np

PARALLEL = ("ep_contiguous", "ep_load_aware", "ep_split", "tp", "pp", "single")


COMPUTE_ONLY = {
    "ep_contiguous": "ep_contiguous_nocomm",
    "ep_load_aware": "ep_load_aware_nocomm",
    "ep_split": "ep_split_nocomm",
}


# modes also timed at batch > 1 (CompareSettings.batches)
BATCHED = ("ep_contiguous", "ep_split", "tp", "pp")


def batch_name(mode: str, batch: int) -> str:
    return mode if batch == 1 else f"{mode}@b{batch}"


@dataclass
class CompareSettings:
    prompt_len: int = 64
    prefill_rounds: int = 3
    decode_rounds: int = 12
    steps_per_round: int = 4
    warmup_steps: int = 2
    calib_len: int = 128
    comm_trials: int = 30
    seed: int = 0
    dtype: str = "float32"
    moe_form: str = "auto"
    batches: tuple[int, ...] = (1, 4, 8)  # decode batch sizes (prompts in lockstep)


def _rotated(names: list[str], i: int) -> list[str]:
    k = i % len(names)
    return names[k:] + names[:k]


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio_rounds(num: list[float], den: list[float]) -> list[float]:
    """Speed ratio per round: ``num`` time / ``den`` time (> 1: ``den`` faster)."""
    return [n / d for n, d in zip(num, den, strict=True)]


def compare(
    build: str | Path,
    group: mx.distributed.Group,
    s: CompareSettings,
    tmp: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """k3dist EP (contiguous and load-aware placement) vs mlx-lm TP, PP and a single
    process, on every rank of ``group`` (one ``mlx.launch`` run); this rank's report
    (merge with ``merge_compare``)."""
    rank, size = group.rank(), group.size()
    tc = layout.text_config(load_config(build))
    vocab = tc["vocab_size"]
    prompt = random_prompt(vocab, s.prompt_len, s.seed)
    calib = random_prompt(vocab, s.calib_len, s.seed + 1)
    form = resolve_form(s.moe_form)
    t0 = time.perf_counter()

    single, _ = load_single(build, s.dtype)
    counts, plcs, placements = _placements(single, tc, prompt, calib, group)
    log(f"rank {rank}: calibration + placements {time.perf_counter() - t0:.1f}s")
    models, skipped = _load_models(build, group, s, single, plcs, form, tmp)
    log(f"rank {rank}: loaded {sorted(models)} {time.perf_counter() - t0:.1f}s")

    weights = {n: weight_bytes(m) for n, m in models.items()}
    modes: dict[str, Mode] = {}
    for B in s.batches:
        for n in PARALLEL:
            if n in models and (B == 1 or n in BATCHED):
                modes[batch_name(n, B)] = Mode(batch_name(n, B), models[n], batch=B)
    for n, c in COMPUTE_ONLY.items():
        if n in models:
            modes[c] = Mode(c, models[n], collectives=False)
    # Row j of every batch is the same prompt: row 0 is the batch-1 prompt.
    rows = [prompt] + [
        random_prompt(vocab, s.prompt_len, s.seed + 100 + j) for j in range(1, max(s.batches))
    ]
    launch = _time_modes(
        modes,
        group,
        s,
        rows,
        lambda msg: log(f"rank {rank}: {msg} {time.perf_counter() - t0:.1f}s"),
    )
    counted, comm = _structure(models, group, s)

    return {
        "rank": rank,
        "size": size,
        "settings": {**s.__dict__, "moe_form_resolved": form},
        "skipped": skipped,
        "placements": placements,
        "routing_counts": {str(i): c.tolist() for i, c in counts.items()},
        "weights_bytes": weights,
        "memory": memory(),
        "trials": {
            n: {
                "batch": m.batch,
                "prefill_s": [round(x, 5) for x in m.prefill_s],
                "decode_ms": [[round(x, 4) for x in r] for r in m.decode_ms],
            }
            for n, m in modes.items()
        },
        # batch-1 modes: one token per step; batches: the tokens of row 0 (the batch-1
        # prompt) and of the whole batch
        "tokens": {n: m.tokens for n, m in modes.items() if m.collectives and m.batch == 1},
        "batch_tokens": {n: m.tokens for n, m in modes.items() if m.batch > 1},
        "collectives": comm,
        "counted": counted,
        "launcher": launch,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _placements(
    single, tc: dict, prompt: list[int], calib: list[int], group: mx.distributed.Group
) -> tuple[dict, dict, dict]:
    """(routing counts per MoE layer, the two placements, their description). The
    counts come from rank 0's single-process model, shared, so every rank builds the
    same placement even where its floats would differ (another machine)."""
    rank, size = group.rank(), group.size()
    moe = layout.moe_layers(tc)
    stacked = np.zeros((len(moe), tc["num_experts"]), dtype=np.int64)
    if rank == 0:
        calib_sel = router_selections(single, calib)
        held_out = router_selections(single, prompt)
        c = selection_counts(calib_sel, tc["num_experts"])
        stacked = np.stack([c[i] for i in moe])
    stacked = np.array(
        mx.distributed.all_sum(mx.array(stacked.astype(np.int32)), group=group)
    ).astype(np.int64)
    counts = {i: stacked[j] for j, i in enumerate(moe)}
    plcs = {
        "ep_contiguous": placement.contiguous(tc["num_experts"], size, moe),
        "ep_load_aware": placement.load_aware(counts, size),
    }
    placements = {n: {"kind": p.kind, "hash": p.hash} for n, p in plcs.items()}
    if rank == 0:
        for n, p in plcs.items():
            placements[n].update(
                balance_calibration=balance(p, calib_sel),
                balance_benchmark_prompt=balance(p, held_out),
            )
    return counts, plcs, placements


def _load_models(
    build: str | Path,
    group: mx.distributed.Group,
    s: CompareSettings,
    single,
    plcs: dict,
    form: str,
    tmp: str | Path | None,
) -> tuple[dict[str, object], dict[str, str]]:
    """Every mode's model (and why any was skipped). ep_contiguous / ep_load_aware:
    attention replicated on every rank; ep_split: split by heads (contiguous
    placement), the default deployment."""
    models: dict[str, object] = {"single": single}
    skipped: dict[str, str] = {}
    eps = {n: (p, "replicated") for n, p in plcs.items()}
    eps["ep_split"] = (plcs["ep_contiguous"], "split")
    with tempfile.TemporaryDirectory(prefix="k3dist-bench-", dir=tmp) as td:
        for name, (plc, attention) in eps.items():
            folder = slice_for_rank(build, Path(td) / name, group, plc, attention)
            models[name], _, _ = loader.load_rank(folder, group, s.dtype, form)
    try:
        models["tp"], _ = load_tensor_parallel(build, group, s.dtype)
    except ValueError as e:  # the same shapes on every rank: all skip together
        skipped["tp"] = str(e)
    models["pp"], _ = load_pipeline(build, group, s.dtype)
    return models, skipped


def _time_modes(
    modes: dict[str, Mode],
    group: mx.distributed.Group,
    s: CompareSettings,
    rows: list[list[int]],
    log: Callable[[str], None],
) -> dict | None:
    """Warm every mode up, then time prefill and decode in interleaved rounds (order
    rotated each round); what the launcher's process used meanwhile (or None)."""
    names = list(modes)

    def inputs(m: Mode):
        return rows[0] if m.batch == 1 else rows[: m.batch]

    launch0, w0 = launcher(), time.perf_counter()
    # Warm-up: every mode's prefill shape and decode, compiled before timing.
    for m in modes.values():
        barrier(group)
        cache, tok, _ = m.run(lambda m=m: prefill(m.model, inputs(m)))
        m.run(lambda m=m, c=cache, t=tok: decode_steps(m.model, c, t, s.warmup_steps))
    log("warm-up done")

    for i in range(s.prefill_rounds):
        for n in _rotated(names, i):
            m = modes[n]
            if m.batch > 1 and i:  # batches: prefill once (decode is what is compared)
                continue
            barrier(group)
            m.cache, m.next_token, sec = m.run(lambda m=m: prefill(m.model, inputs(m)))
            if m.batch == 1:
                m.prefill_s.append(sec)
    for m in modes.values():  # greedy sequence: prefill's token, then every decode step
        m.tokens = [m.next_token]
        barrier(group)
        toks, _ = m.run(lambda m=m: decode_steps(m.model, m.cache, m.next_token, s.warmup_steps))
        m.tokens += toks
        m.next_token = toks[-1]
    for i in range(s.decode_rounds):
        for n in _rotated(names, i):
            m = modes[n]
            barrier(group)
            toks, ms = m.run(
                lambda m=m: decode_steps(m.model, m.cache, m.next_token, s.steps_per_round)
            )
            m.tokens += toks
            m.next_token = toks[-1]
            m.decode_ms.append(ms)
    barrier(group)
    launch1, w1 = launcher(), time.perf_counter()
    log("timed rounds done")
    if not (launch0 and launch1):
        return None
    return {
        "pid": launch1["pid"],
        "nice": launch1["nice"],
        "cpu_cores_used_while_timing": round((launch1["cpu_s"] - launch0["cpu_s"]) / (w1 - w0), 3),
    }


def _structure(
    models: dict[str, object], group: mx.distributed.Group, s: CompareSettings
) -> tuple[dict, dict]:
    """Per parallel mode: what its model holds and issues (counted), and its
    collectives priced by microbenchmark at the decode and prefill payloads."""
    counted = {}
    for n, m in models.items():
        if n != "single":
            barrier(group)
            counted[n] = {
                "collectives_per_token": introspect.collectives_per_token(m),
                "weight_bytes": introspect.bytes_held(m),
            }
    comm = {}
    memo: dict = {}
    for n in PARALLEL:
        if n in models and n != "single":
            plan = collective_plan(models[n], group)
            comm[n] = {
                "decode": price_plan(plan, group, 1, s.comm_trials, memo),
                "prefill": price_plan(plan, group, s.prompt_len, max(5, s.comm_trials // 3), memo),
            }
    return counted, comm


def summarize(rep: dict) -> dict:
    """Per mode: prefill tok/s, decode step ms and tok/s, compute vs communication;
    speed ratios per interleaved round, then median."""
    P = rep["settings"]["prompt_len"]
    tr = rep["trials"]
    round_ms = {n: [float(np.mean(r)) for r in t["decode_ms"]] for n, t in tr.items()}
    out: dict = {}
    for n, t in tr.items():
        steps = [x for r in t["decode_ms"] for x in r]
        st = stats(steps)
        B = t.get("batch", 1)
        out[n] = {
            "batch": B,
            "decode_step_ms": st,
            "decode_tok_s": round(1e3 / st["median"], 3),  # per request
            "decode_tok_s_aggregate": round(B * 1e3 / st["median"], 3),
        }
        if t["prefill_s"]:
            out[n].update(
                prefill_s=stats(t["prefill_s"]),
                prefill_tok_s=round(P / float(np.median(t["prefill_s"])), 2),
            )
    _splits(out, rep)
    ratios, per_round = _ratios(tr, round_ms)
    return {"modes": out, "ratios": ratios, "ratios_per_round": per_round}


def _splits(out: dict, rep: dict) -> None:
    """Each mode's compute vs communication (``out[mode]["split"]``): measured for EP
    (its compute-only twin), estimated for TP and PP (microbenchmarked collectives)."""
    tr = rep["trials"]
    round_ms = {n: [float(np.mean(r)) for r in t["decode_ms"]] for n, t in tr.items()}
    for n, c in COMPUTE_ONLY.items():
        if n not in out:
            continue
        comm = [a - b for a, b in zip(round_ms[n], round_ms[c], strict=True)]
        pre = [a - b for a, b in zip(tr[n]["prefill_s"], tr[c]["prefill_s"], strict=True)]
        est = rep["collectives"].get(n, {})
        out[n]["split"] = {
            "method": "measured: the same steps with the MoE all_sum bypassed give compute; "
            "communication = total - compute, paired per round (so it includes "
            "waiting for the slower rank and the collective's busy-wait)",
            "decode_compute_ms": out[c]["decode_step_ms"]["median"],
            "decode_comm_ms": stats(comm),
            "decode_transfer_estimated_ms": est.get("decode", {}).get("estimated_ms"),
            "prefill_compute_s": out[c]["prefill_s"]["median"],
            "prefill_comm_s": stats(pre),
            "all_sums_per_step": sum(
                x["count"] for x in est.get("decode", {}).get("collectives", [])
            ),
        }
    for n, method in (
        (
            "tp",
            "estimated: all_sum microbenchmark (both ranks idle but for "
            "it) at each payload x count per step, read from the sharded "
            "model; compute = total - that, so it includes waiting for "
            "the peer (not separable: ring has no group split to bypass)",
        ),
        (
            "pp",
            "estimated: send/recv one-way (ping-pong / 2) per pipeline hop + "
            "the final all_gather, microbenchmarked at each payload; "
            "compute = total - that, so it includes waiting for the other "
            "stage (a pipeline runs its stages one after the other)",
        ),
    ):
        if n not in out:
            continue
        est = rep["collectives"][n]
        d, p = est["decode"]["estimated_ms"], est["prefill"]["estimated_ms"]
        out[n]["split"] = {
            "method": method,
            "decode_compute_ms": round(out[n]["decode_step_ms"]["median"] - d, 4),
            "decode_comm_ms": {"median": d},
            "decode_transfer_estimated_ms": d,
            "prefill_compute_s": round(out[n]["prefill_s"]["median"] - p / 1e3, 4),
            "prefill_comm_s": {"median": round(p / 1e3, 5)},
            "collectives_per_step": sum(x["count"] for x in est["decode"]["collectives"]),
        }
    if "single" in out:
        out["single"]["split"] = {
            "method": "no collectives",
            "decode_compute_ms": out["single"]["decode_step_ms"]["median"],
            "decode_comm_ms": {"median": 0.0},
            "decode_transfer_estimated_ms": 0.0,
        }


def _ratios(tr: dict, round_ms: dict[str, list[float]]) -> tuple[dict, dict]:
    """Speed ratios (median over rounds) and each round's: EP over the others, load-aware
    over contiguous, each batch over batch 1 and ep_split over the others per batch."""
    ratios: dict = {}
    per_round: dict = {}
    for ep, tag in (("ep_contiguous", "ep"), ("ep_load_aware", "ep_la"), ("ep_split", "ep_split")):
        for other in ("tp", "pp", "single", "ep_contiguous"):
            if ep in tr and other in tr and other != ep:
                d = _ratio_rounds(round_ms[other], round_ms[ep])
                p = _ratio_rounds(tr[other]["prefill_s"], tr[ep]["prefill_s"])
                per_round[f"{tag}_over_{other}_decode"] = [round(x, 4) for x in d]
                per_round[f"{tag}_over_{other}_prefill"] = [round(x, 4) for x in p]
                ratios[f"{tag}_over_{other}_decode"] = round(float(np.median(d)), 4)
                ratios[f"{tag}_over_{other}_prefill"] = round(float(np.median(p)), 4)
    if "ep_contiguous" in tr and "ep_load_aware" in tr:
        d = _ratio_rounds(round_ms["ep_contiguous"], round_ms["ep_load_aware"])
        ratios["ep_la_over_ep_decode"] = round(float(np.median(d)), 4)
        per_round["ep_la_over_ep_decode"] = [round(x, 4) for x in d]
    # batches: aggregate throughput at batch B over batch 1 (same mode), and modes
    # against each other at the same batch; per round, then median
    for n in BATCHED:
        for name, t in tr.items():
            B = t.get("batch", 1)
            if B == 1 or not name.startswith(f"{n}@") or n not in tr:
                continue
            d = [B * x for x in _ratio_rounds(round_ms[n], round_ms[name])]
            key = f"{n}_batch{B}_over_batch1"
            ratios[key] = round(float(np.median(d)), 4)
            per_round[key] = [round(x, 4) for x in d]
            if n == "ep_split":
                for other in ("tp", "pp", "ep_contiguous"):
                    o = batch_name(other, B)
                    if o in tr:
                        d = _ratio_rounds(round_ms[o], round_ms[name])
                        key = f"ep_split_over_{other}_decode_batch{B}"
                        ratios[key] = round(float(np.median(d)), 4)
                        per_round[key] = [round(x, 4) for x in d]
    return ratios, per_round


def merge_compare(reports: list[dict], env: dict, build: str | Path) -> dict:
    """One JSON from every rank's ``compare`` report."""
    r0 = reports[0]
    ref = r0["tokens"].get("single", [])
    agree = {}
    for n, toks in r0["tokens"].items():
        mm = _first_mismatch(toks, ref)
        agree[n] = {"same_as_single": mm is None, "first_mismatch": mm}
    ranks_agree = {
        n: all(r["tokens"][n] == toks for r in reports) for n, toks in r0["tokens"].items()
    }
    # a request's greedy tokens must not depend on the rest of its batch (float noise
    # may flip a near-tie: the first step that differs is reported)
    batch_row0 = {}
    for n, toks in r0.get("batch_tokens", {}).items():
        alone = r0["tokens"].get(n.split("@")[0], [])
        mm = _first_mismatch([t[0] for t in toks], alone)
        batch_row0[n] = {"same_as_batch1": mm is None, "first_mismatch": mm}
    summaries = [summarize(r) for r in reports]
    bm = (
        json.loads((Path(build) / "k3dist.json").read_text())
        if (Path(build) / "k3dist.json").exists()
        else {}
    )
    tc = layout.text_config(load_config(build))
    return {
        **env,
        "build": repo_path(build),
        "build_hash": bm.get("build_hash"),
        "model": {
            k: tc.get(k)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "num_experts",
                "num_experts_per_token",
                "moe_intermediate_size",
                "routed_expert_hidden_size",
                "vocab_size",
            )
        },
        "size": r0["size"],
        "settings": r0["settings"],
        "skipped": r0["skipped"],
        "placements": r0["placements"],
        "greedy_tokens": {
            "tokens": r0["tokens"],
            "vs_single": agree,
            "identical_across_ranks": ranks_agree,
            "all_modes_agree": all(a["same_as_single"] for a in agree.values()),
            "batch_row0_vs_batch1": batch_row0,
        },
        "launcher": r0.get("launcher"),
        "ratios": summaries[0]["ratios"],
        "ratios_note": "speed ratios (other mode's time / EP's time), > 1: EP faster; per "
        "interleaved round, then median; from rank 0 (ratios_by_rank: all)",
        "ratios_by_rank": [s["ratios"] for s in summaries],
        "summary": summaries[0]["modes"],
        "summary_by_rank": [s["modes"] for s in summaries],
        "ratios_per_round": summaries[0]["ratios_per_round"],
        "ranks": reports,
    }
