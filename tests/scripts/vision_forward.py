"""One rank of an EP forward with images (tests/serve/test_vision.py runs it under mlx.launch).

Each rank loads its folder, gives the model its image side (the tower only where the
folder holds it: rank 0), and for each image renders ``--text`` with the image,
expands and tokenizes it, and dumps the prompt ids, the full-prompt float32 logits
and a few greedy tokens through mlx-lm's generate_step with input embeddings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import k3dist  # noqa: F401  (OpenBLAS preload before mlx)
from k3dist.model.group import join
from k3dist.serve import loader, vision

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer
from PIL import Image


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank-dir", required=True)
    ap.add_argument("--images", required=True, help="comma-separated image files")
    ap.add_argument("--text", required=True, help=f"with {vision.IMAGE_PLACEHOLDER}")
    ap.add_argument("--dump", required=True, help="npz path with {rank}")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    group = join()
    rank = group.rank()
    folder = Path(args.rank_dir.format(rank=rank))
    model, config, _ = loader.load_rank(folder, group, "float32", "local")
    tok = load_tokenizer(folder)
    proc = vision.attach(model, folder, config, tok, group)
    has_tower = model.vision.tower is not None
    out = {"has_tower": np.array(has_tower)}
    for i, path in enumerate(args.images.split(",")):
        img = Image.open(path)
        text, pixels = proc(args.text, [np.asarray(img.convert("RGB"))])
        ids = vision.prompt_tokens(tok, proc, args.text, [img.convert("RGB")])
        assert ids == tok.encode(text, add_special_tokens=False)
        emb = model.embed_inputs(mx.array(ids), pixel_values=pixels)
        logits = model(mx.array(ids)[None], input_embeddings=emb[None])
        mx.eval(logits)
        tokens = []
        emb = model.embed_inputs(mx.array(ids), pixel_values=pixels)
        mx.eval(emb)
        for (t, _), _ in zip(
            generate_step(
                mx.array(ids),
                model,
                input_embeddings=emb,
                max_tokens=args.steps,
                prefill_step_size=16,
            ),
            range(args.steps),
            strict=False,
        ):
            tokens.append(int(t))
        out[f"ids{i}"] = np.array(ids)
        out[f"logits{i}"] = np.array(logits[0].astype(mx.float32))
        out[f"tokens{i}"] = np.array(tokens)
    p = Path(args.dump.format(rank=rank))
    p.parent.mkdir(parents=True, exist_ok=True)
    np.savez(p, **out)
    print(f"rank {rank}: done (tower: {has_tower})", flush=True)


if __name__ == "__main__":
    main()
