"""Several greedy parity runs in one mlx.launch start-up, each as launch/generate.py runs
one (the same calls: ``loader.load_deployed``, ``greedy.greedy``, ``introspect``).

    mlx.launch -n 2 --python .venv/bin/python tests/scripts/parity_runs.py RUNS.json

RUNS.json is a list of runs: ``rank_dir`` (with ``{rank}``), ``moe_form`` and
``attention`` (optional: the deployment's defaults, as generate.py's without the flags),
``boxes`` (optional: the folders must be placed by memory for these boxes),
``blas_threads`` (optional: OpenBLAS threads per rank, as the deployment key),
``prompt`` (token ids), ``max_tokens``, ``dump`` (an .npz path with ``{rank}``). For each
run every rank loads its own folder, runs prefill and the greedy steps, saves its tokens
and logits, and prints one JSON line: ``run`` (its index), ``rank``, the collectives per
decode token and bytes held, the attention split. A run that fails ends the launch (the
test then sees the failed rank), so no run's result can be taken from another's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import k3dist
from k3dist.bench import greedy
from k3dist.config import deployment
from k3dist.model.group import join, report
from k3dist.serve import introspect, loader

import mlx.core as mx
import numpy as np


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    group = join()
    rank = group.rank()
    base = deployment.DEFAULT_DEPLOYMENT if deployment.DEFAULT_DEPLOYMENT.exists() else None
    for i, run in enumerate(runs):
        dep = deployment.load_deployment(
            base,
            rank_dir=run["rank_dir"],
            moe_form=run.get("moe_form"),
            attention=run.get("attention"),
            boxes=run.get("boxes"),
            blas_threads=run.get("blas_threads"),
            size=group.size(),
        )
        if dep.blas_threads:  # as launch/generate.py does
            k3dist.set_blas_threads(dep.blas_threads)
        model, _, manifest = loader.load_deployed(dep, group)
        tokens, logits = greedy.greedy(model, run["prompt"], run["max_tokens"])
        path = Path(run["dump"].format(rank=rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=np.array(tokens), logits=logits, prompt=np.array(run["prompt"]))
        report(
            {
                "run": i,
                "rank": rank,
                "size": group.size(),
                "collectives_per_token": introspect.collectives_per_token(model),
                "bytes_held": introspect.bytes_held(model),
                "attention": manifest.get("attention"),
                "moe_form": loader.resolve_form(dep.moe_form),
                "tokens": tokens,
            }
        )
        del model
        mx.clear_cache()


if __name__ == "__main__":
    sys.exit(main())
