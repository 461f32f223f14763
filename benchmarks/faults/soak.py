"""Soak (issue 28): mixed traffic against the 2-rank server for a long time; every
temperature-0 answer must equal the same request served alone, none may be lost.

    .venv/bin/python benchmarks/faults/soak.py [--minutes 30] [--workers 12] [--out FILE]

Starts the server as an operator does (launch/run.py over mlx.launch on loopback; the
embedded trained mini-K3, ``--max-batch 8``, images on when mlx-vlm is installed).
A fixed set of requests (chat completions, completions, Anthropic Messages, OpenAI
Responses; streamed and not; with tools; with an image; multi-turn conversations over
one long shared system prompt, so the prompt cache serves their prefixes) is first
served one at a time: the reference answers. Then ``--workers`` threads (more than
max_batch, so requests queue and batch) send random picks for ``--minutes``; a share
of them (``--abandon``) hang up part-way (during prefill or decode). Each answer is
normalised (text, reasoning, tool calls, finish) and compared with its reference.

Reported: requests by kind and outcome (ok, mismatch, refused with status, lost:
no complete answer, abandoned by us), latency and time-to-first-event percentiles,
every rank's RSS sampled every ``--sample-s`` with the growth over the second half
against a stated bound, and whether both ranks' token logs agree.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
from k3dist.bench import record  # noqa: E402

from _served import Served, percentiles, rss_bytes  # noqa: E402

SYSTEM = "You are a careful coding assistant working in a large repository. " + " ".join(
    f"Rule {i}: keep function {i} small, typed and tested." for i in range(30)
)
QUESTIONS = [
    "Write a function that adds two numbers.",
    "What does a queue do?",
    "Explain recursion in one line.",
    "Name three sorting algorithms.",
    "Fix: def f(x) return x",
    "How do I read a file in Python?",
    "What is a hash map?",
    "Write a loop that prints 1 to 5.",
]
TOOLS = [
    ("read_file", "Read a file in the workspace.", {"path": {"type": "string"}}),
    ("run_tests", "Run the test suite.", {"pattern": {"type": "string"}}),
]
# RSS growth over the soak's second half that counts as a leak (fraction of the RSS)
RSS_GROWTH_BOUND = 0.05


def _schema(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


def _png() -> str:
    from PIL import Image

    img = Image.new("RGB", (64, 48))
    img.putdata(
        [((x * 4) % 256, (y * 5) % 256, (x * y) % 256) for y in range(48) for x in range(64)]
    )
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(rid: str, base: dict, messages: list[dict], **extra) -> dict:
    """A chat completion request of the soak: ``base`` (limits), ``extra``, ``messages``."""
    body = {**base, **extra, "messages": messages}
    return {"id": rid, "path": "/v1/chat/completions", "api": "chat", "body": body}


def templates(images: bool, max_tokens: int, questions: int = len(QUESTIONS)) -> list[dict]:
    """Every request of the soak: {"id", "path", "api", "body"} (streaming is chosen
    per send)."""
    out = []
    chat_tools = [
        {"type": "function", "function": {"name": n, "description": d, "parameters": _schema(p)}}
        for n, d, p in TOOLS
    ]
    for i, q in enumerate(QUESTIONS[:questions]):
        base = {"max_tokens": max_tokens, "temperature": 0}
        asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        out.append(_chat(f"chat-{i}", base, asked))
        out.append(_chat(f"chat-tools-{i}", base, asked, tools=chat_tools))
        # a second turn over the first (the prompt cache serves the shared prefix)
        turn2 = [
            {"role": "assistant", "content": "Here is a first answer."},
            {"role": "user", "content": "Now make it shorter."},
        ]
        out.append(_chat(f"chat-turn2-{i}", base, asked + turn2))
        out.append(
            {
                "id": f"completion-{i}",
                "path": "/v1/completions",
                "api": "completions",
                "body": {**base, "prompt": f"# {q}\ndef solution("},
            }
        )
        out.append(
            {
                "id": f"messages-{i}",
                "path": "/v1/messages",
                "api": "messages",
                "body": {
                    "model": "kimi-k3",
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "system": SYSTEM,
                    "messages": [{"role": "user", "content": q}],
                    **(
                        {
                            "tools": [
                                {"name": n, "description": d, "input_schema": _schema(p)}
                                for n, d, p in TOOLS
                            ]
                        }
                        if i % 2
                        else {}
                    ),
                },
            }
        )
        out.append(
            {
                "id": f"responses-{i}",
                "path": "/v1/responses",
                "api": "responses",
                "body": {
                    "model": "kimi-k3",
                    "max_output_tokens": max_tokens,
                    "temperature": 0,
                    "instructions": SYSTEM,
                    "input": q,
                    **(
                        {
                            "tools": [
                                {
                                    "type": "function",
                                    "name": n,
                                    "description": d,
                                    "parameters": _schema(p),
                                }
                                for n, d, p in TOOLS
                            ]
                        }
                        if i % 2
                        else {}
                    ),
                },
            }
        )
        if images and i < 4:
            out.append(
                {
                    "id": f"image-{i}",
                    "path": "/v1/chat/completions",
                    "api": "chat",
                    "body": {
                        **base,
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {"type": "image_url", "image_url": {"url": _png()}},
                                    {"type": "text", "text": q},
                                ],
                            }
                        ],
                    },
                }
            )
    return out


# ---------------------------------------------------------------- answers, normalised


def _args(a) -> str:
    if isinstance(a, str):
        try:
            a = json.loads(a)
        except ValueError:
            return a
    return json.dumps(a, sort_keys=True)


def _canon(text="", reasoning="", tools=(), finish=None) -> dict:
    return {
        "text": text,
        "reasoning": reasoning,
        "tools": [list(t) for t in tools],
        "finish": finish,
    }


def parse_body(api: str, body: dict) -> dict:
    if api == "chat":
        c = body["choices"][0]
        m = c["message"]
        return _canon(
            m.get("content") or "",
            m.get("reasoning") or "",
            [
                (t["function"]["name"], _args(t["function"]["arguments"]))
                for t in m.get("tool_calls") or []
            ],
            c["finish_reason"],
        )
    if api == "completions":
        c = body["choices"][0]
        return _canon(c["text"], finish=c["finish_reason"])
    if api == "messages":
        text = "".join(b["text"] for b in body["content"] if b["type"] == "text")
        think = "".join(b["thinking"] for b in body["content"] if b["type"] == "thinking")
        tools = [(b["name"], _args(b["input"])) for b in body["content"] if b["type"] == "tool_use"]
        return _canon(text, think, tools, body["stop_reason"])
    # responses
    text, think, tools = "", "", []
    for item in body["output"]:
        if item["type"] == "message":
            text += "".join(c.get("text", "") for c in item["content"])
        elif item["type"] == "reasoning":
            think += "".join(
                c.get("text", "") for c in item.get("content") or item.get("summary") or []
            )
        elif item["type"] == "function_call":
            tools.append((item["name"], _args(item["arguments"])))
    return _canon(text, think, tools, body["status"])


def parse_stream(api: str, events: list[tuple[str | None, str]]) -> dict:
    """SSE events (event name, data) -> the normalised answer; raises if incomplete."""
    if api in ("chat", "completions"):
        assert events and events[-1][1] == "[DONE]", "stream ended without [DONE]"
        text, think, tools, finish = "", "", [], None
        for _, data in events[:-1]:
            ch = json.loads(data)
            assert "error" not in ch, ch
            for c in ch.get("choices") or []:
                if api == "completions":
                    text += c.get("text") or ""
                else:
                    d = c.get("delta") or {}
                    text += d.get("content") or ""
                    think += d.get("reasoning") or ""
                    for t in d.get("tool_calls") or []:
                        fn = t.get("function") or {}
                        if fn.get("name"):
                            tools.append([fn["name"], fn.get("arguments") or ""])
                        elif tools:
                            tools[-1][1] += fn.get("arguments") or ""
                finish = c.get("finish_reason") or finish
        return _canon(text, think, [(n, _args(a)) for n, a in tools], finish)
    if api == "messages":
        assert events and events[-1][0] == "message_stop", "stream ended without message_stop"
        blocks: dict[int, dict] = {}
        stop = None
        for name, data in events:
            ev = json.loads(data)
            if name == "error":
                raise AssertionError(ev)
            if name == "content_block_start":
                blocks[ev["index"]] = {**ev["content_block"], "_json": ""}
            elif name == "content_block_delta":
                b, d = blocks[ev["index"]], ev["delta"]
                if d["type"] == "text_delta":
                    b["text"] = b.get("text", "") + d["text"]
                elif d["type"] == "thinking_delta":
                    b["thinking"] = b.get("thinking", "") + d["thinking"]
                elif d["type"] == "input_json_delta":
                    b["_json"] += d["partial_json"]
            elif name == "message_delta":
                stop = ev["delta"].get("stop_reason")
        content = [
            dict(b, input=json.loads(b["_json"] or "{}")) if b["type"] == "tool_use" else b
            for _, b in sorted(blocks.items())
        ]
        return parse_body("messages", {"content": content, "stop_reason": stop})
    done = [json.loads(d) for n, d in events if n in ("response.completed", "response.incomplete")]
    assert done and events[-1][0] == done[0]["type"], (
        f"stream ended without response.completed ({[n for n, _ in events[-3:]]})"
    )
    return parse_body("responses", done[0]["response"])


# ---------------------------------------------------------------- one request


class Result:
    __slots__ = (
        "tid",
        "api",
        "stream",
        "outcome",
        "status",
        "latency",
        "first",
        "answer",
        "detail",
    )

    def __init__(self, tid, api, stream):
        self.tid, self.api, self.stream = tid, api, stream
        self.outcome, self.status, self.latency, self.first = None, None, None, None
        self.answer, self.detail = None, ""


def send(
    port: int, t: dict, stream: bool, abandon_after: float | None = None, timeout: float = 600
) -> Result:
    """One request on its own connection. ``abandon_after``: hang up after that many
    seconds (or at the first streamed event, whichever is first)."""
    r = Result(t["id"], t["api"], stream)
    body = dict(t["body"], stream=True) if stream else dict(t["body"])
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    if abandon_after is not None:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        s.sendall(
            f"POST {t['path']} HTTP/1.1\r\nHost: k3\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        end = t0 + abandon_after
        try:
            while (left := end - time.perf_counter()) > 0:
                s.settimeout(left)
                if not s.recv(65536):
                    break
        except (TimeoutError, OSError):
            pass
        s.close()
        r.outcome, r.latency = "abandoned", time.perf_counter() - t0
        return r
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", t["path"], data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        r.status = resp.status
        if resp.status != 200:
            raw = resp.read()
            r.first = time.perf_counter() - t0
            err = json.loads(raw)  # a refusal must be a well-formed error body
            assert "error" in err or err.get("type") == "error", err
            r.outcome, r.detail = "refused", raw[:200].decode(errors="replace")
        elif stream:
            events, name = [], None
            for line in resp:
                line = line.decode().rstrip("\r\n")
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    if r.first is None:
                        r.first = time.perf_counter() - t0
                    events.append((name, line[6:]))
                    name = None
            r.answer, r.outcome = parse_stream(t["api"], events), "answered"
        else:
            raw = resp.read()
            r.first = time.perf_counter() - t0
            r.answer, r.outcome = parse_body(t["api"], json.loads(raw)), "answered"
    except Exception as e:  # noqa: BLE001 - every failure is counted, none hidden
        r.outcome, r.detail = "lost", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        conn.close()
    r.latency = time.perf_counter() - t0
    return r


# ---------------------------------------------------------------- the run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--abandon", type=float, default=0.06, help="share of requests hung up")
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-images", action="store_true")
    ap.add_argument(
        "--questions",
        type=int,
        default=len(QUESTIONS),
        help="user questions per request kind (fewer: a shorter reference pass)",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    try:
        import mlx_vlm  # noqa: F401

        images = not a.no_images
    except ImportError:
        images = False
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    args = [
        "--max-batch",
        str(a.max_batch),
        "--max-context",
        "4096",
        "--token-log",
        str(tmp / "tokens-{rank}.jsonl"),
    ]
    if images:
        args += ["--vision", "--max-images", "2"]
    srv = Served(tmp, args)
    procs = srv.processes()
    rss: dict[str, list] = defaultdict(list)
    stop = threading.Event()
    t_start = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            for role, pid in procs.items():
                b = rss_bytes(pid)
                if b is not None:
                    rss[role].append((round(time.monotonic() - t_start, 1), b))
            stop.wait(a.sample_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results: list[Result] = []
    try:
        pool = templates(images, a.max_tokens, a.questions)
        # 1. the reference: every request alone, streamed and not
        ref = {}
        t_ref = time.perf_counter()
        for t in pool:
            for stream in (False, True):
                r = send(srv.port, t, stream)
                if r.outcome != "answered":
                    raise RuntimeError(
                        f"reference {t['id']} stream={stream}: {r.outcome} "
                        f"{r.status} {r.detail}\n{srv.output()[-3000:]}"
                    )
                ref[(t["id"], stream)] = r.answer
        ref_s = time.perf_counter() - t_ref
        # 2. mixed traffic
        rng = random.Random(a.seed)
        lock = threading.Lock()
        deadline = time.monotonic() + a.minutes * 60
        soak_start = time.monotonic() - t_start

        def worker(k: int) -> None:
            wr = random.Random(a.seed * 1000 + k)
            while time.monotonic() < deadline:
                t = wr.choice(pool)
                stream = wr.random() < 0.5
                abandon = wr.uniform(0.05, 3.0) if wr.random() < a.abandon else None
                r = send(srv.port, t, stream, abandon)
                if r.outcome == "answered":
                    r.outcome = "ok" if r.answer == ref[(t["id"], stream)] else "mismatch"
                with lock:
                    results.append(r)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(a.workers)]
        del rng
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        soak_end = time.monotonic() - t_start
        time.sleep(3)
        alive = srv.proc.poll() is None
        health = srv.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})[0]
    finally:
        stop.set()
        rc = srv.stop()
    # token logs: both ranks generated the same tokens for the same requests
    logs = [
        [json.loads(x) for x in (tmp / f"tokens-{r}.jsonl").read_text().splitlines()]
        for r in range(2)
    ]
    by = Counter((r.api, r.outcome) for r in results)
    kinds = Counter(r.tid.rsplit("-", 1)[0] + ("/stream" if r.stream else "") for r in results)
    mism = [
        {"id": r.tid, "stream": r.stream, "got": r.answer, "want": ref[(r.tid, r.stream)]}
        for r in results
        if r.outcome == "mismatch"
    ][:20]
    lost = [
        {"id": r.tid, "stream": r.stream, "detail": r.detail}
        for r in results
        if r.outcome == "lost"
    ][:20]
    refused = Counter(r.status for r in results if r.outcome == "refused")

    def growth(series: list) -> dict:
        mid = [b for t, b in series if t >= (soak_start + soak_end) / 2]
        first = [b for t, b in series if t >= soak_start]
        if not mid or not first:
            return {}
        return {
            "at_soak_start_mb": round(first[0] / 2**20, 1),
            "at_half_mb": round(mid[0] / 2**20, 1),
            "end_mb": round(series[-1][1] / 2**20, 1),
            "max_mb": round(max(b for _, b in series) / 2**20, 1),
            "second_half_growth_mb": round((series[-1][1] - mid[0]) / 2**20, 1),
            "second_half_growth_fraction": round((series[-1][1] - mid[0]) / mid[0], 4),
            "within_bound": (series[-1][1] - mid[0]) / mid[0] <= RSS_GROWTH_BOUND,
        }

    done = [r for r in results if r.outcome in ("ok", "mismatch")]
    report = {
        **record.environment(),
        "server_command": srv.cmd,
        "minutes": round((soak_end - soak_start) / 60, 2),
        "workers": a.workers,
        "max_batch": a.max_batch,
        "max_tokens": a.max_tokens,
        "images": images,
        "abandon_share": a.abandon,
        "templates": len(pool),
        "reference_requests": len(ref),
        "reference_seconds": round(ref_s, 1),
        "requests": len(results),
        "outcomes": dict(Counter(r.outcome for r in results)),
        "lost": sum(r.outcome == "lost" for r in results),
        "mismatches": sum(r.outcome == "mismatch" for r in results),
        "refused_by_status": {str(k): v for k, v in refused.items()},
        "by_api_and_outcome": {f"{k[0]}/{k[1]}": v for k, v in sorted(by.items())},
        "by_kind": dict(sorted(kinds.items())),
        "latency_s": percentiles([r.latency for r in done]),
        "latency_s_by_api": {
            api: percentiles([r.latency for r in done if r.api == api])
            for api in ("chat", "completions", "messages", "responses")
        },
        "first_event_s_streamed": percentiles([r.first for r in done if r.stream and r.first]),
        "rss_bound": f"growth over the second half <= {RSS_GROWTH_BOUND:.0%} of the RSS",
        "rss": {role: growth(s) for role, s in rss.items()},
        "rss_samples_mb": {
            role: [(t, round(b / 2**20, 1)) for t, b in s] for role, s in rss.items()
        },
        "token_logs_entries": [len(x) for x in logs],
        "token_logs_agree": logs[0] == logs[1],
        "server_alive_after": alive,
        "health_request_status_after": health,
        "server_exit_code_after_sigterm": rc,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "mismatch_examples": mism,
        "lost_examples": lost,
        "tracebacks_in_server_log": srv.output().count("Traceback"),
    }
    record.emit(report, a.out, indent=1)


if __name__ == "__main__":
    main()
