"""Prefill: a prompt chunk's time per rank (FLOPs against memory reads) and the
chunk-size trade-off."""

from __future__ import annotations

import math

from k3dist.bench.costmodel.facts import Facts
from k3dist.bench.costmodel.hardware import EP_MODES, GROUPS, Hardware
from k3dist.bench.costmodel.step import (
    bytes_per_token,
    collectives,
    host_sync_s,
    split_fraction,
)

# ---------------------------------------------------------------- prefill

# Prefill efficiency of MLX on an M3 Ultra: what share of ``Hardware.flops`` a prompt's
# matmuls reach. Dense models come close to the peak; MoE prefill (gathered expert
# matmuls over few tokens per expert) far from it.
PREFILL_FLOPS_FRACTION = 0.2
PREFILL_SOURCES = {
    "prefill_flops_fraction": (
        "derived, not K3: DeepSeek-R1 671B Q4 under MLX on one M3 Ultra 512 GB prefilled a "
        "13,140-token prompt at 59.6 tok/s (getop.com forum report): 37B active x 2 FLOP x "
        "59.6 = 4.4 TFLOPS, 0.15 of 28.7 (0.2 with its MLA attention at 13K); a dense 70B "
        "4-bit under mlx-lm 0.31.2 on the same box prefills 4K at ~170 tok/s = 23.8 TFLOPS, "
        "0.83 (abhiramsalammagari.com, dense-70b-mlx-m3-ultra, 2026-05-03). 0.5 is reported "
        "beside it as the optimistic case"
    ),
    "mla_prefill": "mlx-lm 0.32.2 kimi_k3 MLA at L > 1: the cached latent (T tokens) is "
    "expanded to per-head keys and values every chunk (embed_q, unembed_out: "
    "2 x T x 512 x 256 FLOP a head), then full masked attention C x T over "
    "128 + 64 (q/k) and 128 (v) dims; absorbed (mla='absorbed'): "
    "2 x C x (128 x 512 + T x (2 x 512 + 64) + 512 x 128) FLOP a head",
    "kda_prefill": "8 x head_dim^2 FLOP per token and head (the decode model's), no growth "
    "with context",
    "experts_touched": "a chunk of C tokens reads every expert one of its C x k routes "
    "lands on: E_r (1 - (1 - k/E)^C) of a rank's E_r experts, uniform "
    "routing",
    "lm_head": "computed for the prompt's last token only (MLX evaluates the caches, not "
    "the chunk's logits)",
}


def _busiest_pairs(f: Facts, size: int, chunk: int) -> float:
    """Expected routed pairs on the busiest rank for ``chunk`` tokens (uniform routing,
    contiguous equal ranges): the mean plus the normal approximation of the spread."""
    k, E = f.top_k, f.num_experts
    p = 1 / size
    var = chunk * k * p * (1 - p) * (E - k) / (E - 1)
    spread = math.sqrt(2 / math.pi) if size == 2 else math.sqrt(2 * math.log(size))
    return chunk * k * p + spread * math.sqrt(var)


