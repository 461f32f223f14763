"""The shipped defaults the calibrated speed table chooses (issue 40), each with the rows
that chose it, and the changes that would close the goals, alone and one on top of the
other (``benchmarks/speed/published_fit.py`` writes both into its JSON; tests/test_speed_defaults.py
checks each shipped default is the table's choice).

Every row is a projection of ``k3dist.bench.speedfit`` with the fitted terms and the tuned
stack's overheads (EternaPeptix's: the stock stack's overhead hides every other term), on
k3dist's default build, EP with attention split over two M3 Ultras. Memory comes from
``k3dist.format.kvmemory`` (what the preflight checks) at ``deploy/tb5.yaml``'s limits.
"""

from __future__ import annotations

from dataclasses import replace

from k3dist.bench import costmodel as cm
from k3dist.bench import speedfit as sf
from k3dist.config.deployment import Deployment
from k3dist.format import kvmemory, layout
from k3dist.model.forms import MOE_FORMS
from k3dist.pipeline import byte_budget

MODE = "ep-split"
HOSTFILES = {"ring": "hostfiles/tb5.json", "jaccl": "hostfiles/tb5-jaccl.json"}
CHUNKS = (128, 256, 512, 1024, 2048)
BATCHES = (1, 2, 4, 8)
CALL_TOKENS = tuple(2**i for i in range(12))  # 1 .. 2048
GOAL_DECODE, GOAL_PREFILL = 15.0, 160.0  # tok/s: batch-1 decode at 2K, prefill at 8K


def _decode(f, backend: str, t: dict, form: str, batch: int = 1, ctx: int = 2048) -> dict:
    return sf.project_decode(f, MODE, backend, ctx, batch, t, form)


def _prefill(f, backend: str, t: dict, form: str, chunk: int, prompt: int = 8192) -> dict:
    return sf.project_prefill(f, MODE, backend, prompt, chunk, t, form)


def need(tc: dict, dep: Deployment, batch: int, chunk: int) -> dict:
    """What serving holds beside the weights on a rank, as the planner reserves it
    (``byte_budget.kv_state`` and ``activations``: the preflight's sum), attention split."""
    limits = byte_budget.Limits.of(dep, batch=batch, prefill_chunk=chunk)
    return kvmemory.need_bytes(
        byte_budget.kv_state(tc, limits, 2), byte_budget.activations(tc, limits, 2)
    )


def choose(f: cm.Facts, config: dict, th: dict, dep: Deployment) -> dict:
    """Each default with its candidate rows and the rule that picked one."""
    tc = layout.text_config(config)
    t, stock = sf.with_terms(th, "ep4"), sf.with_terms(th, "pn-tp")
    form0 = "placeholder"
    rows = [
        {
            "backend": b,
            "hostfile": HOSTFILES[b],
            "decode_b1_2k_tok_s": _decode(f, b, t, form0)["tok_s"],
            "decode_b1_2k_tok_s_stock": _decode(f, b, stock, form0)["tok_s"],
        }
        for b in HOSTFILES
    ]
    backend = max(rows, key=lambda r: r["decode_b1_2k_tok_s"])
    out = {"backend": {"rule": "fastest batch-1 decode at 2K", "rows": rows, "chosen": backend}}
    be = backend["backend"]

    rows = [
        {
            "form": m,
            "decode_b1_2k_tok_s": _decode(f, be, t, m)["tok_s"],
            "prefill_8k_tok_s": _prefill(f, be, t, m, dep.prefill_chunk)["prefill_tok_s"],
        }
        for m in MOE_FORMS
    ]
    form = max(rows, key=lambda r: (r["decode_b1_2k_tok_s"], r["prefill_8k_tok_s"]))
    out["moe_form_metal"] = {
        "rule": "fastest batch-1 decode at 2K, then fastest 8K prefill",
        "rows": rows,
        "chosen": form,
    }
    rows = []
    for n in CALL_TOKENS:
        s = {}
        for m in ("placeholder", "local"):
            ch = sf.prefill_counts(f, MODE, be, n, n, m)
            s[m] = sum(sf.prefill_terms(ch, t, "proj").values()) - t["Op:proj"]
        rows.append({"tokens": n, "placeholder_s": round(s["placeholder"], 4)})
        rows[-1]["local_s"] = round(s["local"], 4)
    faster = [r["local_s"] < r["placeholder_s"] for r in rows]
    first = next(i for i in range(len(rows)) if all(faster[i:]))
    out["local_from_tokens"] = {
        "rule": "the smallest call from which every larger one is faster in the local form "
        "(one call at position 0, per-call overhead left out: the same in both forms)",
        "rows": rows,
        "chosen": rows[first],
    }
    fm = form["form"]

    rows = []
    for b in BATCHES:
        d = _decode(f, be, t, fm, batch=b)
        n = need(tc, dep, b, dep.prefill_chunk)
        rows.append(
            {
                "max_batch": b,
                "decode_2k_tok_s": d["tok_s"],
                "per_request_tok_s": d["tok_s_per_request"],
                "need_gib": round(n["total"] / 2**30, 2),
                "fits": n["total"] <= dep.memory_headroom_gib * 2**30,
            }
        )
    batch = max((r for r in rows if r["fits"]), key=lambda r: r["decode_2k_tok_s"])
    out["max_batch"] = {
        "rule": "fastest aggregate decode at 2K among batches whose KV, prompt cache and "
        f"transient at max_context fit memory_headroom_gib ({dep.memory_headroom_gib})",
        "rows": rows,
        "chosen": batch,
    }
    rows = []
    for c in CHUNKS:
        p = _prefill(f, be, t, fm, c)
        n = need(tc, dep, batch["max_batch"], c)
        rows.append(
            {
                "prefill_chunk": c,
                "prefill_8k_tok_s": p["prefill_tok_s"],
                "stall_s": round(8192 / p["prefill_tok_s"] / p["chunks"], 2),
                "activations_gb": round(n["prefill"] / 1e9, 2),
                "join_copy_gb": round(n["joining"] / 1e9, 2),
                "free": n["prefill"] <= n["joining"],
            }
        )
    chunk = max((r for r in rows if r["free"]), key=lambda r: r["prefill_8k_tok_s"])
    out["prefill_chunk"] = {
        "rule": "fastest 8K prefill among chunks whose activations at max_context fit in "
        "the transient already reserved (the copy of max_batch caches when a prompt joins): "
        "a larger one takes its difference from the routed experts' bytes",
        "rows": rows,
        "chosen": chunk,
    }
    return out


