"""Does a mini end its message on an agent's real request (issue 41)? Claude Code's
default-mode request and Codex ``exec``'s (captured from the clients, unmodified, by a
capture server on loopback: ``agent_clients.capture``), translated as the server
translates them (``anthropic_api.to_chat``, ``responses_api.to_chat``), rendered by the
model's chat template, then greedy generation in one process (mlx-lm's ``generate_step``
on the converted build) up to ``--max-tokens``: the tokens until the stop token, or none.

    nice -n 10 python benchmarks/agents/chat_stop.py --model data/mini-k3-chat \\
        --out benchmarks/results/DATE/chat-stop.json

Minutes of CPU: each request is 12-17K tokens of prefill.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_clients.py
from k3dist.pipeline import convert  # noqa: E402
from k3dist.serve import anthropic_api, responses_api  # noqa: E402

import mlx.core as mx  # noqa: E402
from agent_clients import capture, version  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.utils import load_model, load_tokenizer  # noqa: E402


def chat_of(path: str, body: dict) -> dict:
    """The chat-completion body the server makes of a captured request."""
    if path.startswith("/v1/messages"):
        return anthropic_api.to_chat(body)
    return responses_api.to_chat(body)[0]


def greedy_until_stop(model, tokenizer, prompt: list[int], max_tokens: int) -> dict:
    stop = set(tokenizer.eos_token_ids)
    out: list[int] = []
    t0 = time.perf_counter()
    first = None
    for token, _ in generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=lambda logits: mx.argmax(logits, axis=-1),
        prefill_step_size=256,
    ):
        first = first or time.perf_counter() - t0
        out.append(int(token))
        if out[-1] in stop:
            break
    return {
        "prompt_tokens": len(prompt),
        "generated_tokens": len(out),
        "ended": bool(out) and out[-1] in stop,
        "text": tokenizer.decode(out),
        "prefill_s": round(first or 0.0, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a mini's source folder")
    ap.add_argument("--clients", default="claude,codex")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="chat-stop-"))
    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "model": str(a.model),
        "max_tokens": a.max_tokens,
        "requests": {},
    }
    build = convert.convert(a.model, tmp / "build", progress=False)
    model, _ = load_model(build)
    tokenizer = load_tokenizer(build)
    for name in a.clients.split(","):
        path, body = capture(name, tmp / name)
        chat = chat_of(path, body)
        kwargs = dict(chat.get("chat_template_kwargs") or {})
        prompt = tokenizer.apply_chat_template(
            chat["messages"], tools=chat.get("tools"), add_generation_prompt=True, **kwargs
        )
        got = greedy_until_stop(model, tokenizer, prompt, a.max_tokens)
        report["requests"][name] = {"client": version(name), "path": path, **got}
        print(name, json.dumps(got), flush=True)
    report["loadavg_end"] = os.getloadavg()
    text = json.dumps(report, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
