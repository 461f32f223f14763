"""The chat stage (issue 41): fine-tune a trained mini-K3 so that it ends its messages.

Starts from an exported mini (``--src``, default the shipped ``k3dist/data/mini-k3``):
its weights through ``minimodel.init_from_source``, the routed experts frozen to MXFP4
again (``freeze_experts_mxfp4``: the values the source holds), everything else trained
with AdamW on ``k3dist.factory.chat`` chats, the loss on the answers only (a short
answer, the closing tags and the stop token ``<|end_of_msg|>``); warm-up then cosine, a
fixed number of steps, batches a pure function of (seed, step). Then the Moonshot source
format (``export_source``) with ``training.json`` (this run's arguments, losses and check),
and the check: greedy generation on held-out chats (the corpus's ``eval`` split), how many
end with the stop token within ``--check-tokens``.

    python -m k3dist.factory.chat_train --out data/mini-k3-chat --steps 40
    python train/train.py chat --out data/mini-k3-chat --steps 40   # the same
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from k3dist import MINI_K3, blas_status
from k3dist.factory.chat import ChatData, render
from k3dist.factory.export import export_source, round_to_source
from k3dist.factory.minimodel import (
    build_model,
    describe,
    freeze_experts_mxfp4,
    init_from_source,
    reset_caches,
)
from k3dist.factory.train import TrainArgs, lr_at, make_optimizer
from k3dist.format import tokens
from k3dist.format.folder import load_config

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.generate import generate_step


@dataclass
class ChatArgs:
    src: str = str(MINI_K3)
    steps: int = 80
    seq: int = 384
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 8
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    check_chats: int = 8
    check_tokens: int = 48


def load_chat_tokenizer(src: Path, work: Path):
    """mlx-lm's tokenizer of a source folder: the fast tokenizer and chat template the
    converted build (and so the server) gets (``tokens.write_hf_tokenizer``)."""
    from mlx_lm.utils import load_tokenizer

    tokens.write_hf_tokenizer(src, work)
    eos = load_config(src).get("eos_token_id")
    return load_tokenizer(work, eos_token_ids=[eos] if isinstance(eos, int) else eos)


def load_model(src: Path, seed: int):
    """The float model of ``src`` with its experts frozen as MXFP4: (model, config)."""
    config = load_config(src)
    model = build_model(config, seed)
    init_from_source(model, config, src)
    freeze_experts_mxfp4(model)
    return model, config


def _loss(model: nn.Module, x: mx.array, y: mx.array, m: mx.array) -> mx.array:
    ce = nn.losses.cross_entropy(model(x), y, reduction="none")
    return (ce * m).sum() / mx.maximum(m.sum(), 1.0)


def greedy(model: nn.Module, prompt: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    """Greedy tokens after ``prompt`` (mlx-lm's ``generate_step``), up to a stop token."""
    model.eval()
    reset_caches(model)
    out = []
    for token, _ in generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=lambda logits: mx.argmax(logits, axis=-1),
        prefill_step_size=512,
    ):
        out.append(int(token))
        if out[-1] in stop:
            break
    reset_caches(model)
    return out


def check(model: nn.Module, tokenizer, data: ChatData, n: int, max_tokens: int) -> dict:
    """Greedy on ``n`` chats of ``data``: how many end with the stop token within
    ``max_tokens``, and the tokens each took."""
    stop = set(tokenizer.eos_token_ids)
    lengths, ended, samples = [], 0, []
    for i in range(n):
        prompt = render(tokenizer, data.chat(1, i), prompt_only=True)
        out = greedy(model, prompt, max_tokens, stop)
        lengths.append(len(out))
        ended += bool(out) and out[-1] in stop
        if len(samples) < 4:
            samples.append({"prompt_tokens": len(prompt), "text": tokenizer.decode(out)})
    return {
        "chats": n,
        "ended": ended,
        "max_tokens": max_tokens,
        "tokens": lengths,
        "samples": samples,
    }


def _shown(path: Path) -> str:
    """``path`` as recorded: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def train(
    a: ChatArgs, out: Path, max_minutes: float | None = None, log=print, command: str = ""
) -> dict:
    """The chat stage from ``a.src`` into the source folder ``out``; returns what
    ``training.json`` records."""
    src = Path(a.src)
    work = Path(tempfile.mkdtemp(prefix="chat-tokenizer-"))
    try:
        tokenizer = load_chat_tokenizer(src, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    pad = tokenizer.convert_tokens_to_ids(tokens.PAD)
    data, held = ChatData(tokenizer, "train"), ChatData(tokenizer, "eval")
    model, config = load_model(src, a.seed)
    before = check(model, tokenizer, held, min(a.check_chats, 2), a.check_tokens)
    log(f"before: {before['ended']} of {before['chats']} held-out chats end")
    model.train()
    t_args = TrainArgs(lr=a.lr, weight_decay=a.weight_decay, grad_clip=a.grad_clip)
    optimizer = make_optimizer(t_args)
    grad_fn = nn.value_and_grad(model, _loss)
    losses, t0, steps = [], time.perf_counter(), 0
    for step in range(a.steps):
        if max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes:
            log(f"stopped by the time budget at step {step}")
            break
        rate = lr_at(step, a.steps, a.lr, a.warmup, a.min_lr_ratio)
        for o in optimizer.optimizers:
            o.learning_rate = rate
        x, y, m = (mx.array(v) for v in data.batch(a.seed, step, a.batch, a.seq, pad))
        loss, grads = grad_fn(model, x, y, m)
        grads, _ = optim.clip_grad_norm(grads, a.grad_clip)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        losses.append(round(loss.item(), 4))
        steps = step + 1
        log(f"step {steps} loss {losses[-1]:.4f} lr {rate:.2e} {time.perf_counter() - t0:.0f} s")
    seconds = time.perf_counter() - t0
    model.eval()
    round_to_source(model, config)
    after = check(model, tokenizer, held, a.check_chats, a.check_tokens)
    log(f"after: {after['ended']} of {after['chats']} held-out chats end {after['tokens']}")
    record = {
        "stage": "chat (k3dist.factory.chat_train)",
        "command": command,
        "from": _shown(src),
        "from_training": json.loads((src / "training.json").read_text())
        if (src / "training.json").exists()
        else None,
        "args": {**asdict(a), "src": _shown(src)},
        "steps": steps,
        "seconds": round(seconds, 1),
        "losses": losses,
        "blas": blas_status().get("loaded") or "reference",
        "check_before": before,
        "check_after": after,
        "params": describe(config),
    }
    export_source(model, config, out, src, a.seed, provenance=record)
    return record


def main(argv: list[str] | None = None, prog: str = "python -m k3dist.factory.chat_train") -> None:
    ap = argparse.ArgumentParser(description="The chat stage: a mini-K3 that ends its messages.")
    ap.add_argument("--out", type=Path, required=True, help="the source folder to write")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop the steps early")
    d = ChatArgs()
    for key, value in asdict(d).items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
    a = ap.parse_args(argv)
    args = ChatArgs(**{k: getattr(a, k) for k in asdict(d)})
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
    record = train(args, a.out, a.max_minutes, lambda s: print(s, flush=True), command)
    print(f"wrote {a.out}: {record['check_after']['ended']} of {args.check_chats} end")


if __name__ == "__main__":
    main(sys.argv[1:])