CHANGES = (  # (name, what it changes), ranked below by the projection
    (
        "per-step overhead to zero (dispatch: fused glue kernels, one async_eval a token, "
        "compiled step; the bound of what software can win)",
        {"O": 0.0},
    ),
    (
        "non-expert classes at 4 bits instead of the plan's 6/8 (sensitivity-chosen formats; "
        "KL cost not measured at 4 bits for every class)",
        {"nonexpert_bits": 4},
    ),
    (
        "prefill chunk 2048 instead of 256 (the per-chunk overhead paid 8x less; needs 57.3 GB "
        "of activations at 128K: only for prompts that leave room, or a shorter max_context)",
        {"chunk": 2048},
    ),
    (
        "per-chunk prefill overhead halved (Op: MLA latent re-expansion, dispatch and "
        "synchronisation per chunk)",
        {"Op_scale": 0.5},
    ),
    (
        "collectives overlapped with the next layer's attention (comm term hidden)",
        {"hide_comm": True},
    ),
)


def _measure(config: dict, base: cm.Profile, t: dict, chunk: int, form: str, ch: dict) -> dict:
    prof = base
    if "nonexpert_bits" in ch:
        nb = ch["nonexpert_bits"]
        prof = replace(base, class_bits=tuple((c, min(b, nb)) for c, b in base.class_bits))
    t = dict(t)
    if "O" in ch:
        t["O:proj"] = ch["O"]
    if "Op_scale" in ch:
        t["Op:proj"] *= ch["Op_scale"]
    f = cm.facts(config, prof)
    d = _decode(f, "jaccl", t, form)
    p = _prefill(f, "jaccl", t, form, ch.get("chunk", chunk))
    d_s, p_s = d["step_ms"] / 1e3, 8192 / p["prefill_tok_s"]
    if ch.get("hide_comm"):
        d_s -= d["terms_ms"]["collectives"] / 1e3
        p_s -= p["terms_s"]["collectives"]
    return {
        "decode_b1_2k_tok_s": round(1 / d_s, 2),
        "prefill_8k_tok_s": round(8192 / p_s, 1),
        "decode_terms_ms": d["terms_ms"],
        "prefill_terms_s": p["terms_s"],
    }


def levers(config: dict, plan: dict, th: dict, chunk: int, form: str) -> dict:
    """The goals' terms on the default build (EP split, JACCL, tuned overheads), each change
    alone (ranked by the product of its two gains) and the ranked changes one on top of
    the other until both goals are met or the list ends."""
    base_prof = cm.plan_profile(plan, "default")
    t = sf.with_terms(th, "ep4")
    base = _measure(config, base_prof, t, chunk, form, {})
    alone = []
    for name, ch in CHANGES:
        r = _measure(config, base_prof, t, chunk, form, ch)
        alone.append(
            {
                "change": name,
                "decode_b1_2k_tok_s": r["decode_b1_2k_tok_s"],
                "prefill_8k_tok_s": r["prefill_8k_tok_s"],
                "decode_gain": round(r["decode_b1_2k_tok_s"] / base["decode_b1_2k_tok_s"], 3),
                "prefill_gain": round(r["prefill_8k_tok_s"] / base["prefill_8k_tok_s"], 3),
                "what": ch,
            }
        )
    alone.sort(key=lambda r: -(r["decode_gain"] * r["prefill_gain"]))
    together, acc = [], {}
    for r in alone:
        acc = {**acc, **r["what"]}
        m = _measure(config, base_prof, t, chunk, form, acc)
        together.append(
            {
                "with": r["change"].split(" (")[0],
                "decode_b1_2k_tok_s": m["decode_b1_2k_tok_s"],
                "prefill_8k_tok_s": m["prefill_8k_tok_s"],
                "decode_goal_met": m["decode_b1_2k_tok_s"] >= GOAL_DECODE,
                "prefill_goal_met": m["prefill_8k_tok_s"] >= GOAL_PREFILL,
            }
        )
    return {
        "setup": "k3dist EP (attention split), JACCL, tuned overheads, moe_form " + form,
        "goals": {"decode_b1_2k_tok_s": GOAL_DECODE, "prefill_8k_tok_s": GOAL_PREFILL},
        "baseline": base,
        "budget": {"decode_step_ms": round(1e3 / GOAL_DECODE, 1), "prefill_8k_s": 8192 / 160},
        "alone": alone,
        "together": together,
    }
