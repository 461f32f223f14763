"""The cost model's free terms fitted to published runs of Kimi K3 on two M3 Ultras (issue 40).

The model (per decode step of ``batch`` requests, one rank, the critical path; per
prefill chunk likewise), on top of ``k3dist.bench.costmodel``'s counts of bytes, FLOPs
and collectives:

    t_step  = O_stack + max(B / (BW eta), F_mm / (P phi_mm)) + F_attn / (P phi_attn)
              + sum_c n_c (lambda_backend + wire_c / beta_backend)
    t_chunk = Op_stack + max(B / (BW eta), F_mm / (P phi_mm)) + F_mla / (P phi_mla) + comm

``B`` every byte a step reads (weights at the build's formats, the experts the batch
touches, caches and states), ``F_mm`` the matmul FLOPs, ``F_attn`` the attention FLOPs
over the context (MLA), ``BW`` = 819 GB/s, ``P`` = 28.7 TFLOPS (costmodel.Hardware).
Free terms: ``eta`` (bandwidth efficiency, one for all weight reads: dense and gathered
expert kernels cannot be told apart, below), ``phi_mm`` (matmul FLOP efficiency, decode
batches and prefill alike), ``phi_attn`` (MLA decode over the context), ``phi_mla``
(MLA prefill: expanded latent + masked attention), and per software stack a per-step
overhead ``O`` (dispatch, Python, synchronisation: what the stacks differ by) and a
per-chunk prefill overhead ``Op``. ``lambda`` is not fitted: every JACCL anchor runs
the same 186 collectives a step, so its latency is inseparable from the stack's
overhead; it is held at the measured 26 us (ml-explore/mlx discussion #3939) and the
ring's at the costmodel's assumption.

Anchors (:data:`ANCHORS`) carry their source and what was checked there; ``fit``
minimises log(model / published) (Levenberg-Marquardt on log-parameters, numpy only) and
``leave_one_out`` refits without each point and predicts it. Absolute times are
projections; the fitted terms are what the anchors imply under this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3dist.bench import costmodel as cm
from k3dist.model.forms import form_for

import numpy as np

BW = cm.Hardware().mem_bw
PEAK = cm.Hardware().flops

# Backends: latency per collective (s) and wire bandwidth (B/s).
BACKENDS = {
    "jaccl": (26e-6, 6.3e9),
    "jaccl-4rail": (26e-6, 4 * 6.3e9),
    "ring": (cm.BACKENDS["ring"].latency_s, cm.BACKENDS["ring"].bandwidth),
}
BACKEND_SOURCES = {
    "jaccl": "26 us an all_sum of 7-14 KB over Thunderbolt RDMA, measured on M3 Ultras "
    "running K3 (github.com/ml-explore/mlx/discussions/3939); 6.3 GB/s a rail: "
    "costmodel.BACKENDS['jaccl'] (jundot/omlx PR #3118)",
    "jaccl-4rail": "as jaccl, four rails (EternaPeptix/exo docs/kimi_k3_tp2.md: a "
    "four-rail JACCL fabric)",
    "ring": "costmodel.BACKENDS['ring'] (assumed: ~1 Thunderbolt IP round trip + MLX's ring "
    "software path); not identifiable from the one ring anchor (see docs/speed.md)",
}

# The published builds as cost-model profiles.
UVMAX = cm.Profile(
    "uvmax",
    hi_fraction=0.0,
    lo_bits=2.25,
    group_size=128,
    class_bits=(
        ("attention", 6),
        ("shared", 8),
        ("router", 8),
        ("latent", 8),
        ("dense_mlp", 6),
        ("embed", 6),
        ("lm_head", 8),
    ),
    source="kernelpool/Kimi-K3-2bit-UVMAX (issue 40: experts 2-bit g128, attention 6-bit, "
    "shared/router 8-bit; latent, dense MLP, embed, lm_head assumed 8/6/6/8)",
)
ALIS = cm.Profile(
    "alis-2.10bpw",
    hi_fraction=14000 / 82432,
    lo_bits=1.5625,
    group_size=64,
    class_bits=(
        ("attention", 6),
        ("shared", 6),
        ("router", 8),
        ("latent", 6),
        ("dense_mlp", 6),
        ("embed", 6),
        ("lm_head", 6),
    ),
    source="avlp12/alis-dwq examples/kimi-k3/README.md: 1.5625 bpw ternary codebook lo "
    "band, 14,000 of 82,432 experts mxfp4, 6-bit dense",
)


@dataclass(frozen=True)
class Anchor:
    name: str
    kind: str  # "decode" (tok/s aggregate) | "prefill" (prompt tok/s)
    stack: str  # the software whose overhead the point carries
    mode: str  # costmodel mode
    backend: str
    profile: str  # "uvmax" | "alis"
    value: float  # tok/s
    context: int = 512  # decode: tokens in the cache; prefill: the prompt
    batch: int = 1
    chunk: int = 2048  # prefill chunk (mlx-lm's prefill_step_size default)
    source: str = ""


PN = "github.com/PipeNetwork/kimi-k3-mlx benchmarks/results/"
EP = "github.com/EternaPeptix/exo docs/kimi_k3_tp2.md (stored version 22fd45f)"
_SWEEP = ((1, 2.130), (2, 4.263), (4, 9.183), (8, 15.441), (16, 28.175), (32, 40.303))
ANCHORS: tuple[Anchor, ...] = (
    Anchor(
        "PipeNetwork TP decode",
        "decode",
        "pn-tp",
        "tp",
        "jaccl",
        "uvmax",
        3.632,
        context=236,
        source=PN + "4f8564c-tp-canonical-20260729T211125Z (summary-rank0.json: generation "
        "median 3.632 tok/s over 9 runs; 108-token prompt + 256 generated; mlx 0.32.0, mlx-lm "
        "0.31.3, one RDMA device)",
    ),
    Anchor(
        "PipeNetwork TP prefill 108 tokens",
        "prefill",
        "pn-tp",
        "tp",
        "jaccl",
        "uvmax",
        47.94,
        context=108,
        source=PN + "4f8564c-tp-canonical-20260729T211125Z (prompt_tps median 47.94)",
    ),
    *(
        Anchor(
            f"PipeNetwork resident batch {b}",
            "decode",
            "pn-server",
            "tp",
            "jaccl",
            "uvmax",
            v,
            context=128,
            batch=b,
            source=PN + "b7c115b-resident-batch-20260807T063408Z/README.md (decode-only "
            "aggregate; scripts/tensor_server.py on tensor-sharded stages, JACCL one RDMA "
            "device: tensor parallel, not the pipeline the issue names)",
        )
        for b, v in _SWEEP
    ),
    *(
        Anchor(
            f"EternaPeptix TP2 decode {ctx}",
            "decode",
            "ep4",
            "tp",
            "jaccl-4rail",
            "uvmax",
            v,
            context=ctx,
            source=EP + ": UVMAX, TP2, four-rail JACCL",
        )
        for ctx, v in ((640, 12.04), (8192, 11.7), (65536, 10.4), (131072, 9.2))
    ),
    *(
        Anchor(
            f"EternaPeptix TP2 prefill {p}",
            "prefill",
            "ep4",
            "tp",
            "jaccl-4rail",
            "uvmax",
            v,
            context=p,
            source=EP,
        )
        for p, v in ((575, 113.69), (8192, 158.0), (65536, 130.0), (131072, 101.0))
    ),
    Anchor(
        "Alis EP decode",
        "decode",
        "alis",
        "ep-replicated",
        "ring",
        "alis",
        6.0,
        context=512,
        source="github.com/avlp12/alis-dwq examples/kimi-k3/README.md (stored 000a78a): "
        "'2.31 -> 6.0 tok/s' e2e, expert parallel over Thunderbolt 5 (MLX ring); the 8.8 "
        "tok/s and 24.8 s 2K prefill the issue cites (HF model card) not found in the stored "
        "versions",
    ),
)
NOT_USED = {
    "spicyneuron/Kimi-K2.6-MLX-3.3bit (one box, 223.6 prompt / 21.4 decode tok/s)": "a "
    "different model (K2.6: 61 layers, MLA only); the cost model counts K3's layout only",
    "issue's EternaPeptix 14.2 tok/s at 0.6-1K, 147 prefill at 2K": "not in the stored "
    "version of docs/kimi_k3_tp2.md (which gives 12.04 decode / 113.7 prefill at 575 "
    "tokens); the stored figures are used",
    "Alis n-gram speculation 0.58x (5.36 -> 3.13 tok/s, alis-dwq docs/kimi-k3-mlx-port.md)": (
        "confirmed; not a speed anchor: speculation is left out of the projection"
    ),
}

PARAMS = ("eta", "phi_mm", "phi_attn", "phi_mla")
STACKS = ("pn-tp", "pn-server", "ep4", "alis")


def params_of(anchors: tuple[Anchor, ...] | list[Anchor]) -> list[str]:
    """The free terms the anchors bear on: the shared efficiencies, and per stack a
    decode overhead (``O:stack``) and a prefill overhead (``Op:stack``) where it has points."""
    out = list(PARAMS)
    for s in STACKS:
        for kind, key in (("decode", "O"), ("prefill", "Op")):
            if any(a.stack == s and a.kind == kind for a in anchors):
                out.append(f"{key}:{s}")
    return out


# ---------------------------------------------------------------- counts


def _profile(name: str) -> cm.Profile:
    return {"uvmax": UVMAX, "alis": ALIS}.get(name) or cm.PROFILES[name]


def _comm(colls: list[dict], backend: str) -> float:
    lat, bw = BACKENDS[backend]
    return sum(c["count"] * (lat + c["wire_bytes"] / bw) for c in colls)


_LOADS: dict = {}  # (facts, batch) -> routed loads: sampled once (batch > 1 is costly)
_COUNTS: dict = {}


def _loads(f: cm.Facts, batch: int, size: int = 2, pl=None):
    key = (id(f), batch, size, None if pl is None else pl.hash)
    if key not in _LOADS:
        _LOADS[key] = (f, cm.routed_loads(f, size, pl, batch=batch))
    return _LOADS[key][1]


def decode_counts(
    f: cm.Facts,
    mode: str,
    backend: str,
    context: int,
    batch: int,
    form: str = "placeholder",
    size: int = 2,
    pl=None,
) -> dict:
    """Bytes, matmul and attention FLOPs, comm seconds of one decode step (the busiest
    rank of ``size``; ``pl``: the experts' placement, None: equal ranges)."""
    key = (id(f), mode, backend, context, batch, form, size, None if pl is None else pl.hash)
    if key in _COUNTS:
        return _COUNTS[key][1]
    hw = cm.Hardware()
    loads = _loads(f, batch, size, pl)
    step = cm.bytes_per_token(mode, f, size, hw, form, loads, context, batch)
    base = cm.bytes_per_token(mode, f, size, hw, form, loads, 1, batch)
    if mode == "pp":  # stages run one after the other: a rank's share is the sum
        nbytes = sum(s["bytes"] for s in step["stages"]) + step["bytes"]["lm_head"]
    else:
        nbytes = step["bytes_critical_path"]
    out = {
        "bytes": float(nbytes),
        "flops_mm": float(base["flops"]),
        "flops_attn": float(step["flops"] - base["flops"]),
        "comm_s": _comm(step["collectives"], backend),
        "sync_s": float(step["time_s"]["sync"]),  # local form: a host sync per MoE layer
        "n_collectives": step["n_collectives"],
    }
    _COUNTS[key] = (f, out)  # f kept alive: its id stays its own
    return out


def prefill_counts(
    f: cm.Facts,
    mode: str,
    backend: str,
    prompt: int,
    chunk: int,
    form: str = "placeholder",
    size: int = 2,
) -> list[dict]:
    """Per chunk: bytes, matmul FLOPs, MLA FLOPs, comm seconds (one rank). PP: the
    whole model on one rank per chunk (the stages run one after the other; mlx-lm's
    pipeline has no micro-batches) and one hand-off."""
    key = (id(f), "prefill", mode, backend, prompt, chunk, form, size)
    if key in _COUNTS:
        return _COUNTS[key][1]
    hw = cm.with_backend(cm.Hardware(), "jaccl" if backend.startswith("jaccl") else "ring")
    out, pos = [], 0
    while pos < prompt:
        c = min(chunk, prompt - pos)
        if mode == "pp":
            st = cm.prefill_chunk(f, "tp", 1, hw, c, pos, form)
            comm = _comm(
                [{"count": 1, "wire_bytes": cm.ACT_BYTES * f.tc["hidden_size"] * c}], backend
            )
        else:
            st = cm.prefill_chunk(f, mode, size, hw, c, pos, form)
            comm = _comm(cm.collectives(f, mode, size, hw, c), backend)
        out.append(
            {
                "bytes": float(st["bytes"]),
                "flops_mm": float(st["flops"] - st["attention_flops"]),
                "flops_attn": float(st["attention_flops"]),
                "comm_s": comm,
                "sync_s": float(st["time_s"]["sync"]),
                "tokens": c,
            }
        )
        pos += c
    _COUNTS[key] = (f, out)
    return out


# ---------------------------------------------------------------- model


def decode_terms(c: dict, th: dict, stack: str) -> dict:
    """Seconds of each term of one decode step."""
    mem = c["bytes"] / (BW * th["eta"])
    mm = c["flops_mm"] / (PEAK * th["phi_mm"])
    return {
        "overhead": th[f"O:{stack}"],
        "memory": mem if mem >= mm else 0.0,
        "matmul_flops": mm if mm > mem else 0.0,
        "attention": c["flops_attn"] / (PEAK * th["phi_attn"]),
        "collectives": c["comm_s"],
        "sync": c.get("sync_s", 0.0),
    }


def prefill_terms(chunks: list[dict], th: dict, stack: str) -> dict:
    out = dict.fromkeys(
        ("overhead", "memory", "matmul_flops", "attention", "collectives", "sync"), 0.0
    )
    for c in chunks:
        mem = c["bytes"] / (BW * th["eta"])
        mm = c["flops_mm"] / (PEAK * th["phi_mm"])
        out["overhead"] += th[f"Op:{stack}"]
        out["memory" if mem >= mm else "matmul_flops"] += max(mem, mm)
        out["attention"] += c["flops_attn"] / (PEAK * th["phi_mla"])
        out["collectives"] += c["comm_s"]
        out["sync"] += c.get("sync_s", 0.0)
    return out


class Counts:
    """Counts per anchor, computed once (the fit re-evaluates only the formula)."""

    def __init__(self, config: dict, anchors: tuple[Anchor, ...] = ANCHORS):
        facts = {p: cm.facts(config, _profile(p)) for p in {a.profile for a in anchors}}
        self.anchors = anchors
        self.counts = []
        for a in anchors:
            f = facts[a.profile]
            if a.kind == "decode":
                self.counts.append(decode_counts(f, a.mode, a.backend, a.context, a.batch))
            else:
                self.counts.append(prefill_counts(f, a.mode, a.backend, a.context, a.chunk))

    def predict(self, th: dict, i: int) -> float:
        """Predicted tok/s of anchor ``i``."""
        a, c = self.anchors[i], self.counts[i]
        if a.kind == "decode":
            return a.batch / sum(decode_terms(c, th, a.stack).values())
        return a.context / sum(prefill_terms(c, th, a.stack).values())


def _lm(fun, z0: np.ndarray, iters: int = 200) -> np.ndarray:
    """Levenberg-Marquardt on ``fun(z) -> residuals`` (numeric Jacobian)."""
    z, lam = z0.copy(), 1e-2
    r = fun(z)
    for _ in range(iters):
        J = np.empty((len(r), len(z)))
        for j in range(len(z)):
            dz = np.zeros_like(z)
            dz[j] = 1e-6
            J[:, j] = (fun(z + dz) - r) / 1e-6
        A, g = J.T @ J, J.T @ r
        step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -g)
        r2 = fun(z + step)
        if r2 @ r2 < r @ r:
            z, r, lam = z + step, r2, lam / 3
            if np.abs(step).max() < 1e-9:
                break
        else:
            lam *= 4
            if lam > 1e12:
                break
    return z


