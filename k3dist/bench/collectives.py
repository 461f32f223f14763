"""Collectives: a barrier before every timed block (so no rank waits for a peer still
finishing the previous one; the barrier is not timed), one timer for ``all_sum``,
``all_gather`` and a send/recv hop, the collectives a model's forward issues (read
from its structure) and their price at a payload."""

from __future__ import annotations

import time
from collections.abc import Callable

from k3dist.bench.record import stats
from k3dist.model.attention import QuantizedSumLinear, SumLinear
from k3dist.model.experts import ExpertParallelMoE

import mlx.core as mx
import numpy as np
from mlx.nn.layers.distributed import QuantizedShardedToAllLinear, ShardedToAllLinear
from mlx_lm.models import kimi_k3


def barrier(group: mx.distributed.Group | None) -> None:
    if group is not None and group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group))


def _time(fn: Callable[[], mx.array], trials: int, group, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        mx.eval(fn())
    barrier(group)
    out = []
    for _ in range(trials):
        t = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t) * 1e3)
    return out


def time_all_sum(
    group,
    width: int,
    tokens: int = 1,
    trials: int = 30,
    dtype: mx.Dtype = mx.float32,
    chain: int = 1,
    warmup: int = 1,
) -> list[float]:
    """ms per ``all_sum`` of a ``[1, tokens, width]`` array; ``chain`` > 1: that many
    dependent all_sums in one graph (as a decode step issues them), per all_sum."""
    x = mx.ones((1, tokens, width), dtype=dtype)

    def run() -> mx.array:
        y = mx.distributed.all_sum(x, group=group)
        for _ in range(chain - 1):
            y = mx.distributed.all_sum(y * 0.5, group=group)
        return y

    return [t / chain for t in _time(run, trials, group, warmup)]


def allsum_timings(
    group,
    sizes: tuple[int, ...] = (7168, 10752),
    trials: int = 200,
    chain: int = 20,
    dtype: mx.Dtype = mx.bfloat16,
) -> dict:
    """Per-all_sum time in us of a ``dtype`` vector of each width, alone (one eval
    each) and ``chain`` in one graph; keyed by payload bytes (``--calibrate`` of
    ``benchmarks/speed/project.py``)."""
    out: dict = {"size": group.size()}
    for n in sizes:
        single = time_all_sum(group, n, trials=trials, dtype=dtype, warmup=20)
        chained = time_all_sum(group, n, trials=max(trials // 4, 10), dtype=dtype, chain=chain)
        out[str(n * dtype.size)] = {
            "single_median_us": round(float(np.median(single)) * 1e3, 1),
            "single_p90_us": round(float(np.percentile(single, 90)) * 1e3, 1),
            "chained_median_us": round(float(np.median(chained)) * 1e3, 1),
        }
    return out


def time_all_gather(group, width: int, tokens: int = 1, trials: int = 30) -> list[float]:
    x = mx.ones((1, tokens, width), dtype=mx.float32)
    return _time(lambda: mx.distributed.all_gather(x, group=group), trials, group)


def time_send_recv(group, width: int, tokens: int = 1, trials: int = 30) -> list[float]:
    """ms for one hop of a float32 ``[1, tokens, width]`` between ranks 0 and 1: a
    ping-pong, halved (other ranks idle)."""
    x = mx.ones((1, tokens, width), dtype=mx.float32)
    r = group.rank()

    def ping() -> mx.array:
        if r == 0:
            mx.eval(mx.distributed.send(x, 1, group=group))
            return mx.distributed.recv_like(x, 1, group=group)
        if r == 1:
            y = mx.distributed.recv_like(x, 0, group=group)
            mx.eval(y)
            return mx.distributed.send(y, 0, group=group)
        return x

    return [t / 2 for t in _time(ping, trials, group)]


def collective_plan(model, group: mx.distributed.Group | None) -> list[dict]:
    """The collectives one forward of ``model`` issues on this rank, read from its
    structure: ``{"op", "width", "count", "what"}`` (payload ``[1, T, width]``
    float32 for T tokens). all_sum for k3dist EP's MoE layers and mlx-lm TP's
    sharded-to-all layers and MoE layers; for mlx-lm's pipeline the hops (send/recv
    from rank r+1 to r, each rank's packed AttnRes blocks + hidden) and the final
    all_gather."""
    plan: dict[tuple[str, int, str], int] = {}

    def add(op: str, width: int, what: str, n: int = 1) -> None:
        plan[(op, width, what)] = plan.get((op, width, what), 0) + n

    tm = model.language_model.model
    hidden = tm.args.hidden_size
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, ExpertParallelMoE):
            if mlp.group is not None:
                w = mlp.latent_size or hidden
                add("all_sum", w + hidden if mlp._shared_split else w, "moe routed+shared")
        elif isinstance(mlp, kimi_k3.KimiK3SparseMoE) and mlp.sharding_group is not None:
            w = mlp.latent_size or hidden
            add("all_sum", w + hidden if mlp.shared_experts is not None else w, "moe routed+shared")
        for _, m in layer.named_modules():
            if isinstance(
                m, (ShardedToAllLinear, QuantizedShardedToAllLinear, SumLinear, QuantizedSumLinear)
            ):
                add("all_sum", int(m.weight.shape[0]), "sharded-to-all linear")
    if tm.pipeline_size > 1:
        # rows rank r receives from r+1: its AttnRes blocks so far + the hidden state
        mine = (tm.in_blocks + 1) if tm.use_attn_res else 1
        rows = np.array(mx.distributed.all_gather(mx.array([mine]), group=group)).reshape(-1)
        for r in range(tm.pipeline_size - 1):
            add("send_recv", int(rows[r]) * hidden, f"pipeline hop {r + 1}->{r}")
        add("all_gather", hidden, "pipeline output")
    return [
        {"op": op, "width": w, "count": n, "what": what}
        for (op, w, what), n in sorted(plan.items())
    ]


_TIMERS = {"all_sum": time_all_sum, "all_gather": time_all_gather, "send_recv": time_send_recv}


def price_plan(plan: list[dict], group, tokens: int, trials: int, memo: dict | None = None) -> dict:
    """Microbenchmark each collective of ``plan`` at ``tokens`` tokens; the step's
    estimated communication is the sum of count x median."""
    memo = {} if memo is None else memo
    rows, total = [], 0.0
    for c in plan:
        key = (c["op"], c["width"], tokens)
        if key not in memo:
            memo[key] = stats(_TIMERS[c["op"]](group, c["width"], tokens, trials))
        s = memo[key]
        total += c["count"] * s["median"]
        rows.append({**c, "tokens": tokens, "bytes": 4 * tokens * c["width"], "ms": s})
    return {"collectives": rows, "estimated_ms": round(total, 4)}
