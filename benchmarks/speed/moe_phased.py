"""The phased MoE form against the placeholder form, side by side (issue 40, item 5): the
same graded build on the same two ranks, one prompt prefilled in the shipped chunk size
and then decoded, each form in turn, in interleaved rounds.

    mlx.launch -n 2 --python .venv/bin/python benchmarks/speed/moe_phased.py \\
        --build runs/quality-grid/graded-2.6-2bit-g64-s-2bit-g64 --prompt-len 1024 \\
        --chunk 256 --decode 16 --rounds 3 \\
        --out benchmarks/results/2026-12-06/moe-phased.json

``placeholder`` is what ``moe_form: auto`` ran on Metal before (every rank computes all
``k`` routed pairs of a token, the non-owned ones on a local expert, zeroed: no host
sync); ``phased`` is what it runs now (``k3dist.model.forms``: the placeholder form for
calls under ``LOCAL_FROM_TOKENS`` tokens, decode steps; the local form, owned pairs only
after one host sync per MoE layer, for prefill chunks). Per round and form: a fresh
cache, the prompt in ``--chunk``-token chunks (seconds), then ``--decode`` greedy steps
(ms a step). Rank 0 prints and writes the JSON: medians, the phased/placeholder ratios,
the largest logit difference between the forms (they compute the same sums), the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import k3dist
from k3dist.bench import collectives, record, stepping
from k3dist.format import layout
from k3dist.format.folder import load_config
from k3dist.model.forms import LOCAL_FROM_TOKENS
from k3dist.model.group import join
from k3dist.pipeline.slicing import slice_rank
from k3dist.serve import loader

import mlx.core as mx

FORMS = ("placeholder", "phased")


def run_once(model, prompt: list[int], chunk: int, steps: int) -> tuple[float, float, mx.array]:
    """(prefill seconds, decode seconds a step, the prompt's last logits)."""
    cache = model.make_cache()
    t = time.perf_counter()
    for i in range(0, len(prompt), chunk):
        logits = model(mx.array([prompt[i : i + chunk]]), cache=cache)
        mx.eval(logits, [c.state for c in cache])
    t_prefill = time.perf_counter() - t
    last = logits[0, -1]
    tok = int(mx.argmax(last))
    t = time.perf_counter()
    for _ in range(steps):
        out = model(mx.array([[tok]]), cache=cache)
        tok = int(mx.argmax(out[0, -1]))
    t_decode = (time.perf_counter() - t) / max(steps, 1)
    return t_prefill, t_decode, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True, help="a graded (two-bank) build")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (the shipped one)")
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    load_before = os.getloadavg()
    k3dist.set_blas_threads(1)
    group = join()
    if group.size() < 2:
        raise SystemExit("run under mlx.launch -n 2")
    tc = layout.text_config(load_config(a.build))
    prompt = stepping.random_prompt(tc["vocab_size"], a.prompt_len, 0)
    with tempfile.TemporaryDirectory(prefix="k3dist-phased-") as td:
        folder = slice_rank(a.build, Path(td) / f"rank{group.rank()}", group.rank(), 2, None, False)
        models = {f: loader.load_rank(folder, group, "float32", f)[0] for f in FORMS}
    last = {}
    for f, m in models.items():  # every shape once before timing
        _, _, last[f] = run_once(m, prompt[: 2 * a.chunk], a.chunk, 2)
    times: dict[str, dict[str, list[float]]] = {f: {"prefill": [], "decode": []} for f in FORMS}
    for r in range(a.rounds):
        for f in FORMS if r % 2 == 0 else FORMS[::-1]:
            collectives.barrier(group)
            p, d, last[f] = run_once(models[f], prompt, a.chunk, a.decode)
            times[f]["prefill"].append(p)
            times[f]["decode"].append(d)
    if group.rank() != 0:
        return
    med = {f: {k: statistics.median(v) for k, v in t.items()} for f, t in times.items()}
    report = {
        **record.environment(),
        "command": "mlx.launch -n 2 python benchmarks/speed/moe_phased.py "
        + " ".join(sys.argv[1:]),
        "what": "two ranks on this CPU, side by side in interleaved rounds: measured here",
        "build": a.build,
        "prompt_len": a.prompt_len,
        "chunk": a.chunk,
        "decode_steps": a.decode,
        "local_from_tokens": LOCAL_FROM_TOKENS,
        "forms": {
            f: {
                "prefill_s": round(med[f]["prefill"], 3),
                "prefill_tok_s": round(a.prompt_len / med[f]["prefill"], 1),
                "decode_ms": round(1e3 * med[f]["decode"], 2),
                "rounds": {k: [round(x, 4) for x in v] for k, v in times[f].items()},
            }
            for f in FORMS
        },
        "phased_over_placeholder": {
            "prefill_time": round(med["phased"]["prefill"] / med["placeholder"]["prefill"], 3),
            "decode_time": round(med["phased"]["decode"] / med["placeholder"]["decode"], 3),
        },
        "max_logit_diff": float(mx.abs(last["phased"] - last["placeholder"]).max()),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
