"""The rehearsal's serving half (issue 26): a 2-rank server on rank folders at the real
K3's counts (93 layers, 896 experts top-16; attention split, batching on), started,
verified and warmed up; its greedy tokens against single-process mlx-lm on the same
build; then requests over the three APIs (OpenAI chat/completions, Anthropic
/v1/messages, OpenAI /v1/responses), streamed and not, one at a time and 8 at once;
compiles after warm-up counted from each running rank (the kernels it has loaded).

    python benchmarks/rehearsal_serve.py --build /work/rehearsal/graded-dwq \
        --ranks '/work/rehearsal/ranks/rank{rank}' [--requests 100] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3dist.build.rss import peak_rss

from _served import free_base_port, free_port  # benchmarks/, beside this script

REPO = Path(__file__).resolve().parents[1]
MODEL = "kimi-k3"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a Python function that adds two numbers."},
]


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def kernels_mapped(pid: int) -> set[str]:
    from k3dist.serve import warmup

    d = str(warmup.jit_cache_dir())
    return {
        Path(x.rsplit(None, 1)[-1]).name
        for x in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if x.rstrip().endswith(".so") and x.rsplit(None, 1)[-1].startswith(d)
    }


def rank_pids(port: int) -> dict[int, int]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve.py" in cmd and str(port).encode() in cmd:
            for kv in env:
                if kv.startswith(b"MLX_RANK="):
                    out[int(kv.split(b"=")[1])] = int(pid)
    return out


def reference_tokens(build: Path, max_tokens: int) -> list[int]:
    """Single-process mlx-lm (load_model) on the unsliced build, greedy."""
    from k3dist.format.folder import load_config
    from k3dist.format.graded import GradedMap
    from k3dist.model import two_bank

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load_model, load_tokenizer

    graded = GradedMap.from_config(load_config(build))
    model = two_bank.load_build(build)[0] if graded is not None else load_model(build)[0]
    model.set_dtype(mx.float32)
    tok = load_tokenizer(build, {"trust_remote_code": False})
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    out = []
    for t, _ in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(0.0)
    ):
        out.append(int(t))
        if int(t) in tok.eos_token_ids:
            break
    return out


def requests_mix(n: int) -> list[tuple[str, bool, int]]:
    """(api, stream, max_tokens) for n requests, cycling the APIs and streaming."""
    apis = ("chat", "completions", "messages", "responses")
    return [(apis[i % 4], bool((i // 4) % 2), 2 + i % 3) for i in range(n)]


def one_request(url: str, api: str, stream: bool, max_tokens: int, i: int) -> dict:
    import anthropic
    import openai

    t0 = time.perf_counter()
    text = ""
    oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    temp = (0.0, 0.7)[i % 2]
    if api == "chat":
        msgs = [{"role": "user", "content": f"Say something about experts, #{i}."}]
        if stream:
            for ch in oc.chat.completions.create(
                model=MODEL, messages=msgs, stream=True, max_tokens=max_tokens, temperature=temp
            ):
                if ch.choices and ch.choices[0].delta.content:
                    text += ch.choices[0].delta.content
        else:
            r = oc.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=temp
            )
            text = r.choices[0].message.content or ""
    elif api == "completions":
        prompt = "def f(x):\n    return " * (1 + i % 7)
        if stream:
            for ch in oc.completions.create(
                model=MODEL, prompt=prompt, stream=True, max_tokens=max_tokens, temperature=temp
            ):
                text += ch.choices[0].text if ch.choices else ""
        else:
            text = (
                oc.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=temp
                )
                .choices[0]
                .text
            )
    elif api == "messages":
        ac = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=3600)
        # this anthropic SDK (2.15) has no temperature argument: sent in the body
        kw = dict(
            model=MODEL,
            max_tokens=max_tokens,
            extra_body={"temperature": temp},
            messages=[{"role": "user", "content": f"Name an expert, #{i}."}],
        )
        if stream:
            with ac.messages.stream(**kw) as s:
                text = "".join(s.text_stream)
        else:
            r = ac.messages.create(**kw)
            text = "".join(b.text for b in r.content if b.type == "text")
    else:
        kw = dict(
            model=MODEL,
            input=f"Route this token, #{i}.",
            max_output_tokens=max_tokens,
            temperature=temp,
        )
        if stream:
            for ev in oc.responses.create(stream=True, **kw):
                if ev.type == "response.output_text.delta":
                    text += ev.delta
        else:
            text = oc.responses.create(**kw).output_text
    return {
        "api": api,
        "stream": stream,
        "seconds": round(time.perf_counter() - t0, 2),
        "chars": len(text),
    }


def token_logs(tmp: Path, timeout: float = 60.0) -> list[list[dict]]:
    """Both ranks' token logs, once rank 1's holds as many entries as rank 0's (it writes
    after the reply has gone out, so it can trail by one)."""
    deadline = time.monotonic() + timeout
    while True:
        logs = [
            [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
            for p in (tmp / f"tokens-{r}.jsonl" for r in range(2))
        ]
        if len(logs[1]) >= len(logs[0]) or time.monotonic() > deadline:
            return logs
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, required=True, help="the unsliced build (reference)")
    ap.add_argument("--ranks", required=True, help="rank folder pattern with {rank}")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument(
        "--sequential",
        type=int,
        help="requests sent one at a time first (default: half); the rest go --concurrent at once",
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy parity tokens")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="k3-rehearsal-serve-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = Path(sys.executable).with_name("mlx.launch")
    cmd = [
        str(launcher),
        "-n",
        "2",
        "-p",
        str(free_base_port()),
        "--python",
        sys.executable,
        str(REPO / "launch/serve.py"),
        "--rank-dir",
        args.ranks,
        "--port",
        str(port),
        "--max-context",
        "512",
        "--prefill-chunk",
        "32",
        "--max-batch",
        str(args.concurrent),
        "--token-log",
        str(tmp / "tokens-{rank}.jsonl"),
        "--watchdog-timeout-s",
        "120",
    ]
    (tmp / "home").mkdir()
    log = open(tmp / "server.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, HOME=str(tmp / "home")),
    )
    report: dict = {
        "command": "python benchmarks/rehearsal_serve.py " + " ".join(sys.argv[1:]),
        "machine": platform.platform(),
        "load_before": os.getloadavg(),
    }
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited:\n{(tmp / 'server.log').read_text()[-3000:]}")
            try:
                get_json(url + "/health", 2)
                break
            except OSError:
                time.sleep(1)
        report["ready_s"] = round(time.perf_counter() - t0, 1)
        text = (tmp / "server.log").read_text()
        report["server_log"] = [
            x for x in text.splitlines() if re.search(r"loaded|warm-up|verif|preflight", x)
        ][:12]
        info = get_json(url + "/v1/k3dist")
        report["warmup"] = {
            k: info["warmup"][k]
            for k in (
                "seconds",
                "jit_kernels_loaded",
                "jit_kernels_loaded_by_warmup",
                "jit_kernels_compiled",
                "prefill_chunks",
                "decode",
            )
        }
        report["attention"] = {
            "mode": info["attention"]["mode"],
            "split_layers": len(info["attention"]["split_layers"]),
        }
        pids = rank_pids(port)
        mapped = {r: kernels_mapped(p) for r, p in pids.items()}

        import openai

        oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        t = time.perf_counter()
        oc.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=args.max_tokens, temperature=0.0
        )
        report["greedy_request_s"] = round(time.perf_counter() - t, 2)
        logs = token_logs(tmp)
        served = logs[0][-1]["tokens"]
        ref = reference_tokens(args.build, args.max_tokens)
        report["parity"] = {
            "served": served,
            "rank1": logs[1][-1]["tokens"],
            "single_process": ref,
            "equal": served == ref == logs[1][-1]["tokens"],
        }
        print(json.dumps(report), flush=True)

        mix = requests_mix(args.requests)
        results, errors = [], []
        lock = threading.Lock()

        def run(i: int) -> None:
            try:
                r = one_request(url, *mix[i], i)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"{mix[i]}: {type(e).__name__}: {e}"[:300])

        t = time.perf_counter()
        half = args.requests // 2 if args.sequential is None else args.sequential
        for i in range(half):  # one at a time
            run(i)
        with ThreadPoolExecutor(args.concurrent) as ex:  # the rest, 8 at once
            list(ex.map(run, range(half, args.requests)))
        report["requests"] = {
            "sent": args.requests,
            "ok": len(results),
            "errors": errors[:10],
            "seconds": round(time.perf_counter() - t, 1),
            "by_api": {
                f"{a}{' stream' if s else ''}": sum(
                    1 for r in results if r["api"] == a and r["stream"] == s
                )
                for a in ("chat", "completions", "messages", "responses")
                for s in (False, True)
            },
            "sequential": half,
            "concurrent": args.requests - half,
        }
        after = get_json(url + "/v1/k3dist")
        report["after_warmup"] = {
            "rank0_reported": after["jit_kernels_after_warmup"],
            "new_kernels_per_rank": {
                r: sorted(kernels_mapped(p) - mapped[r]) for r, p in pids.items()
            },
            "decode_batch_sizes_served": sorted({b for b, n in after["shapes_seen"] if n == 1}),
        }
        report["rank_peak_rss_mb"] = {r: peak_rss(p) >> 20 for r, p in pids.items()}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    report["load_after"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
