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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("key_file")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    key = open(args.key_file).read().strip()
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
    an = anthropic.Anthropic(
        base_url=args.base, api_key=key, timeout=args.timeout_s, max_retries=0
    )
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