BOUNDS = {
    "eta": (0.05, 1.0),
    "phi_mm": (0.02, 1.0),
    "phi_attn": (0.01, 1.0),
    "phi_mla": (0.01, 1.0),
}
START = {"eta": 0.6, "phi_mm": 0.4, "phi_attn": 0.3, "phi_mla": 0.3}


def fit(counts: Counts, use: list[int] | None = None) -> dict:
    """Fitted terms (dict) over the anchors ``use`` (default all): least relative
    squares, efficiencies kept in their bounds, overheads >= 0."""
    use = list(range(len(counts.anchors))) if use is None else use
    names = params_of([counts.anchors[i] for i in use])

    def th_of(z: np.ndarray) -> dict:
        th = {}
        for n, v in zip(names, np.clip(z, -30, 30), strict=True):
            if n in BOUNDS:
                lo, hi = BOUNDS[n]
                th[n] = lo + (hi - lo) / (1 + math.exp(-v))
            else:
                th[n] = math.exp(v)
        return th

    def res(z: np.ndarray) -> np.ndarray:
        th = th_of(z)
        # log ratios: symmetric (a relative residual is bounded below by -1 only)
        return np.array([math.log(counts.predict(th, i) / counts.anchors[i].value) for i in use])

    z0 = []
    for n in names:
        if n in BOUNDS:
            lo, hi = BOUNDS[n]
            p = (START[n] - lo) / (hi - lo)
            z0.append(math.log(p / (1 - p)))
        else:
            z0.append(math.log(0.05 if n.startswith("O:") else 0.2))
    return th_of(_lm(res, np.array(z0)))


