"""One decode step: bytes read per rank per token, collectives, the per-box footprint."""

from __future__ import annotations

import math

from k3dist.bench.costmodel.facts import Facts, Layer, facts
from k3dist.bench.costmodel.hardware import (
    ACT_BYTES,
    EP_MODES,
    FORMS,
    GROUPS,
    MODES,
    SPLIT,
    Hardware,
    Profile,
)
from k3dist.bench.costmodel.loads import Load, routed_loads
from k3dist.format import layout

# ---------------------------------------------------------------- one step


def shared_splits(f: Facts, size: int) -> bool:
    """Whether EP splits the shared experts (model.experts.ExpertParallelMoE.shard_shared)."""
    inter = f.tc["moe_intermediate_size"] * (f.tc.get("num_shared_experts") or 0)
    if not inter or inter % size:
        return False
    return f.profile.nonexpert_bits == 16 or (inter // size) % f.profile.group_size == 0


def split_fraction(mode: str, group: str, f: Facts, size: int) -> float:
    if group not in SPLIT[mode] or size == 1:
        return 1.0
    if group == "shared" and mode in EP_MODES and not shared_splits(f, size):
        return 1.0
    return 1.0 / size


def _layer_step(
    f: Facts,
    L: Layer,
    mode: str,
    size: int,
    load: Load | None,
    form: str,
    hw: Hardware,
    context: int,
    batch: int = 1,
) -> dict:
    """Bytes (by group) and FLOPs one rank spends on one layer, on the critical path.
    Weights are read once per step whatever the batch; caches, states and FLOPs scale
    with it."""
    by = {g: L.bytes[g] * split_fraction(mode, g, f, size) for g in GROUPS}
    flops = batch * sum(2 * L.elems[g] * split_fraction(mode, g, f, size) for g in GROUPS)
    heads = split_fraction(mode, "attn_heads", f, size)
    by["state"] = batch * (2 * L.state_bytes * heads + L.cache_bytes_per_token * context)
    if L.attention == "mla":
        tc = f.tc
        lat = tc["kv_lora_rank"]
        flops += (
            batch
            * 2
            * tc["num_attention_heads"]
            * heads
            * context
            * (lat + tc["qk_rope_head_dim"] + lat)
        )
    else:
        lc = f.tc["linear_attn_config"]
        flops += batch * 8 * lc["num_heads"] * heads * lc["head_dim"] ** 2
    by["routed_experts"] = by["routed_experts_mean"] = by["placeholder"] = 0.0
    if L.moe:
        k, pair, expert_flops = f.top_k, f.pair_bytes, 2 * f.expert_elems
        distinct = k if load is None or load.distinct is None else load.distinct
        if mode in EP_MODES and size > 1:
            by["routed_experts"] = load.max * pair
            by["routed_experts_mean"] = max(load.mean) * pair
            if form == "placeholder":
                by["placeholder"] = hw.placeholder_reads * f.expert_bytes
                flops += batch * k * expert_flops
            else:
                pairs = load.max if load.pairs_max is None else load.pairs_max
                flops += pairs * expert_flops
        elif mode == "tp":
            by["routed_experts"] = by["routed_experts_mean"] = distinct * pair / size
            flops += batch * k * expert_flops / size
        else:  # pp, or a single rank
            by["routed_experts"] = by["routed_experts_mean"] = distinct * pair
            flops += batch * k * expert_flops
    return {"bytes": by, "flops": flops}


def _collective(op: str, count: int, size_bytes: float, n: int, hw: Hardware) -> dict:
    wire = {
        "all_sum": 2 * (n - 1) / n * size_bytes,
        "send": size_bytes,
        "all_gather": (n - 1) * size_bytes,
    }[op]
    each = hw.backend.latency_s + wire / hw.backend.bandwidth
    return {
        "op": op,
        "count": count,
        "bytes": size_bytes,
        "wire_bytes": wire,
        "each_s": each,
        "total_s": count * each,
    }


def collectives(f: Facts, mode: str, size: int, hw: Hardware, batch: int = 1) -> list[dict]:
    """Per step; payloads carry ``batch`` rows (the latency is paid once)."""
    if size == 1:
        return []
    tc = f.tc
    H, latent = tc["hidden_size"], tc.get("routed_expert_hidden_size") or tc["hidden_size"]
    H, latent = H * batch, latent * batch
    n_layers, n_moe = len(f.layers), len(f.moe_layers)
    n_dense = n_layers - n_moe
    shared = tc.get("num_shared_experts") and (mode == "tp" or shared_splits(f, size))
    moe_size = ACT_BYTES * (latent + (H if shared else 0))
    out = []
    if mode in ("ep-split", "tp"):
        out.append(
            _collective("all_sum", n_layers, ACT_BYTES * H, size, hw)
            | {"what": "attention o_proj partial sums"}
        )
    if mode in EP_MODES + ("tp",):
        out.append(
            _collective("all_sum", n_moe, moe_size, size, hw)
            | {"what": "MoE: routed latent" + (" + shared partial" if shared else "")}
        )
    if mode in ("tp", "ep-split") and n_dense:
        out.append(
            _collective("all_sum", n_dense, ACT_BYTES * H, size, hw)
            | {"what": "dense MLP down_proj partial sums"}
        )
    if mode == "pp":
        block = tc.get("attn_res_block_size")
        for start, _ in pp_stages(n_layers, size)[1:]:
            rows = 1 + (math.ceil(start / block) if block else 0)
            out.append(
                _collective("send", 1, ACT_BYTES * H * rows, size, hw)
                | {"what": f"hand-off into layer {start}: hidden + {rows - 1} AttnRes blocks"}
            )
        out.append(
            _collective("all_gather", 1, ACT_BYTES * H, size, hw)
            | {"what": "pipeline output to every rank"}
        )
    return out


def host_sync_s(f: Facts, mode: str, form: str, size: int, hw: Hardware) -> float:
    """The local MoE form's host syncs in one forward: one per MoE layer, expert
    parallel on more than one rank only."""
    return (
        hw.sync_s * len(f.moe_layers) if mode in EP_MODES and form == "local" and size > 1 else 0.0
    )


def pp_stages(n_layers: int, size: int) -> list[tuple[int, int]]:
    """[start, end) per stage in layer order, as mlx-lm's kimi_k3 pipeline() splits."""
    base, extra = divmod(n_layers, size)
    out = []
    for seg in range(size):
        start = seg * base + min(seg, extra)
        out.append((start, start + base + (1 if seg < extra else 0)))
    return out


def _sum_bytes(parts: list[dict]) -> dict:
    out: dict[str, float] = {}
    for p in parts:
        for g, v in p["bytes"].items():
            out[g] = out.get(g, 0.0) + v
    return out


def _compute_time(nbytes: float, flops: float, hw: Hardware) -> dict:
    mem = nbytes / (hw.mem_bw * hw.bw_fraction)
    fl = flops / (hw.flops * hw.flops_fraction)
    return {"memory_s": mem, "flops_s": fl, "compute_s": max(mem, fl)}


def _critical(by: dict) -> float:
    return sum(v for g, v in by.items() if g != "routed_experts_mean")


def bytes_per_token(
    mode: str,
    f: Facts,
    size: int,
    hw: Hardware | None = None,
    form: str = "placeholder",
    loads: dict[int, Load] | None = None,
    context: int = 4096,
    batch: int = 1,
) -> dict:
    """Per rank per step of ``batch`` requests in lockstep: bytes by group, FLOPs,
    collectives and time; ``tok_s`` is the aggregate (``batch`` / step time),
    ``tok_s_per_request`` one request's. For PP the stages run one after the other
    and each is listed (no micro-batching: mlx-lm's pipeline has none); ``hw`` None: the
    default box."""
    hw = hw or Hardware()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, not {form!r}")
    if loads is None and (batch > 1 or (mode in EP_MODES and size > 1)):
        loads = routed_loads(f, size, batch=batch)
    head = {
        "embed_row": batch * f.head["embed_row"],
        "lm_head": f.head["lm_head"],
        "head_norms": f.head["norms"],
    }
    head_flops = batch * 2 * f.head_elems
    colls = collectives(f, mode, size, hw, batch)
    comm = sum(c["total_s"] for c in colls)
    sync = host_sync_s(f, mode, form, size, hw)
    stage_ranges = pp_stages(len(f.layers), size) if mode == "pp" else [(0, len(f.layers))]
    stages = []
    for start, end in stage_ranges:
        parts = [
            _layer_step(f, L, mode, size, (loads or {}).get(L.index), form, hw, context, batch)
            for L in f.layers[start:end]
        ]
        by = _sum_bytes(parts)
        flops = sum(p["flops"] for p in parts)
        stages.append(
            {
                "layers": [start, end],
                "bytes": by,
                "flops": flops,
                **_compute_time(_critical(by), flops, hw),
            }
        )
    # The head (embedding row, final norm, lm_head) runs on every rank, in parallel.
    head_time = _compute_time(sum(head.values()), head_flops, hw)
    compute = sum(s["compute_s"] for s in stages) + head_time["compute_s"]
    total = compute + comm + sync
    crit = _critical(_sum_bytes(stages)) + sum(head.values())
    out = {
        "mode": mode,
        "form": form if mode in EP_MODES and size > 1 else None,
        "size": size,
        "batch": batch,
        "bytes": {k: round(v) for k, v in (_sum_bytes(stages) | head).items()},
        "bytes_critical_path": round(crit),
        "flops": sum(s["flops"] for s in stages) + head_flops,
        "collectives": colls,
        "n_collectives": sum(c["count"] for c in colls),
        "time_s": {
            "memory": sum(s["memory_s"] for s in stages) + head_time["memory_s"],
            "flops": sum(s["flops_s"] for s in stages) + head_time["flops_s"],
            "compute": compute,
            "comm": comm,
            "sync": sync,
            "total": total,
        },
        "tok_s": batch / total,
        "tok_s_per_request": 1 / total,
        "achieved_GBps": crit / total / 1e9,
    }
    if mode == "pp":
        out["stages"] = [
            {
                "layers": s["layers"],
                "bytes": round(_critical(s["bytes"])),
                "routed_experts": round(s["bytes"]["routed_experts"]),
                "compute_s": s["compute_s"],
            }
            for s in stages
        ]
        out["head_compute_s"] = head_time["compute_s"]
    return out


def box_footprint(mode: str, f: Facts, size: int, context: int = 4096, batch: int = 1) -> dict:
    """Resident bytes per box (the largest rank): weights as loaded (mlx-lm drops the
    vision tower), MLA latent cache at ``context`` and KDA state."""
    head = f.head["embed"] + f.head["lm_head"] + f.head["norms"]
    experts_per_layer = f.num_experts * f.expert_bytes
    if mode in EP_MODES or mode == "tp":
        layers = f.layers
        experts = len(f.moe_layers) * experts_per_layer / size
    else:
        lo, hi = max(pp_stages(len(f.layers), size), key=lambda r: r[1] - r[0])
        layers = f.layers[lo:hi]
        experts = sum(L.moe for L in layers) * experts_per_layer
    weights = sum(L.bytes[g] * split_fraction(mode, g, f, size) for L in layers for g in GROUPS)
    heads = split_fraction(mode, "attn_heads", f, size)
    cache = batch * sum(L.state_bytes * heads + L.cache_bytes_per_token * context for L in layers)
    total = weights + experts + head + cache
    return {
        "weights_nonexpert": round(weights + head),
        "routed_experts": round(experts),
        "cache": round(cache),
        "total": round(total),
        "total_GB": round(total / 1e9, 1),
    }


def attention_bytes(config: dict, profile: Profile, size: int = 2) -> dict:
    """Attention weight bytes one rank holds, and reads every decode token, with
    attention replicated and split over ``size`` ranks (heads split in the layers whose
    heads divide evenly, as ``layout.split_layers``; the rest replicated), and each
    box's resident total in both EP modes."""
    f = facts(config, profile)
    rep = split = 0.0
    for L in f.layers:
        divides = layout.attention_heads(f.tc, L.index) % size == 0
        rep += L.bytes["attn_heads"] + L.bytes["attn_rep"]
        split += L.bytes["attn_heads"] / (size if divides else 1) + L.bytes["attn_rep"]
    return {
        "size": size,
        "profile": profile.name,
        "attention_replicated": round(rep),
        "attention_split": round(split),
        "saved_bytes": round(rep - split),
        "saved_fraction_of_attention": round((rep - split) / rep, 4),
        "box_total": {m: box_footprint(m, f, size)["total"] for m in EP_MODES},
    }
