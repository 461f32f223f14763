"""Peak RSS of one backward of a quantized MoE expert bank: plain ``mx.grad`` (a dense
(E, out, in) gradient) vs ``k3dist.pipeline.expert_grad.bank_grads`` (one chunk of experts
at a time).

    python benchmarks/memory/expert_grad_memory.py [--experts 128 512] [--chunks 16 64] \\
        [--out R.json]

Each case runs in its own child process: the bank (built a few experts at a time, so
building it never holds a dense stack) and the routes are evaluated, the RSS there is
recorded and the kernel's high-water mark (Linux VmHWM) reset, then one backward runs
(after a warm-up on a 2-expert copy: first-use costs are not the backward's). Reported:
VmHWM minus the RSS after imports (like convert_memory.py) and minus the RSS just before
the backward (the backward's own extra). Also the bound the measured factors give for
one real K3 MoE layer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from k3dist.bench import record

_CHILD = r"""
import json, sys, time

from k3dist.pipeline.rss import peak_rss, rss

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.kimi_k3 import SiTU
from mlx_lm.models.switch_layers import SwitchGLU
from k3dist.pipeline import expert_grad
from k3dist.format.layout import MLP_PROJS
base = rss()

D, H, E, K, T, BITS, GS, method, chunk = json.loads(sys.argv[1])
mx.random.seed(0)
bank = SwitchGLU(D, H, 1, activation=SiTU())
nn.quantize(bank, group_size=GS, bits=BITS)
for name, (o, i) in {"gate_proj": (H, D), "up_proj": (H, D), "down_proj": (D, H)}.items():
    parts = []
    for e0 in range(0, E, 8):
        w = mx.random.normal((min(8, E - e0), o, i)) * i ** -0.5
        parts.append(mx.quantize(w, GS, BITS))
        mx.eval(parts[-1])
    mod = getattr(bank, name)
    mod.weight, mod.scales, mod.biases = (mx.concatenate([p[j] for p in parts]) for j in range(3))
    del parts, w
mx.eval(bank.parameters())
x = mx.random.normal((T, D))
ids = mx.argsort(mx.random.uniform(shape=(T, E)), axis=-1)[:, :K].astype(mx.uint32)
weff = mx.random.uniform(shape=(T, K))
g = mx.random.normal((T, D))
mx.eval(x, ids, weff, g)
fn = expert_grad.plain_grads if method == "plain" else expert_grad.bank_grads
# warm-up on a 2-expert copy: first-use costs (code pages, compiled SiTU) are not the
# backward's
small = SwitchGLU(D, H, 1, activation=SiTU())
nn.quantize(small, group_size=GS, bits=BITS)
for name in MLP_PROJS:
    big, mod = getattr(bank, name), getattr(small, name)
    mod.weight, mod.scales, mod.biases = (big[t][:2] for t in ("weight", "scales", "biases"))
mx.eval(fn(small, x, ids % 2, weff, g, chunk=1))
del small
setup_hwm = peak_rss()
mx.clear_cache()
before = rss()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM: what follows is the backward alone
    reset = True
except OSError:
    reset = False
t = time.perf_counter()
grads = fn(bank, x, ids, weff, g, chunk=chunk)
mx.eval(grads)
secs = time.perf_counter() - t
peak = peak_rss()
print(json.dumps({"baseline_rss": base, "rss_before_backward": before, "setup_hwm": setup_hwm,
                  "hwm_reset": reset, "peak_rss": peak, "seconds": round(secs, 2),
                  "grad_bytes": sum(v.nbytes for v in grads.values())}))
"""

MB = 1024 * 1024


def projections(d: int, h: int) -> list[tuple[int, int]]:
    """(out, in) of gate_proj, up_proj, down_proj of a SwitchGLU(d -> h -> d)."""
    return [(h, d), (h, d), (d, h)]


def dense_bytes(experts: int, d: int, h: int) -> int:
    """The largest projection's dense float32 (E, out, in) gradient."""
    return max(experts * o * i * 4 for o, i in projections(d, h))


def grad_bytes(experts: int, d: int, h: int, group: int) -> int:
    """The result itself: float32 scales + biases of the three projections."""
    return sum(2 * experts * o * (i // group) * 4 for o, i in projections(d, h))


def measure(case: dict) -> dict:
    args = [case[k] for k in ("D", "H", "E", "K", "T", "bits", "group", "method", "chunk")]
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True, check=True
    )
    m = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        **case,
        **m,
        "peak_over_baseline": m["peak_rss"] - m["baseline_rss"],
        "backward_extra": m["peak_rss"] - m["rss_before_backward"],
    }