def prefill_chunk(
    f: Facts,
    mode: str,
    size: int,
    hw: Hardware,
    chunk: int,
    start: int,
    form: str = "local",
    flops_fraction: float = PREFILL_FLOPS_FRACTION,
    mla: str = "expanded",
) -> dict:
    """One rank's time for one prefill chunk of ``chunk`` tokens after ``start`` cached
    ones: weights read once, the experts the chunk touches read once, FLOPs of every
    matmul (routed pairs: the busiest rank's under EP; every pair under the placeholder
    form), MLA's growth with the context, collectives with ``chunk`` rows, and one host
    sync per MoE layer (EP local form). Roofline: max(memory, FLOPs) + comm + sync.
    ``mla``: "expanded" (mlx-lm 0.32.2 at L > 1: the cached latent expanded to per-head
    keys and values) or "absorbed" (the decode form: queries and output projected into
    the latent, attention over the T latents: what a short chunk after a long cache
    would cost without the expansion)."""
    if mode not in ("ep-split", "ep-replicated", "tp"):
        raise ValueError(f"prefill is modelled for ep-split, ep-replicated and tp, not {mode!r}")
    tc = f.tc
    T = start + chunk
    nbytes = flops = 0.0
    attn_flops = expand_flops = 0.0
    E_r = f.num_experts / size
    touched = E_r * (1 - (1 - f.top_k / f.num_experts) ** chunk)
    for L in f.layers:
        nbytes += sum(L.bytes[g] * split_fraction(mode, g, f, size) for g in GROUPS)
        flops += 2 * chunk * sum(L.elems[g] * split_fraction(mode, g, f, size) for g in GROUPS)
        heads = tc["num_attention_heads"] * split_fraction(mode, "attn_heads", f, size)
        if L.attention == "mla":
            lat, nope = tc["kv_lora_rank"], tc["qk_nope_head_dim"]
            v, rope = tc["v_head_dim"], tc["qk_rope_head_dim"]
            if mla == "absorbed":
                a = heads * 2 * chunk * (nope * lat + T * (2 * lat + rope) + lat * v)
            else:
                expand = heads * 2 * T * lat * (nope + v)
                expand_flops += expand
                a = expand + heads * 2 * chunk * T * (nope + rope + v)
            nbytes += T * L.cache_bytes_per_token
        else:
            lc = tc["linear_attn_config"]
            a = (
                chunk
                * 8
                * lc["num_heads"]
                * split_fraction(mode, "attn_heads", f, size)
                * lc["head_dim"] ** 2
            )
            nbytes += 2 * L.state_bytes * split_fraction(mode, "attn_heads", f, size)
        attn_flops += a
        if L.moe:
            nbytes += touched * f.expert_bytes  # TP: half of every touched expert, as many
            if mode == "tp" or size == 1:
                pairs = chunk * f.top_k / size
            elif form == "placeholder":
                pairs = chunk * f.top_k  # non-owned pairs run on the placeholder expert
            else:
                pairs = _busiest_pairs(f, size, chunk)
            flops += 2 * pairs * f.expert_elems
    flops += attn_flops
    colls = collectives(f, mode, size, hw, chunk)
    comm = sum(c["total_s"] for c in colls)
    sync = host_sync_s(f, mode, form, size, hw)
    mem_s = nbytes / (hw.mem_bw * hw.bw_fraction)
    flops_s = flops / (hw.flops * flops_fraction)
    return {
        "chunk": chunk,
        "start": start,
        "bytes": nbytes,
        "flops": flops,
        "attention_flops": attn_flops,
        "mla_expand_flops": expand_flops,
        "experts_touched_per_layer": touched,
        "n_collectives": sum(c["count"] for c in colls),
        "time_s": {
            "memory": mem_s,
            "flops": flops_s,
            "comm": comm,
            "sync": sync,
            "total": max(mem_s, flops_s) + comm + sync,
        },
    }


def prefill(
    f: Facts,
    mode: str,
    size: int,
    hw: Hardware,
    prompt: int,
    chunk: int,
    start: int = 0,
    form: str = "local",
    flops_fraction: float = PREFILL_FLOPS_FRACTION,
) -> dict:
    """Time to first token of a ``prompt``-token prompt whose first ``start`` tokens are
    cached: its chunks (``chunk`` tokens, the rest last) one after another, then the
    first token (one decode step: lm_head and sampling)."""
    total = comm = attn = flops = 0.0
    n = 0
    pos = start
    while pos < prompt:
        c = min(chunk, prompt - pos)
        step = prefill_chunk(f, mode, size, hw, c, pos, form, flops_fraction)
        total += step["time_s"]["total"]
        comm += step["time_s"]["comm"]
        attn += step["attention_flops"]
        flops += step["flops"]
        pos += c
        n += 1
    first = bytes_per_token(
        mode, f, size, hw, "local" if form == "local" else "placeholder", None, prompt
    )["time_s"]["total"]
    return {
        "mode": mode,
        "form": form if mode in EP_MODES else None,
        "prompt": prompt,
        "cached": start,
        "chunk": chunk,
        "chunks": n,
        "prefill_s": total,
        "comm_s": comm,
        "flops": flops,
        "attention_flops": attn,
        "first_token_s": first,
        "ttft_s": total + first,
        "prefill_tok_s": (prompt - start) / total if total else None,
    }


def chunk_tradeoff(
    f: Facts,
    mode: str,
    size: int,
    hw: Hardware,
    chunks: tuple[int, ...],
    prompt: int,
    batch: int,
    context: int,
    form: str = "local",
    flops_fraction: float = PREFILL_FLOPS_FRACTION,
) -> list[dict]:
    """Per prefill chunk size: the prompt's time to first token, and the inter-token latency
    of ``batch`` requests decoding beside it (mlx-lm's BatchGenerator runs one chunk
    between decode steps: each step waits for a chunk), mean and worst over the prompt."""
    step = bytes_per_token(
        mode, f, size, hw, form if mode in EP_MODES else "placeholder", None, context, batch
    )["time_s"]["total"]
    out = []
    for c in chunks:
        p = prefill(f, mode, size, hw, prompt, c, 0, form, flops_fraction)
        last = prefill_chunk(f, mode, size, hw, c, max(prompt - c, 0), form, flops_fraction)
        out.append(
            {
                "chunk": c,
                "ttft_s": round(p["ttft_s"], 2),
                "decode_step_alone_s": round(step, 4),
                "itl_mean_s": round(step + p["prefill_s"] / p["chunks"], 3),
                "itl_worst_s": round(step + last["time_s"]["total"], 3),
                "decode_steps_stalled": p["chunks"],
            }
        )
    return out
