"""One expert-parallel deployment per box (``benchmarks/speed/ep_decode.py``): prefill tok/s
per prompt length, the decode step with its MoE ``all_sum`` and bypassed (compute),
their difference (communication, measured) and an ``all_sum`` microbenchmark at the
step's payload."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from k3dist.bench.collectives import barrier, collective_plan, price_plan
from k3dist.bench.record import memory, stats, weight_bytes
from k3dist.bench.stepping import Mode, decode_steps, prefill, random_prompt

import mlx.core as mx


@dataclass
class DecodeSettings:
    prompt_lens: tuple[int, ...] = (16, 64, 128)
    prefill_trials: int = 3
    context_len: int = 64
    decode_trials: int = 40
    warmup_steps: int = 3
    comm_trials: int = 50
    seed: int = 0


def decode_report(model, group: mx.distributed.Group, vocab: int, s: DecodeSettings) -> dict:
    """This rank's figures for an expert-parallel model: prefill tok/s per prompt
    length, decode step (batch 1) with collectives and bypassed (compute), the
    difference (communication), an all_sum microbenchmark at the step's payload."""
    t0 = time.perf_counter()
    prefill_out = {}
    for L in s.prompt_lens:
        prompt = random_prompt(vocab, L, s.seed + L)
        barrier(group)
        prefill(model, prompt)  # warm-up: compile this shape
        secs = []
        for _ in range(s.prefill_trials):
            barrier(group)
            secs.append(prefill(model, prompt)[2])
        st = stats(secs, 5)
        prefill_out[str(L)] = {
            "seconds": st,
            "tok_s": round(L / st["median"], 2),
            "trials_s": [round(x, 5) for x in secs],
        }

    prompt = random_prompt(vocab, s.context_len, s.seed)
    with_c = Mode("collectives", model)
    without = Mode("bypassed", model, collectives=False)
    for m in (with_c, without):
        barrier(group)
        m.cache, m.next_token, _ = m.run(lambda m=m: prefill(model, prompt))
        toks, _ = m.run(lambda m=m: decode_steps(model, m.cache, m.next_token, s.warmup_steps))
        m.next_token = toks[-1]
    for i in range(s.decode_trials):  # interleaved, one step each, order alternating
        for m in (with_c, without) if i % 2 == 0 else (without, with_c):
            barrier(group)
            toks, ms = m.run(lambda m=m: decode_steps(model, m.cache, m.next_token, 1))
            m.next_token = toks[-1]
            m.decode_ms.append(ms)
    total = [r[0] for r in with_c.decode_ms]
    compute = [r[0] for r in without.decode_ms]
    plan = collective_plan(model, group)
    est = price_plan(plan, group, 1, s.comm_trials)
    st = stats(total)
    return {
        "rank": group.rank(),
        "size": group.size(),
        "settings": s.__dict__ | {"prompt_lens": list(s.prompt_lens)},
        "weights_bytes": weight_bytes(model),
        "prefill": prefill_out,
        "decode": {
            "context_len": s.context_len,
            "step_ms": st,
            "tok_s": round(1e3 / st["median"], 3),
            "compute_ms": stats(compute),
            "comm_ms": stats([a - b for a, b in zip(total, compute, strict=True)]),
            "comm_method": "measured: the same steps with the MoE all_sum bypassed give "
            "compute; communication = total - compute, paired per trial "
            "(includes waiting for the slower rank)",
            "all_sums_per_step": sum(c["count"] for c in plan if c["op"] == "all_sum"),
            "all_sum_microbenchmark": est,
            "trials_ms": {
                "total": [round(x, 4) for x in total],
                "compute": [round(x, 4) for x in compute],
            },
        },
        "memory": memory(),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - t0, 1),
    }
