"""A client on one of the rig's hosts (run with ``ip netns exec k3h-macN``): the
OpenAI and Anthropic clients against the served API, one JSON line of what came back.

    python tests/scripts/rig_client.py http://10.77.0.1:22080 KEYFILE [--stream-tokens N]

Checks: /health answers without a key, a request without the key gets 401, a chat
completion and an Anthropic Messages request with it are answered. Bounded: every
request has a timeout and no retries.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def stream(base: str, key: str, max_tokens: int, timeout_s: float, prompt_words: int = 1) -> dict:
    """One streamed chat completion read as raw SSE: when each chunk came, and how the
    stream ended (``[DONE]``, an error event, or the connection gone)."""
    body = json.dumps(
        {
            "model": "kimi-k3",
            "messages": [{"role": "user", "content": " ".join(["Count."] * prompt_words)}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    print("SENT", flush=True)
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    out: dict = {"chunks": 0, "end": None, "error": None}
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["end"] = "done"
                    break
                event = json.loads(data)
                if "error" in event:
                    out["end"], out["error"] = "error event", event["error"]
                    continue
                out["chunks"] += 1
                if out["chunks"] == 1:
                    out["first_chunk_s"] = round(time.monotonic() - t0, 2)
                    print("FIRST", flush=True)
                elif out["chunks"] % 50 == 0:  # progress a caller can read while it runs
                    print(f"CHUNKS {out['chunks']} {time.monotonic() - t0:.2f}", flush=True)
    except urllib.error.HTTPError as e:
        out["end"], out["error"] = f"http {e.code}", e.read().decode(errors="replace")[:300]
    except OSError as e:
        out["end"] = out["end"] or "connection error"
        out["error"] = out["error"] or f"{type(e).__name__}: {e}"
    out["end"] = out["end"] or "closed without [DONE]"
    out["s"] = round(time.monotonic() - t0, 2)
    return out


def _post(base: str, path: str, key: str, body: dict, timeout_s: float) -> tuple[str, str]:
    """(outcome, detail): ok, http NNN, error event, or the transport error."""
    req = urllib.request.Request(
        f"{base}{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return f"http {e.code}", e.read().decode(errors="replace")[:200]
    except OSError as e:
        return "transport error", f"{type(e).__name__}: {e}"[:200]
    if body.get("stream"):
        if '"error"' in text:
            return "error event", text[-200:]
        return ("ok", "") if "[DONE]" in text else ("closed without [DONE]", text[-200:])
    return "ok", ""


def mixed(base: str, key: str, n: int, concurrency: int, timeout_s: float) -> dict:
    """``n`` requests, ``concurrency`` at a time, in turn a chat completion, an
    Anthropic Messages request and a streamed chat; every one bounded by ``timeout_s``.
    Counts each outcome: none may be missing."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[str, str, float]:
        t0 = time.monotonic()
        kind = i % 3
        text = f"Request {i}: say something."
        if kind == 1:
            body = {
                "model": "kimi-k3",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": text}],
            }
            got = _post(base, "/v1/messages", key, body, timeout_s)
        else:
            body = {
                "model": "kimi-k3",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": text}],
                "stream": kind == 2,
            }
            got = _post(base, "/v1/chat/completions", key, body, timeout_s)
        return got[0], got[1], time.monotonic() - t0

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(n)))
    outcomes: dict[str, int] = {}
    for o, _, _ in results:
        outcomes[o] = outcomes.get(o, 0) + 1
    lat = sorted(r[2] for r in results)
    return {
        "requests": n,
        "answered": len(results),
        "outcomes": outcomes,
        "errors": sorted({d for o, d, _ in results if o != "ok"})[:5],
        "p50_s": round(lat[len(lat) // 2], 2),
        "max_s": round(lat[-1], 2),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("key_file")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument(
        "--stream", type=int, default=0, help="only stream one chat of this many tokens"
    )
    ap.add_argument("--prompt-words", type=int, default=1, help="the streamed prompt's length")
    ap.add_argument(
        "--mixed", type=int, default=0, help="only N mixed requests (chat, messages, stream)"
    )
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    key = open(args.key_file).read().strip()
    if args.stream:
        got = stream(args.base, key, args.stream, args.timeout_s, args.prompt_words)
        print(json.dumps(got), flush=True)
        return 0
    if args.mixed:
        got = mixed(args.base, key, args.mixed, args.concurrency, args.timeout_s)
        print(json.dumps(got), flush=True)
        return 0
    out: dict = {}
    with urllib.request.urlopen(f"{args.base}/health", timeout=args.timeout_s) as r:
        out["health"] = r.status
    try:
        urllib.request.urlopen(f"{args.base}/v1/models", timeout=args.timeout_s)
        out["no_key"] = 200
    except urllib.error.HTTPError as e:
        out["no_key"] = e.code

    import anthropic
    import openai

    t0 = time.monotonic()
    oa = openai.OpenAI(
        base_url=f"{args.base}/v1", api_key=key, timeout=args.timeout_s, max_retries=0
    )
    chat = oa.chat.completions.create(
        model="kimi-k3",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        temperature=0.0,
    )
    out["chat"] = {
        "finish_reason": chat.choices[0].finish_reason,
        "completion_tokens": chat.usage.completion_tokens,
        "s": round(time.monotonic() - t0, 2),
    }
    t0 = time.monotonic()
    an = anthropic.Anthropic(base_url=args.base, api_key=key, timeout=args.timeout_s, max_retries=0)
    msg = an.messages.create(
        model="kimi-k3",
        max_tokens=8,
        messages=[{"role": "user", "content": "Say hi."}],
    )
    out["messages"] = {
        "stop_reason": msg.stop_reason,
        "output_tokens": msg.usage.output_tokens,
        "s": round(time.monotonic() - t0, 2),
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
