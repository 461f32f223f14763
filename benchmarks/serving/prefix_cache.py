"""An agent's long prefix across a restart: time to first token cold, warm in memory and
warm from the on-disk prefix cache after a restart, on the 2-rank server (mlx.launch on
loopback); and the inter-token latency of a running request while a cold prompt of the
same size prefills beside it.

    python benchmarks/serving/prefix_cache.py [--prefill-chunk 256] [--tools 24]
        --out benchmarks/results/DATE/prefix-cache.json   (defaults: ~4K-token prefix)

Server 1 (empty ``--prefix-cache-dir``): session A's first turn (system prompt + a
coding agent's tool list, ~4K tokens, then a user turn) is cold; session B (the same
prefix, another user turn) is warm in memory. Server 2 (restarted on the same folder,
``--prefix-cache-preload-gb 0``): session C is warm from disk, restored at its turn.
Server 3 (restarted on a copy of the folder as server 1 left it, the preload on: the
entries are loaded into memory at start, before the first request): session C again, a
memory hit; the preload's time is the server's start, reported apart. Then request D
(on server 3) streams 200 tokens while E, a cold prompt of the same size (another system
prompt), prefills: D's gaps between tokens while E
prefills vs before. Reports each TTFT, the cached tokens (usage), the bytes per cached
token per rank (the files), the restore time (the server's log) and the gap percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from k3dist.bench import record

import numpy as np
import openai

REPO = Path(__file__).resolve().parents[2]
VERBS = (
    "read",
    "write",
    "edit",
    "search",
    "list",
    "run",
    "test",
    "lint",
    "format",
    "diff",
    "commit",
    "fetch",
    "grep",
    "glob",
    "move",
    "delete",
    "open",
    "build",
    "install",
    "profile",
    "trace",
    "review",
    "explain",
    "plan",
)


def tools(n: int) -> list[dict]:
    """A coding agent's tool list: JSON-schema functions with real-looking descriptions."""
    out = []
    for i in range(n):
        v = VERBS[i % len(VERBS)]
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"{v}_{i}",
                    "description": (
                        f"{v.capitalize()} files or state in the workspace. Use this "
                        f"tool when the user asks you to {v} something; prefer it over "
                        "shell commands. Paths are relative to the repository root; "
                        "large outputs are truncated to 2000 lines, so narrow the "
                        "request with the offset and limit parameters first."
                    ),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "path": {"type": "string", "description": "file or folder to act on"},
                            "pattern": {
                                "type": "string",
                                "description": "glob or regular expression",
                            },
                            "offset": {"type": "integer", "description": "first line (1-based)"},
                            "limit": {"type": "integer", "description": "most lines to return"},
                            "dry_run": {"type": "boolean", "description": "say what would change"},
                        },
                        "required": ["path"],
                    },
                },
            }
        )
    return out


def system(name: str, rules: int) -> str:
    return f"You are {name}, an interactive coding agent in a terminal. " + " ".join(
        f"Rule {i}: before changing file {i}, read it and keep its style; never exceed "
        f"{60 + i} columns."
        for i in range(rules)
    )


_NEXT_PORT: list[int] = []  # --port-base: ports handed out from there, in order


def _port() -> int:
    """A free port: the next of --port-base's range, else any the kernel picks."""
    if _NEXT_PORT:
        while True:
            p = _NEXT_PORT[0]
            _NEXT_PORT[0] += 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                    return p
                except OSError:
                    continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Srv:
    def __init__(self, a, store: Path, tmp: Path, tag: str, extra: tuple[str, ...] = ()):
        self.port = _port()
        self.log_path = tmp / f"server-{tag}.log"
        ring = _port()
        _port()  # rank 1's ring port
        cmd = [
            str(Path(sys.executable).with_name("mlx.launch")),
            "-n",
            "2",
            "-p",
            str(ring),
            "--python",
            sys.executable,
            str(REPO / "launch/serve.py"),
            "--port",
            str(self.port),
            "--max-context",
            "16384",
            "--prefill-chunk",
            str(a.prefill_chunk),
            "--max-tokens",
            "256",
            "--prefix-cache-dir",
            str(store),
            "--watchdog-port",
            str(_port()),
            *extra,
        ]
        if a.rank_dir:
            cmd += ["--rank-dir", a.rank_dir]
        self.log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(1200):
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_path.read_text())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        self.start_s = round(time.perf_counter() - t0, 1)
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=1200
        )

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)
        self.log.close()