def report(config: dict) -> dict:
    """The fit over every anchor, residual per point, and each point left out."""
    counts = Counts(config)
    th = fit(counts)
    rows = []
    for i, a in enumerate(counts.anchors):
        pred = counts.predict(th, i)
        rest = [j for j in range(len(counts.anchors)) if j != i]
        names_rest = params_of([counts.anchors[j] for j in rest])
        key = f"{'O' if a.kind == 'decode' else 'Op'}:{a.stack}"
        if key not in names_rest:  # its stack's overhead rests on this point alone
            loo = None
        else:
            th_i = fit(counts, rest)
            loo = counts.predict(th_i, i)
        c = counts.counts[i]
        terms = (
            decode_terms(c, th, a.stack) if a.kind == "decode" else prefill_terms(c, th, a.stack)
        )
        rows.append(
            {
                "anchor": a.name,
                "kind": a.kind,
                "stack": a.stack,
                "mode": a.mode,
                "backend": a.backend,
                "build": a.profile,
                "context": a.context,
                "batch": a.batch,
                "published_tok_s": a.value,
                "model_tok_s": round(pred, 3),
                "residual": round(pred / a.value - 1, 4),
                "loo_tok_s": None if loo is None else round(loo, 3),
                "loo_error": None if loo is None else round(loo / a.value - 1, 4),
                "terms_s": {k: round(v, 5) for k, v in terms.items()},
                "dominant": max(terms, key=terms.get),
                "source": a.source,
            }
        )
    return {"terms": {k: round(v, 6) for k, v in th.items()}, "anchors": rows}


