"""Prefill, EP-split vs mlx-lm's TP, side by side: one prompt prefilled in chunks of each
size, in interleaved rounds, the same build and ranks (as ep_vs_tp_pp.py does for decode).

    mlx.launch -n 2 --python .venv/bin/python benchmarks/speed/prefill_ep_vs_tp.py \\
        [--preset bench] [--prompt-len 256] [--chunks 64 128 256] [--rounds 2] \\
        --out benchmarks/results/DATE/prefill-compare.json

Each mode fills a fresh cache chunk by chunk (``model(chunk, cache)``, then the caches
evaluated, as mlx-lm's prefill does) and the seconds of the whole prompt are recorded per
chunk size; EP-split is k3dist's model on its rank folder (attention split, the CPU's
local form), TP is ``kimi_k3.Model.shard`` (``sharded_load``). Rank 0 prints the JSON.
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
from k3dist.bench import baselines, builds, collectives, record, stepping
from k3dist.format import layout, placement
from k3dist.model.group import join
from k3dist.serve import loader

import mlx.core as mx
from mlx_lm.utils import load_config


def chunked_prefill(model, prompt: list[int], chunk: int) -> float:
    cache = model.make_cache()
    t = time.perf_counter()
    for i in range(0, len(prompt), chunk):
        model(mx.array([prompt[i : i + chunk]]), cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--cache-dir", default="runs")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    k3dist.set_blas_threads(1)
    group = join()
    if group.size() < 2:
        raise SystemExit("run under mlx.launch -n 2")
    rank = group.rank()
    build = builds.ensure_preset_build(a.preset, a.cache_dir)
    tc = layout.text_config(load_config(build))
    prompt = stepping.random_prompt(tc["vocab_size"], a.prompt_len, 0)
    models = {}
    with tempfile.TemporaryDirectory(prefix="k3dist-prefill-") as td:
        plc = placement.contiguous(tc["num_experts"], group.size(), layout.moe_layers(tc))
        folder = builds.slice_for_rank(build, td, group, plc, "split")
        models["ep_split"], _, _ = loader.load_rank(folder, group, "float32", "auto")
    models["tp"], _ = baselines.load_tensor_parallel(build, group, "float32")
    env = record.environment()
    for m in models.values():  # every chunk shape once, before timing
        for c in a.chunks:
            chunked_prefill(m, prompt[:c], c)
    times: dict[str, dict[int, list[float]]] = {n: {c: [] for c in a.chunks} for n in models}
    for r in range(a.rounds):
        for n in list(models) if r % 2 == 0 else list(models)[::-1]:
            for c in a.chunks:
                collectives.barrier(group)
                times[n][c].append(chunked_prefill(models[n], prompt, c))
    if rank != 0:
        return
    res = {
        n: {
            str(c): {
                "median_s": round(statistics.median(v), 3),
                "tok_s": round(a.prompt_len / statistics.median(v), 2),
                "rounds_s": [round(x, 3) for x in v],
            }
            for c, v in per.items()
        }
        for n, per in times.items()
    }
    report = {
        **env,
        "build": str(build),
        "prompt_len": a.prompt_len,
        "chunks": a.chunks,
        "moe_form": loader.resolve_form("auto"),
        "results": res,
        "ep_split_over_tp_time": {
            str(c): round(res["ep_split"][str(c)]["median_s"] / res["tp"][str(c)]["median_s"], 3)
            for c in a.chunks
        },
        "load_after": os.getloadavg(),
    }
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
