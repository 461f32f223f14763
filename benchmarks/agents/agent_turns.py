"""Prompt reuse across turns: time to first token of turn 2 vs turn 1 of a coding-agent
conversation, on the 2-rank server (mlx.launch on loopback), both ranks agreeing.

    python benchmarks/agents/agent_turns.py [--rank-dir runs/ranks/rank{rank}] [--tokens 2000]
        --out benchmarks/results/DATE/agent-turns.json

Starts the server (warm-up on, per-rank token logs), sends a ~``--tokens``-token
conversation (system prompt + tool declarations + a long user turn) as turn 1, then the
same conversation with the model's reply and one more user turn as turn 2, streamed with
the openai client; and once more with turn 1's reply edited (only the prefix snapshot
of turn 1's prompt can serve it). Reports each turn's prompt tokens, cached tokens
(usage and each rank's token log), prefill tokens saved and time to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from k3dist.bench import record

import openai

REPO = Path(__file__).resolve().parents[2]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for name in ("read_file", "write_file", "run_tests")
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ttft(client, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    for ch in client.chat.completions.create(
        model="kimi-k3",
        messages=messages,
        tools=TOOLS,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"thinking": False}},
    ):
        if ch.choices:
            delta = ch.choices[0].delta
            piece = (delta.content or "") + ((delta.model_extra or {}).get("reasoning") or "")
            if piece and first is None:
                first = time.perf_counter() - t0
            text += delta.content or ""
        if ch.usage:
            usage = ch.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": cached,
        "prefilled_tokens": usage.prompt_tokens - cached,
        "ttft_s": round(first if first is not None else time.perf_counter() - t0, 3),
        "text": text,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-dir", help="rank folders ({rank}); default: the embedded mini")
    ap.add_argument("--tokens", type=int, default=2000, help="turn-1 prompt size, roughly")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="agent-turns-"))
    port = _port()
    cmd = [
        str(Path(sys.executable).with_name("mlx.launch")),
        "-n",
        "2",
        "-p",
        str(_port()),
        "--python",
        sys.executable,
        str(REPO / "launch/serve.py"),
        "--port",
        str(port),
        "--max-context",
        str(max(4096, 2 * a.tokens)),
        "--prefill-chunk",
        str(a.prefill_chunk),
        "--token-log",
        str(tmp / "tokens-{rank}.jsonl"),
    ]
    if a.rank_dir:
        cmd += ["--rank-dir", a.rank_dir]
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError((tmp / "server.log").read_text())
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        # measured: ~270 tokens of template and tools, ~10.3 per "line N: value M."
        lines = max(1, (a.tokens - 270) * 10 // 103)
        facts = " ".join(f"line {i}: value {i * 7 % 1000}." for i in range(lines))
        msgs = [
            {"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Here is the file:\n" + facts + "\nFix line 3."},
        ]
        turn1 = _ttft(client, msgs, a.max_tokens)
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": turn1.pop("text")},
            {"role": "user", "content": "Now run the tests."},
        ]
        turn2 = _ttft(client, msgs2, a.max_tokens)
        turn2.pop("text")
        edited = [
            *msgs,
            {"role": "assistant", "content": "I fixed line 3."},
            {"role": "user", "content": "Now run the tests."},
        ]
        turn2e = _ttft(client, edited, a.max_tokens)
        turn2e.pop("text")
        logs = []
        for r in range(2):
            p = tmp / f"tokens-{r}.jsonl"
            for _ in range(100):
                lines = p.read_text().splitlines() if p.exists() else []
                if len(lines) >= 3:
                    break
                time.sleep(0.1)
            logs.append([json.loads(x) for x in lines[-3:]])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
    cached = [[e["cached"] for e in lg] for lg in logs]
    report = {
        **record.environment(),
        "turn_1": turn1,
        "turn_2": turn2,
        "turn_2_edited_reply": turn2e,
        "prefill_tokens_saved_turn_2": turn2["cached_tokens"],
        "ttft_turn2_over_turn1": round(turn2["ttft_s"] / turn1["ttft_s"], 3),
        "ranks_cached_tokens": cached,
        "ranks_agree": cached[0] == cached[1]
        and [e["tokens"] for e in logs[0]] == [e["tokens"] for e in logs[1]],
    }
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