def step_form(form: str, tokens: int) -> str:
    """The form a step of ``tokens`` tokens runs in (``k3dist.model.forms.form_for``:
    ``phased`` is the placeholder form for decode steps, local for prefill chunks)."""
    return form_for(form, tokens)


def with_terms(th: dict, stack: str) -> dict:
    """The fitted terms with ``stack``'s overheads as the projected software's."""
    out = {k: v for k, v in th.items() if ":" not in k}
    out["O:proj"] = th[f"O:{stack}"]
    out["Op:proj"] = th.get(f"Op:{stack}", th.get("Op:ep4", 0.0))
    return out


def project_decode(
    f: cm.Facts,
    mode: str,
    backend: str,
    context: int,
    batch: int,
    th: dict,
    form: str = "placeholder",
    size: int = 2,
    pl=None,
) -> dict:
    c = decode_counts(f, mode, backend, context, batch, step_form(form, batch), size=size, pl=pl)
    terms = decode_terms(c, th, "proj")
    t = sum(terms.values())
    return {
        "tok_s": round(batch / t, 2),
        "tok_s_per_request": round(1 / t, 2),
        "step_ms": round(1e3 * t, 1),
        "terms_ms": {k: round(1e3 * v, 1) for k, v in terms.items()},
        "dominant": max(terms, key=terms.get),
        "n_collectives": c["n_collectives"],
    }


def project_prefill(
    f: cm.Facts,
    mode: str,
    backend: str,
    prompt: int,
    chunk: int,
    th: dict,
    form: str = "placeholder",
    size: int = 2,
    pl=None,
) -> dict:
    chunks = prefill_counts(f, mode, backend, prompt, chunk, step_form(form, chunk), size=size)
    terms = prefill_terms(chunks, th, "proj")
    first = decode_counts(f, mode, backend, prompt, 1, step_form(form, 1), size=size, pl=pl)
    t = sum(terms.values())
    first_s = sum(decode_terms(first, th, "proj").values())
    return {
        "prefill_tok_s": round(prompt / t, 1),
        "ttft_s": round(t + first_s, 2),
        "terms_s": {k: round(v, 2) for k, v in terms.items()},
        "dominant": max(terms, key=terms.get),
        "chunks": len(chunks),
    }