def run(case: dict) -> dict:
    """One measured case, with its dense size and MB figures, logged to stderr."""
    row = measure(case)
    row["dense_fp32_grad_MB"] = round(
        dense_bytes(case["chunk"] or case["E"], case["D"], case["H"]) / MB, 1
    )
    row["backward_extra_MB"] = round(row["backward_extra"] / MB, 1)
    row["peak_over_baseline_MB"] = round(row["peak_over_baseline"] / MB, 1)
    print(
        json.dumps(
            {
                k: row[k]
                for k in (
                    "E",
                    "D",
                    "H",
                    "T",
                    "method",
                    "chunk",
                    "backward_extra_MB",
                    "peak_over_baseline_MB",
                    "seconds",
                )
            }
        ),
        file=sys.stderr,
    )
    return row


def k3_bound(f_plain: float, f_chunk: float, chunks: list[int]) -> dict:
    """One real K3 MoE layer's lo bank (E=896, latent 3584 -> moe intermediate 3072),
    2-bit g64: the plain backward vs the chunked one at the measured factor."""
    e, d, h, gs = 896, 3584, 3072, 64
    dense = dense_bytes(e, d, h)
    out = grad_bytes(e, d, h, gs)
    res = {
        "experts": e,
        "latent": d,
        "moe_intermediate": h,
        "bits": 2,
        "group": gs,
        "dense_fp32_grad_one_projection_GB": round(dense / 1e9, 1),
        "plain_backward_extra_GB": round(f_plain * dense / 1e9, 1),
        "grad_output_GB": round(out / 1e9, 2),
    }
    for c in chunks:
        res[f"chunk{c}_backward_extra_GB"] = round(
            (f_chunk * dense_bytes(c, d, h) + 2 * out) / 1e9, 2
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--dim", type=int, default=512, help="D, the (latent) MoE input")
    ap.add_argument("--hidden", type=int, default=512, help="moe intermediate (out)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="skip the checks (one real-K3-shape chunk, a routes sweep)",
    )
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    base = {
        "D": args.dim,
        "H": args.hidden,
        "K": args.k,
        "T": args.tokens,
        "bits": args.bits,
        "group": args.group,
    }
    rows = [
        run(base | {"E": e, "method": m, "chunk": c})
        for e in args.experts
        for m, c in [("plain", 0), *(("chunked", c) for c in args.chunks)]
    ]
    checks: list[dict] = []
    if not args.quick:
        # one real K3 projection shape (latent 3584 -> 3072), 8 experts: is f the same?
        k3 = base | {"D": 3584, "H": 3072, "T": 64, "E": 8}
        checks += [
            run(k3 | {"method": "plain", "chunk": 0}) | {"check": "k3_shape"},
            run(k3 | {"method": "chunked", "chunk": 4}) | {"check": "k3_shape"},
        ]
        # routes per chunk: the activations' share (E=128, chunk 16: T*k/8 routes a chunk)
        checks += [
            run(base | {"E": 128, "method": "chunked", "chunk": 16, "T": t}) | {"check": "routes"}
            for t in (64, 1024, 4096)
        ]
    fitted = rows + [r for r in checks if r["check"] == "k3_shape"]
    # transient per dense (out, in) float32 gradient of one projection, per expert held
    plain = [r for r in fitted if r["method"] == "plain"]
    f_plain = max(r["backward_extra"] / dense_bytes(r["E"], r["D"], r["H"]) for r in plain)
    f_chunk = max(
        (r["backward_extra"] - 2 * grad_bytes(r["E"], r["D"], r["H"], r["group"]))
        / dense_bytes(r["chunk"], r["D"], r["H"])
        for r in fitted
        if r["method"] == "chunked"
    )
    report = {
        **record.environment(),
        "what": "peak RSS of one backward of a quantized SwitchGLU expert bank w.r.t. its "
        "affine scales/biases: plain mx.grad vs bank_grads (chunks of experts)",
        "rows": rows,
        "checks": checks,
        "formula": {
            "dense": "E * out * in * 4 B: one projection's dense float32 weight gradient "
            "(gate/up/down all have out * in = D * H)",
            "plain_backward_extra": "f_plain * E * out * in * 4 B",
            "chunked_backward_extra": "f_chunk * chunk * out * in * 4 B + 2 * G, G = the "
            "gradient returned (float32 scales + biases of the 3 "
            "projections, 6 * E * out * (in / group) * 4 B); 2 G "
            "bounds the chunks held plus one key concatenated",
            "f_plain": round(f_plain, 2),
            "f_chunk": round(f_chunk, 2),
            "f_note": "max over rows and the k3_shape checks (T <= 256); ~2 per "
            "projection (dense gradient + dequantized weights) x 3 projections "
            "in one backward, plus the "
            "activations and allocator slack, which weigh more at small chunks",
            "routes_term": "plus the chunk's activations, ~n * (D + H) * 4 B * a small "
            "factor, n = routes into the chunk (checks: T sweep); "
            "negligible next to the dense term at K3 shapes",
        },
        "real_k3_layer": k3_bound(f_plain, f_chunk, args.chunks),
    }
    record.emit(report, args.out)


if __name__ == "__main__":
    main()