def turn(srv: Srv, sys_text: str, tl: list, user: str, max_tokens: int = 4) -> dict:
    t0 = time.perf_counter()
    first, usage, stamps = None, None, []
    for ch in srv.client.chat.completions.create(
        model="kimi-k3",
        messages=[{"role": "system", "content": sys_text}, {"role": "user", "content": user}],
        tools=tl,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"thinking": False}},
    ):
        if ch.choices:
            d = ch.choices[0].delta
            if d.content or (d.model_extra or {}).get("reasoning") or d.tool_calls:
                now = time.perf_counter()
                stamps.append(now)
                first = first if first is not None else now - t0
        if ch.usage:
            usage = ch.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": cached,
        "ttft_s": round(first if first is not None else time.perf_counter() - t0, 3),
        "stamps": stamps,
    }


def running_gaps(srv: Srv, cold_sys: str, tl: list, vocab_eos: list[int]) -> dict:
    """D streams 200 tokens (EOS masked) from a short prompt; E, a cold long prompt, is
    sent once D is decoding: D's gaps before E, while E prefills, after."""
    stamps: list[float] = []
    done = threading.Event()

    def run_d():
        for ch in srv.client.completions.create(
            model="kimi-k3",
            prompt="def main():\n    ",
            max_tokens=200,
            temperature=0,
            stream=True,
            logit_bias={str(t): -100 for t in vocab_eos},
        ):
            if ch.choices and ch.choices[0].text is not None:
                stamps.append(time.perf_counter())
        done.set()

    th = threading.Thread(target=run_d)
    th.start()
    while len(stamps) < 20 and not done.is_set():
        time.sleep(0.05)
    e_sent = time.perf_counter()
    e = turn(srv, cold_sys, tl, "Summarise the rules.")
    e_first = e_sent + e["ttft_s"]
    th.join()
    gaps = np.diff(np.array(stamps))
    mids = np.array(stamps[1:])
    during = gaps[(mids > e_sent) & (mids <= e_first + 1e-3)]
    before = gaps[mids <= e_sent]
    after = gaps[mids > e_first + 1e-3]

    def pct(x):
        return {
            "n": int(len(x)),
            **(
                {
                    "p50_s": round(float(np.percentile(x, 50)), 4),
                    "p99_s": round(float(np.percentile(x, 99)), 4),
                    "max_s": round(float(x.max()), 4),
                }
                if len(x)
                else {}
            ),
        }

    return {
        "d_tokens": len(stamps),
        "e_prompt_tokens": e["prompt_tokens"],
        "e_cached_tokens": e["cached_tokens"],
        "e_ttft_s": e["ttft_s"],
        "gaps_before_e": pct(before),
        "gaps_while_e_prefills": pct(during),
        "gaps_after_e": pct(after),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-dir", help="rank folders ({rank}); default: the embedded mini")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--tools", type=int, default=12, help="tools in the agent's list")
    ap.add_argument("--rules", type=int, default=34, help="rules in its system prompt")
    ap.add_argument("--skip-gaps", action="store_true")
    ap.add_argument(
        "--gaps-only",
        action="store_true",
        help="one server: only the running request's gaps (to compare chunks)",
    )
    ap.add_argument(
        "--port-base", type=int, help="take every port from here up (default: any free)"
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.port_base:
        _NEXT_PORT.append(a.port_base)
    tmp = Path(tempfile.mkdtemp(prefix="prefix-cache-"))
    store = tmp / "store"
    tl = tools(a.tools)
    sys_a = system("Ada", a.rules)
    report: dict = {
        **record.environment(),
        "prefill_chunk": a.prefill_chunk,
        "load_before": os.getloadavg(),
    }
    if a.gaps_only:
        s = Srv(a, store, tmp, "gaps")
        try:
            report["running_request_gaps"] = running_gaps(s, system("Bob", a.rules), tl, _eos(a))
        finally:
            s.stop()
        report["load_after"] = os.getloadavg()
        return _emit(report, a.out)
    s1 = Srv(a, store, tmp, "1")
    try:
        report["server_1_start_s"] = s1.start_s
        cold = turn(s1, sys_a, tl, "List the files in src/ and say which one is largest.")
        mem = turn(s1, sys_a, tl, "Run the tests and tell me which ones fail.")
    finally:
        s1.stop()
    files = {r: sorted(store.glob(f"*/rank{r}-of-2/*.safetensors")) for r in range(2)}
    sides = {
        r: [json.loads(p.with_suffix(".json").read_text()) for p in files[r]] for r in range(2)
    }
    shutil.copytree(store, tmp / "store-copy")  # server 3 starts from what 1 left
    user_c = "Open the README and fix its first typo."
    s2 = Srv(a, store, tmp, "2", ("--prefix-cache-preload-gb", "0"))
    try:
        report["server_2_start_s"] = s2.start_s
        disk = turn(s2, sys_a, tl, user_c)
        log = s2.log_path.read_text()
        restores = [
            float(x)
            for x in re.findall(
                r"prefix cache hit: \d+ tokens restored in "
                r"([0-9.]+) s",
                log,
            )
        ]
    finally:
        s2.stop()
    s3 = Srv(a, tmp / "store-copy", tmp, "3")
    try:
        report["server_3_start_s"] = s3.start_s
        pre = turn(s3, sys_a, tl, user_c)
        log = s3.log_path.read_text()
        preloads = [
            {"entries": int(n), "tokens": int(t.replace(",", "")), "s": float(x)}
            for n, t, x in re.findall(
                r"prefix cache preload \(rank \d\): (\d+) of \d+ entries \(([0-9,]+) "
                r"tokens\) into memory in ([0-9.]+) s",
                log,
            )
        ]
        pre["restored_at_turn"] = "prefix cache hit" in log
        if not a.skip_gaps:
            report["running_request_gaps"] = running_gaps(s3, system("Bob", a.rules), tl, _eos(a))
    finally:
        s3.stop()
    for t in (cold, mem, disk, pre):
        t.pop("stamps")
    per_tok = {
        r: [round(s["file_bytes"] / len(s["tokens"]), 1) for s in sides[r]] for r in range(2)
    }
    report.update(
        {
            "turn_cold": cold,
            "turn_warm_memory": mem,
            "turn_warm_after_restart": disk,
            "warm_memory_over_cold": round(mem["ttft_s"] / cold["ttft_s"], 4),
            "warm_restart_over_cold": round(disk["ttft_s"] / cold["ttft_s"], 4),
            "turn_warm_after_restart_preloaded": pre,
            "warm_restart_preloaded_over_cold": round(pre["ttft_s"] / cold["ttft_s"], 4),
            "preload_at_start_per_rank_log": preloads,
            "entries_per_rank": {
                r: [{"tokens": len(s["tokens"]), "file_bytes": s["file_bytes"]} for s in sides[r]]
                for r in range(2)
            },
            "bytes_per_cached_token_per_rank": per_tok,
            "restore_s_per_rank_log": restores,
            "load_after": os.getloadavg(),
        }
    )
    _emit(report, a.out)


def _eos(a) -> list[int]:
    from mlx_lm.utils import load_tokenizer

    folder = Path((a.rank_dir or "runs/ranks/rank{rank}").format(rank=0))
    return sorted(load_tokenizer(REPO / folder).eos_token_ids)


def _emit(report: dict, out: Path | None) -> None:
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
