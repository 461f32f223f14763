"""Whole-model decode step of graded builds vs the single-bank build they came from,
side by side in one process (interleaved rounds, so drift cancels).

    python benchmarks/speed/graded_decode.py --build runs/quality/2bit-g32 \\
        --build runs/quality/graded-20-global-taylor --out results.json

Each build (``k3dist.model.two_bank.load_build``: one process, every expert local, the
sync-free ``placeholder`` form that Metal uses) prefills the same prompt, then decodes
one token at a time from its own cache; a round times ``--steps`` tokens of every build
in turn. Reported: median milliseconds per token over rounds, and each build's ratio to
the first (the goal of issue 12: graded <= 1.2x single bank), with each graded build's
``k_hi`` and promoted experts per MoE layer (layers without promotions run one bank).
"""

from __future__ import annotations

import argparse
import statistics
import time

from k3dist.bench import record
from k3dist.format.graded import GradedMap
from k3dist.model import two_bank

import mlx.core as mx
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, help="graded builds; first = base")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=16, help="decode tokens per round")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out")
    a = ap.parse_args()
    models = []
    for p in a.build:
        model, config = two_bank.load_build(p, "float32", "placeholder")
        models.append((p, model, GradedMap.from_config(config)))
    V = models[0][1].args.text_config.vocab_size
    prompt = mx.array(np.random.default_rng(0).integers(0, V, size=(1, a.prompt)))
    times = {p: [] for p, _, _ in models}
    for r in range(a.rounds + 1):  # round 0 warms every shape up
        for p, model, _ in models:
            cache = model.make_cache()
            y = mx.argmax(model(prompt, cache=cache)[:, -1:], axis=-1)
            mx.eval(y)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
                mx.eval(y)
            if r:
                times[p].append(1000 * (time.perf_counter() - t0) / a.steps)
    base = statistics.median(times[a.build[0]])
    rows = []
    for p, _, gmap in models:
        ms = statistics.median(times[p])
        rows.append(
            {
                "build": p,
                "ms_per_token": round(ms, 3),
                "ratio": round(ms / base, 3),
                "promoted_per_layer": {str(k): len(v) for k, v in gmap.hi.items()},
                "k_hi": {str(k): v for k, v in gmap.k_hi.items() if gmap.hi.get(k)},
            }
        )
    report = {
        "command": record.command_line(),
        "prompt": a.prompt,
        "steps": a.steps,
        "rounds": a.rounds,
        "rows": rows,
    }
    record.emit(report, a.out, indent=1)


if __name__ == "__main__":
    main()
