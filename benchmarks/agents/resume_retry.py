"""A retry of an abandoned ~20K-token request on the 2-rank trained mini (issue 41): how
much of the prefill already done it reprocesses (the goal: at most one prefill chunk),
and whether its greedy tokens equal the same request served uninterrupted.

    nice -n 10 python benchmarks/agents/resume_retry.py [--prompt-tokens 20000] \\
        [--hang-up-at 0.6] \\
        [--max-tokens 16] --out benchmarks/results/DATE/resume-retry.json

The server is the README's (launch/run.py over mlx.launch on loopback, the embedded
trained mini, its default ``--prefill-chunk``), with ``--max-context`` large enough. A
streamed completion of a prompt cut from the interpreter's own standard library sources
(text the mini was trained on) is hung up once ``/v1/k3dist`` shows ``--hang-up-at`` of its
prefill done; the server logs where every rank stopped; the same request is then sent
again, not streamed, temperature 0. Reported: the prompt's tokens, the tokens prefilled when
the client hung up and where the ranks stopped, the retry's ``cached_tokens`` and so the
tokens of the work already done that it prefilled again, both ranks' generated tokens, and
the tokens single-process mlx-lm (no cache, one uninterrupted prefill of the whole prompt
on the unsliced build) gives the same prompt; the load average beside the times.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import re
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
from k3dist.config.deployment import Deployment  # noqa: E402

from _served import REPO, Served  # noqa: E402

STOPPED = re.compile(
    r"request (\d+): the client went away; stopped on every rank at prompt token (\d+) of (\d+)"
)
MODULES = ("typing", "inspect", "argparse", "pathlib", "dataclasses", "threading", "enum")


def long_prompt(tokenizer, n_tokens: int) -> str:
    """Standard-library source text, cut to about ``n_tokens`` of ``tokenizer``."""
    text = ""
    for name in MODULES:
        text += inspect.getsource(__import__(name))
        if len(tokenizer.encode(text)) > n_tokens:
            break
    ids = tokenizer.encode(text)[: n_tokens - 1]
    return tokenizer.decode(ids[1:] if ids and ids[0] in (tokenizer.bos_token_id,) else ids)


def in_flight(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/v1/k3dist", timeout=10) as r:
        return json.loads(r.read())["requests"]


def hang_up_during_prefill(srv: Served, body: dict, fraction: float, limit_s: float) -> dict:
    """Send ``body`` streamed, hang up once ``fraction`` of its prompt is prefilled."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    data = json.dumps({**body, "stream": True}).encode()
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: k3\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    t0 = time.monotonic()
    seen: dict = {}
    while time.monotonic() - t0 < limit_s:
        reqs = [r for r in in_flight(srv.url) if r["prompt_tokens"]]
        if reqs:
            seen = reqs[0]
            if seen["prefilled_tokens"] >= fraction * seen["prompt_tokens"]:
                break
        time.sleep(1.0)
    s.close()
    return {"seconds": round(time.monotonic() - t0, 1), **seen}


def reference_tokens(build: Path, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    """Single-process mlx-lm on the unsliced build, no cache: greedy tokens and seconds."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model, load_tokenizer

    t0 = time.monotonic()
    model, _ = load_model(build)
    model.set_dtype(mx.float32)  # the server's compute dtype on CPU
    tok = load_tokenizer(build)
    out: list[int] = []
    for t, _ in generate_step(mx.array(tok.encode(prompt)), model, max_tokens=max_tokens):
        out.append(int(t))
        if out[-1] in tok.eos_token_ids:
            break
    return out, time.monotonic() - t0


def token_log(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=20000)
    ap.add_argument("--hang-up-at", type=float, default=0.6, help="of the prefill")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from mlx_lm.utils import load_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="resume-retry-"))
    logs = tmp / "tokens-{rank}.jsonl"
    args = ["--max-context", str(a.max_context), "--no-warmup", "--token-log", str(logs)]
    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "serve_args": args,
    }
    srv = Served(tmp / "serve", args)
    try:
        build = REPO / "runs/mini-build"  # the server's default build (deployment key)
        tok = load_tokenizer(REPO / "runs/ranks/rank0")
        prompt = long_prompt(tok, a.prompt_tokens)
        body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0}
        hung = hang_up_during_prefill(srv, body, a.hang_up_at, 3600)
        deadline = time.monotonic() + 120
        while not STOPPED.search(srv.output()) and time.monotonic() < deadline:
            time.sleep(0.5)
        m = STOPPED.search(srv.output())
        t0 = time.monotonic()
        status, retry = srv.post("/v1/completions", body, timeout=3600)
        retry_s = time.monotonic() - t0
        time.sleep(2)  # rank 1's token log entry trails rank 0's reply
        ranks = [token_log(Path(str(logs).format(rank=r))) for r in range(2)]
    finally:
        srv.stop()
    loadavg_served = os.getloadavg()
    ref, ref_s = reference_tokens(build, prompt, a.max_tokens)
    stopped = int(m[2]) if m else None
    cached = retry.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
    served = ranks[0][-1]["tokens"] if ranks[0] else None
    report.update(
        prompt_tokens=retry.get("usage", {}).get("prompt_tokens"),
        prefill_chunk=Deployment().prefill_chunk,  # the server's default
        hang_up=hung,
        stopped_at_prompt_token=stopped,
        retry_status=status,
        retry_cached_tokens=cached,
        retry_seconds=round(retry_s, 1),
        # of the tokens the ranks had prefilled when they stopped, those the retry
        # prefilled again (the goal: at most one prefill chunk)
        reprocessed_of_done=None if cached is None or stopped is None else stopped - cached,
        loadavg_after_served=loadavg_served,
        ranks_agree=len(ranks[0]) == len(ranks[1]) and ranks[0] == ranks[1],
        token_logs=ranks[0],
        retry_tokens=served,
        uninterrupted_tokens=ref,
        uninterrupted_seconds=round(ref_s, 1),
        resumed_equals_uninterrupted=served == ref,
        loadavg_end=os.getloadavg(),
    )
    text = json.dumps(report, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
