"""A running request's gaps between tokens while another request's prefix entry is
written, on the 2-rank mini (mlx.launch on loopback), against the same requests with no
write.

    python benchmarks/serving/prefix_write_gaps.py [--agents 4] [--rules 12] [--port-base 42100]
        --out benchmarks/results/DATE/prefix-write-gaps.json

Two servers, each on a fresh prefix folder, run the same requests: "write"
(``prefix_cache_min_tokens`` 256: each agent's system entry and prefill copy is saved
and written by the rank's writer thread) and "no write" (``prefix_cache_min_tokens``
above any prompt: ``save`` returns before it snapshots anything; the rest is the same).
On each, D streams completions (EOS masked, one after another) while W_1..W_n, the first
turns of n agents (each its own system prompt + tools: a cold prefill and a new entry),
are sent one after another. Each of D's gaps (between two of its tokens in one stream) is
put in one class: ``write`` (it overlaps a write on rank 0: the store's
``recent_writes``, wall-clock start and seconds, from ``GET /v1/k3dist``), ``prefill``
(it overlaps a W's prefill, no write), ``decode`` (neither). Reported: n, p50, p99 and
max of each class per server, the writes' seconds, the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from k3dist.bench import record

import numpy as np
from prefix_cache import _NEXT_PORT, Srv, _eos, system, tools


def _stats(x: list[float]) -> dict:
    a = np.array(x)
    if not len(a):
        return {"n": 0}
    return {
        "n": int(len(a)),
        "p50_s": round(float(np.percentile(a, 50)), 4),
        "p99_s": round(float(np.percentile(a, 99)), 4),
        "max_s": round(float(a.max()), 4),
    }


def run(a, min_tokens: int, tag: str, tmp: Path) -> dict:
    srv = Srv(a, tmp / f"store-{tag}", tmp, tag, ("--prefix-cache-min-tokens", str(min_tokens)))
    eos = _eos(a)
    streams: list[list[float]] = []
    stop = threading.Event()

    def decode() -> None:  # D: one stream after another until told to stop
        while not stop.is_set():
            stamps: list[float] = []
            streams.append(stamps)
            for ch in srv.client.completions.create(
                model="kimi-k3",
                prompt="def main():\n    ",
                max_tokens=256,
                temperature=0,
                stream=True,
                logit_bias={str(t): -100 for t in eos},
            ):
                if ch.choices and ch.choices[0].text is not None:
                    stamps.append(time.time())
                if stop.is_set():
                    break

    try:
        th = threading.Thread(target=decode)
        th.start()
        while sum(len(s) for s in streams) < 10:
            time.sleep(0.05)
        tl = tools(a.tools)
        prefills = []  # [sent, first token] of each W (wall clock)
        for i in range(a.agents):
            sent = time.time()
            first = None
            for ch in srv.client.chat.completions.create(
                model="kimi-k3",
                messages=[
                    {"role": "system", "content": system(f"Agent{i}", a.rules)},
                    {"role": "user", "content": "List the files."},
                ],
                tools=tl,
                max_tokens=2,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"chat_template_kwargs": {"thinking": False}},
            ):
                if first is None and ch.choices:
                    first = time.time()
                if ch.usage:
                    prompt_tokens = ch.usage.prompt_tokens
            prefills.append([sent, first or time.time()])
            time.sleep(a.settle_s)  # the writes finish; D decodes alone
        stop.set()
        th.join()
        with urllib.request.urlopen(srv.url + "/v1/k3dist", timeout=10) as r:
            pc = json.loads(r.read()).get("prefix_cache") or {}
    finally:
        srv.stop()
    writes = [(s, s + d) for s, d in pc.get("recent_writes", [])]
    classes: dict[str, list[float]] = {"write": [], "prefill": [], "decode": []}
    for stamps in streams:
        for t0, t1 in zip(stamps, stamps[1:], strict=False):
            if any(t0 < e and s < t1 for s, e in writes):
                classes["write"].append(t1 - t0)
            elif any(t0 < e and s < t1 for s, e in prefills):
                classes["prefill"].append(t1 - t0)
            else:
                classes["decode"].append(t1 - t0)
    return {
        "prefix_cache_min_tokens": min_tokens,
        "w_prompt_tokens": prompt_tokens,
        "w_prefill_s": [round(e - s, 2) for s, e in prefills],
        "writes_rank0": {
            "n": len(writes),
            "seconds": [round(e - s, 4) for s, e in writes],
            "saved": pc.get("saved"),
            "bytes": pc.get("bytes"),
        },
        "d_tokens": sum(len(s) for s in streams),
        "gaps": {k: _stats(v) for k, v in classes.items()},
        "load_after": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-dir", help="rank folders ({rank}); default: the embedded mini")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--agents", type=int, default=4, help="W requests (each a new entry)")
    ap.add_argument("--tools", type=int, default=6, help="tools in each agent's list")
    ap.add_argument("--rules", type=int, default=12, help="rules in each system prompt")
    ap.add_argument("--settle-s", type=float, default=3.0, help="pause after each W")
    ap.add_argument("--port-base", type=int, help="take every port from here up")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.port_base:
        _NEXT_PORT.append(a.port_base)
    tmp = Path(tempfile.mkdtemp(prefix="prefix-write-gaps-"))
    report = {**record.environment(), "prefill_chunk": a.prefill_chunk, "agents": a.agents}
    report["load_before"] = os.getloadavg()
    report["write"] = run(a, 256, "write", tmp)
    report["no_write"] = run(a, 10**6, "nowrite", tmp)
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
