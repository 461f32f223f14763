"""The rehearsal's serving half (issue 26): an N-rank server (``--size``, default 2) on
rank folders at the real K3's counts (93 layers, 896 experts top-16; attention split,
batching on), started, verified and warmed up; its greedy tokens against single-process
mlx-lm on the same build; then requests over the three APIs (OpenAI chat/completions, Anthropic
/v1/messages, OpenAI /v1/responses), streamed and not, one at a time and 8 at once;
compiles after warm-up counted from each running rank (the kernels it has loaded);
every rank's token log compared with rank 0's request by request.

    python benchmarks/pipeline/rehearsal_serve.py --build /work/rehearsal/graded-dwq \
        --ranks '/work/rehearsal/ranks/rank{rank}' [--requests 100] [--out JSON]

The single-process reference runs first, before the server starts (so a failure there
shows in minutes, not after a 93-layer warm-up), and the report is written to --out
after each phase (``phase`` says how far it got), so a run stopped part way keeps what
it measured. mlx.launch gets a stdin pipe, written once the server answers (as
``tests/serving.py`` and ``k3dist.serve.supervise`` do): with none it spins a core.
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

from k3dist.pipeline.rss import peak_rss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
from _served import cpu_seconds, free_base_port, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
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


def requests_mix(n: int, most_tokens: int = 4) -> list[tuple[str, bool, int]]:
    """(api, stream, max_tokens) for n requests, cycling the APIs and streaming; max_tokens
    cycles 1..most_tokens."""
    apis = ("chat", "completions", "messages", "responses")
    return [(apis[i % 4], bool((i // 4) % 2), 1 + i % most_tokens) for i in range(n)]


def one_request(url: str, api: str, stream: bool, max_tokens: int, i: int) -> dict:
    """One request through the API's own SDK; its HTTP status from the raw response
    (or from the SDK's error)."""
    import anthropic
    import openai

    t0 = time.perf_counter()
    text = ""
    oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    temp = (0.0, 0.7)[(i // 8) % 2]  # each API greedy and sampled, streamed and not
    out = {"i": i, "api": api, "stream": stream, "max_tokens": max_tokens}
    try:
        if api == "chat":
            msgs = [{"role": "user", "content": f"Say something about experts, #{i}."}]
            raw = oc.chat.completions.with_raw_response.create(
                model=MODEL, messages=msgs, stream=stream, max_tokens=max_tokens, temperature=temp
            )
            if stream:
                for ch in raw.parse():
                    if ch.choices and ch.choices[0].delta.content:
                        text += ch.choices[0].delta.content
            else:
                text = raw.parse().choices[0].message.content or ""
        elif api == "completions":
            prompt = "def f(x):\n    return " * (1 + i % 7)
            raw = oc.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, stream=stream, max_tokens=max_tokens, temperature=temp
            )
            if stream:
                for ch in raw.parse():
                    text += ch.choices[0].text if ch.choices else ""
            else:
                text = raw.parse().choices[0].text
        elif api == "messages":
            ac = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=3600)
            # this anthropic SDK has no temperature argument here: sent in the body
            raw = ac.messages.with_raw_response.create(
                model=MODEL,
                max_tokens=max_tokens,
                stream=stream,
                extra_body={"temperature": temp},
                messages=[{"role": "user", "content": f"Name an expert, #{i}."}],
            )
            if stream:
                for ev in raw.parse():
                    if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                        text += ev.delta.text
            else:
                text = "".join(b.text for b in raw.parse().content if b.type == "text")
        else:
            raw = oc.responses.with_raw_response.create(
                model=MODEL,
                input=f"Route this token, #{i}.",
                max_output_tokens=max_tokens,
                temperature=temp,
                stream=stream,
            )
            if stream:
                for ev in raw.parse():
                    if ev.type == "response.output_text.delta":
                        text += ev.delta
            else:
                text = raw.parse().output_text
        out["status"] = raw.status_code
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        out["status"], out["error"] = e.status_code, str(e)[:300]
    except Exception as e:  # noqa: BLE001 - counted and reported
        out["status"], out["error"] = None, f"{type(e).__name__}: {e}"[:300]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["chars"] = len(text)
    return out


def token_logs(tmp: Path, size: int, timeout: float = 120.0) -> list[list[dict]]:
    """Every rank's token log, once each other rank's holds as many entries as rank 0's
    (they write after the reply has gone out, so they can trail by one)."""
    deadline = time.monotonic() + timeout
    while True:
        logs = [
            [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
            for p in (tmp / f"tokens-{r}.jsonl" for r in range(size))
        ]
        done = logs[0] and all(len(x) >= len(logs[0]) for x in logs[1:])
        if done or time.monotonic() > deadline:
            return logs
        time.sleep(0.2)


def boxes_deployment(tmp: Path, args: argparse.Namespace) -> Path:
    """deploy/local.yaml with the boxes the folders were placed for: the loader refuses
    folders placed otherwise (serve.py has no --boxes flag: a build key)."""
    text = (REPO / "deploy" / "local.yaml").read_text()
    path = tmp / "deployment.yaml"
    path.write_text(f"{text}\nsize: {args.size}\nboxes: {args.boxes}\n")
    return path


def stdin_closed(pids: dict[int, int], size: int) -> bool:
    """Every rank runs and has let go of mlx.launch's pipe (launch/serve.py puts
    /dev/null in its place at start)."""

    def devnull(pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/fd/0") == os.devnull
        except OSError:
            return False

    return len(pids) == size and all(devnull(p) for p in pids.values())


def release_stdin(proc: subprocess.Popen) -> bool:
    """One line to mlx.launch's stdin once the ranks' stdins are closed: it forwards it,
    the write fails, and its per-rank threads stop selecting on those always-writable
    pipes (with no pipe, or before this, mlx.launch spins a core)."""
    try:
        proc.stdin.write(b"\n")
        proc.stdin.flush()
    except OSError:
        pass
    return True


def compare_logs(logs: list[list[dict]]) -> dict:
    """Every rank's token log against rank 0's, entry by entry (request number, tokens)."""
    by = [{e["request"]: e["tokens"] for e in log} for log in logs]
    both = sorted(set.intersection(*map(set, by)))
    differ = [n for n in both if any(b[n] != by[0][n] for b in by[1:])]
    every = set.union(*map(set, by))
    return {
        "entries": [len(x) for x in logs],
        "compared": len(both),
        "equal": len(both) - len(differ),
        "differ": differ[:10],
        "not_on_every_rank": sorted(every - set(both))[:10],
        "identical": bool(both) and not differ and all(set(b) == set(by[0]) for b in by),
    }


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, required=True, help="the unsliced build (reference)")
    ap.add_argument("--ranks", required=True, help="rank folder pattern with {rank}")
    ap.add_argument("--size", type=int, default=2, help="ranks (one rank folder each)")
    ap.add_argument(
        "--boxes",
        help="the boxes the folders were placed for (e.g. 512,256,256): the server refuses "
        "folders placed otherwise",
    )
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument(
        "--sequential",
        type=int,
        help="requests sent one at a time first (default: half); the rest go --concurrent at once",
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy parity tokens")
    ap.add_argument(
        "--request-tokens",
        type=int,
        default=3,
        help="the mix's max_tokens cycle 1..this (keeps 100 requests at 93 layers short)",
    )
    ap.add_argument("--port", type=int, help="HTTP port (default: a free one)")
    ap.add_argument("--ring-port", type=int, help="mlx.launch's first ring port (default: free)")
    ap.add_argument("--watchdog-port", type=int, help="rank 0's watchdog port (default: ring+1000)")
    ap.add_argument("--out", help="also write the JSON here (after each phase)")
    args = ap.parse_args()

    report: dict = {
        "command": "python benchmarks/pipeline/rehearsal_serve.py " + " ".join(sys.argv[1:]),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "phase": "start",
    }

    def save(phase: str) -> None:
        report["phase"] = phase
        if args.out:
            tmp_out = Path(args.out + ".partial")
            tmp_out.write_text(json.dumps(report, indent=2) + "\n")
            tmp_out.replace(args.out)

    # The single-process reference first: minutes, and nothing else running here.
    say(f"single-process reference on {args.build} ({args.max_tokens} greedy tokens)")
    t = time.perf_counter()
    ref = reference_tokens(args.build, args.max_tokens)
    report["reference"] = {
        "tokens": ref,
        "seconds": round(time.perf_counter() - t, 1),
        "how": "mlx-lm generate_step, greedy, on the unsliced build in one process "
        "(k3dist.model.two_bank.load_build for a graded build), float32",
    }
    say(f"reference tokens {ref} in {report['reference']['seconds']} s")
    save("reference")
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()

    tmp = Path(tempfile.mkdtemp(prefix="k3-rehearsal-serve-"))
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = Path(sys.executable).with_name("mlx.launch")
    cmd = [
        str(launcher),
        "-n",
        str(args.size),
        "-p",
        str(args.ring_port or free_base_port()),
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
        *(["--config", str(boxes_deployment(tmp, args))] if args.boxes else []),
        *(["--watchdog-port", str(args.watchdog_port)] if args.watchdog_port else []),
    ]
    report["server_command"] = " ".join(
        os.path.relpath(c, REPO) if c.startswith(str(REPO)) else c for c in cmd
    )
    (tmp / "home").mkdir()
    log = open(tmp / "server.log", "w")
    say(f"server starting (log {tmp / 'server.log'})")
    t0 = time.perf_counter()
    # stdin a pipe, written once the ranks have closed theirs: mlx.launch spins on a stdin
    # at EOF, and on each rank's stdin pipe until a write to it fails
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.PIPE,
        start_new_session=True,
        env=dict(os.environ, HOME=str(tmp / "home")),
    )
    released = False
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited:\n{(tmp / 'server.log').read_text()[-3000:]}")
            if not released and stdin_closed(rank_pids(port), args.size):
                released = release_stdin(proc)
                report["stdin_released_s"] = round(time.perf_counter() - t0, 1)
            try:
                get_json(url + "/health", 2)
                break
            except OSError:
                time.sleep(1)
        if not released:
            release_stdin(proc)
            report["stdin_released_s"] = round(time.perf_counter() - t0, 1)
        report["ready_s"] = round(time.perf_counter() - t0, 1)
        text = (tmp / "server.log").read_text()
        report["server_log"] = [
            x for x in text.splitlines() if re.search(r"loaded|warm-up|verif|preflight", x)
        ][:12]
        info = get_json(url + "/v1/k3dist", 60)
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
        report["kernels_after_warmup_per_rank"] = {r: len(m) for r, m in mapped.items()}
        launcher_cpu0, launcher_t0 = cpu_seconds(proc.pid), time.perf_counter()
        say(
            f"ready in {report['ready_s']} s; warm-up {report['warmup']['seconds']} s, "
            f"kernels per rank {report['kernels_after_warmup_per_rank']}"
        )
        save("ready")

        import openai

        oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        t = time.perf_counter()
        oc.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=args.max_tokens, temperature=0.0
        )
        report["greedy_request_s"] = round(time.perf_counter() - t, 2)
        logs = token_logs(tmp, args.size)
        served = logs[0][-1]["tokens"] if logs[0] else None
        others = [x[-1]["tokens"] if x else None for x in logs[1:]]
        report["parity"] = {
            "served": served,
            "other_ranks": others,
            "single_process": ref,
            "equal": served is not None and served == ref and all(o == ref for o in others),
        }
        say(
            f"parity: served {served} other ranks {others} single-process {ref}: "
            f"{'EQUAL' if report['parity']['equal'] else 'DIFFER'}"
        )
        save("parity")

        mix = requests_mix(args.requests, args.request_tokens)
        results: list[dict] = []
        lock = threading.Lock()

        def run(i: int) -> None:
            r = one_request(url, *mix[i], i)
            with lock:
                results.append(r)
                n = len(results)
            if n % 10 == 0:
                say(f"{n} of {args.requests} answered")

        t = time.perf_counter()
        half = args.requests // 2 if args.sequential is None else args.sequential
        for i in range(half):  # one at a time
            run(i)
        t_seq = time.perf_counter() - t
        with ThreadPoolExecutor(args.concurrent) as ex:  # the rest, 8 at once
            list(ex.map(run, range(half, args.requests)))
        results.sort(key=lambda r: r["i"])
        ok = [r for r in results if r["status"] == 200 and "error" not in r]
        codes: dict[str, int] = {}
        for r in results:
            codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
        report["requests"] = {
            "sent": args.requests,
            "answered_200": len(ok),
            "status_codes": codes,
            "errors": [f"{r['i']} {r['api']}: {r['error']}" for r in results if "error" in r][:10],
            "seconds": round(time.perf_counter() - t, 1),
            "sequential": half,
            "sequential_s": round(t_seq, 1),
            "concurrent": args.requests - half,
            "concurrent_clients": args.concurrent,
            "concurrent_s": round(time.perf_counter() - t - t_seq, 1),
            "by_api": {
                f"{a}{' stream' if s else ''}": sum(
                    1 for r in ok if r["api"] == a and r["stream"] == s
                )
                for a in ("chat", "completions", "messages", "responses")
                for s in (False, True)
            },
            "each": [
                {k: r[k] for k in ("i", "api", "stream", "max_tokens", "status", "seconds")}
                for r in results
            ],
        }
        say(f"requests: {len(ok)} of {args.requests} answered 200 ({codes})")
        save("requests")
        after = get_json(url + "/v1/k3dist", 60)
        now = {r: kernels_mapped(p) for r, p in pids.items()}
        report["after_requests"] = {
            "rank0_reported_after_warmup": after["jit_kernels_after_warmup"],
            "kernels_per_rank": {r: len(m) for r, m in now.items()},
            "new_kernels_per_rank": {r: sorted(now[r] - mapped[r]) for r, p in pids.items()},
            "decode_batch_sizes_served": sorted({b for b, n in after["shapes_seen"] if n == 1}),
        }
        report["token_logs"] = compare_logs(token_logs(tmp, args.size))
        spent = cpu_seconds(proc.pid)
        report["mlx_launch_cpu"] = {
            "cpu_s": round(spent - launcher_cpu0, 2)
            if None not in (spent, launcher_cpu0)
            else None,
            "wall_s": round(time.perf_counter() - launcher_t0, 1),
            "what": "mlx.launch's own CPU from ready to after the requests (its stdin a pipe, "
            "written once the server answered)",
        }
        report["rank_peak_rss_mb"] = {r: peak_rss(p) >> 20 for r, p in pids.items()}
        say(
            f"after requests: kernels {report['after_requests']['kernels_per_rank']}, new "
            f"{report['after_requests']['new_kernels_per_rank']}; token logs "
            f"{report['token_logs']}"
        )
        save("done")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdin:
            try:
                proc.stdin.close()
            except OSError:
                pass
        log.close()
        report["load_after"] = [round(x, 2) for x in os.getloadavg()]
        report["server_log_path"] = str(tmp / "server.log")
        save(report["phase"])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
