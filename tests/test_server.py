"""The 2-rank server under mlx.launch on loopback, through the real openai client.

Malformed requests tried (each must get a 4xx with an OpenAI-style error body,
and the server must keep serving): see MALFORMED below — bad JSON, a non-object
body, invalid UTF-8, missing/empty/ill-typed messages, an unknown role, content
as a number or an object, a non-text content part, negative / zero / huge /
string max_tokens, temperature out of range or a string, top_p > 1, stop as an
object or a list of numbers, n = 0 and n = 2, an unknown model, stream as a
string, seed as a string, tools as a string, a text completion without a prompt
or with a numeric prompt, and a prompt longer than the context (in tokens, and
6 million tokens' worth of characters).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3dist.build import slicing

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model, load_tokenizer
from util import REPO, free_base_port

openai = pytest.importorskip("openai")

MAX_CONTEXT = 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def _post_raw(url: str, data: bytes, timeout: float = 30.0):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    def __init__(self, rank_pattern: str, tmp: Path, extra: tuple[str, ...] = ()):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        # An empty HOME: no Hugging Face cache (mlx_lm.server's /v1/models crashed there).
        env = dict(os.environ, HOME=str(tmp / "home"))
        (tmp / "home").mkdir(parents=True, exist_ok=True)
        launcher = Path(sys.executable).with_name("mlx.launch")
        self.log = open(tmp / "server.log", "w")
        cmd = [str(launcher), "-n", "2", "-p", str(free_base_port(2)), "--python", sys.executable,
               str(REPO / "launch/serve.py"), "--rank-dir", rank_pattern,
               "--port", str(self.port), "--max-context", str(MAX_CONTEXT),
               "--prefill-chunk", "32", "--token-log", str(tmp / "tokens-{rank}.jsonl"),
               "--watchdog-timeout-s", "15", *extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if _get(self.url + "/health", 2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.tmp / "server.log").read_text()

    def rank_pids(self) -> dict[int, int]:
        """PIDs of the rank processes (children of mlx.launch), by MLX_RANK."""
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve.py" not in cmd or f"{self.port}".encode() not in cmd:
                continue
            for kv in env:
                if kv.startswith(b"MLX_RANK="):
                    out[int(kv.split(b"=")[1])] = int(pid)
        return out

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _rank_folders(build: Path, out: Path) -> str:
    for r in range(2):
        slicing.slice_rank(build, out / f"rank{r}", r, 2, None, progress=False)
    return str(out / "rank{rank}")


@pytest.fixture(scope="module")
def ranks(mini_build, tmp_path_factory):
    return _rank_folders(mini_build, tmp_path_factory.mktemp("serve-ranks"))


@pytest.fixture(scope="module")
def srv(ranks, tmp_path_factory):
    s = Server(ranks, tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Write a Python function that adds two numbers."}]


def _reference_tokens(build: Path, messages, max_tokens: int, temp: float, seed: int):
    """Single-process mlx-lm on the unsliced build: the same prompt, sampler and seed."""
    model, _ = load_model(build)
    model.set_dtype(mx.float32)
    tok = load_tokenizer(build, {"trust_remote_code": False})
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tools=None,
                                     tokenize=True)
    mx.random.seed(seed)
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                              sampler=make_sampler(temp, top_p=1.0)):
        t = int(t)
        out.append(t)
        if t in tok.eos_token_ids:
            break
    return out


def _log(srv, rank: int) -> list[dict]:
    p = srv.tmp / f"tokens-{rank}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _wait_logs(srv, seen: int, n: int, timeout: float = 30.0) -> list[list[dict]]:
    """Both ranks' token-log entries after `seen`: rank 1 writes its entry when its
    own generation ends, which can trail rank 0's HTTP reply a little."""
    deadline = time.time() + timeout
    while True:
        logs = [_log(srv, r)[seen:] for r in range(2)]
        if all(len(x) >= n for x in logs) or time.time() > deadline:
            return logs
        time.sleep(0.1)


def _text(message) -> str:
    extra = message.model_extra or {}
    return (extra.get("reasoning") or "") + (message.content or "")


def test_chat_streamed_and_not_equal_single_process(srv, mini_build):
    c = srv.client()
    seen = len(_log(srv, 0))
    r = c.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=24,
                                  temperature=0.0, seed=3)
    text = _text(r.choices[0].message)
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    chunks = c.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=24,
                                       temperature=0.0, seed=3, stream=True)
    streamed = "".join(_text(ch.choices[0].delta) for ch in chunks if ch.choices)
    assert streamed == text and text
    sampled = c.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=24,
                                        temperature=0.7, seed=11)

    logs = _wait_logs(srv, seen, 3)
    assert len(logs[0]) == 3 and logs[0] == logs[1]  # both ranks generated the same tokens
    greedy, streamed_toks, sampled_toks = (e["tokens"] for e in logs[0])
    assert len(greedy) == r.usage.completion_tokens
    assert greedy == streamed_toks == _reference_tokens(mini_build, MESSAGES, 24, 0.0, 3)
    assert sampled_toks == _reference_tokens(mini_build, MESSAGES, 24, 0.7, 11)
    assert sampled_toks != greedy and sampled.usage.completion_tokens == len(sampled_toks)


def test_models_without_hf_cache_and_deployment_info(srv):
    status, body = _get(srv.url + "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["kimi-k3"]
    assert [m.id for m in srv.client().models.list().data] == ["kimi-k3"]
    _, info = _get(srv.url + "/v1/k3dist")
    assert info["ranks"] == 2 and info["prefill_chunks"][0] == 32


def test_warm_up_leaves_nothing_to_compile(srv):
    _, before = _get(srv.url + "/v1/k3dist")
    assert before["warmup"]["jit_kernels_total"] == before["jit_kernels"]
    c = srv.client()
    for n in (3, 37, 70):  # prompt lengths whose chunks are all warmed-up sizes
        c.completions.create(model="kimi-k3", prompt="x " * n, max_tokens=5, temperature=0)
    _, after = _get(srv.url + "/v1/k3dist")
    print(f"\nJIT kernels after warm-up {before['jit_kernels']}, after requests "
          f"{after['jit_kernels']}")
    assert after["jit_kernels"] == before["jit_kernels"]


CHAT = "/v1/chat/completions"
OK = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MALFORMED = {
    "bad JSON": (CHAT, b'{"model": "kimi-k3", "messages": [', 400),
    "body not an object": (CHAT, b"[1, 2, 3]", 400),
    "invalid UTF-8": (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    "missing messages": (CHAT, {"model": "kimi-k3"}, 400),
    "empty messages": (CHAT, {**OK, "messages": []}, 400),
    "messages not a list": (CHAT, {**OK, "messages": "hi"}, 400),
    "message not an object": (CHAT, {**OK, "messages": ["hi"]}, 400),
    "unknown role": (CHAT, {**OK, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "content a number": (CHAT, {**OK, "messages": [{"role": "user", "content": 42}]}, 400),
    "content an object": (CHAT, {**OK, "messages": [{"role": "user", "content": {}}]}, 400),
    "image part": (CHAT, {**OK, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    "negative max_tokens": (CHAT, {**OK, "max_tokens": -5}, 400),
    "zero max_tokens": (CHAT, {**OK, "max_tokens": 0}, 400),
    "huge max_tokens": (CHAT, {**OK, "max_tokens": 10**9}, 400),
    "max_tokens a string": (CHAT, {**OK, "max_tokens": "10"}, 400),
    "negative temperature": (CHAT, {**OK, "temperature": -1}, 400),
    "temperature a string": (CHAT, {**OK, "temperature": "hot"}, 400),
    "top_p above 1": (CHAT, {**OK, "top_p": 1.5}, 400),
    "stop an object": (CHAT, {**OK, "stop": {"a": 1}}, 400),
    "stop numbers": (CHAT, {**OK, "stop": [1, 2]}, 400),
    "n = 0": (CHAT, {**OK, "n": 0}, 400),
    "n = 2": (CHAT, {**OK, "n": 2}, 400),
    "unknown model": (CHAT, {**OK, "model": "gpt-5"}, 404),
    "stream a string": (CHAT, {**OK, "stream": "yes"}, 400),
    "seed a string": (CHAT, {**OK, "seed": "1"}, 400),
    "tools a string": (CHAT, {**OK, "tools": "calc"}, 400),
    "completion without prompt": ("/v1/completions", {"model": "kimi-k3"}, 400),
    "numeric prompt": ("/v1/completions", {"prompt": 7}, 400),
    "prompt over the context": ("/v1/completions", {"prompt": "word " * 600}, 400),
    "chat over the context": (CHAT, {"messages": [{"role": "user", "content": "word " * 600}]},
                              400),
    "max_tokens past the context": (CHAT, {**OK, "max_tokens": MAX_CONTEXT}, 400),
}


def test_malformed_requests_get_4xx_and_server_keeps_serving(srv):
    for name, (path, body, status) in MALFORMED.items():
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, raw = _post_raw(srv.url + path, data)
        assert got == status, (name, got, raw[:300])
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["type"] == "invalid_request_error", name
    got, raw = _post_raw(srv.url + CHAT, json.dumps(OK).encode())
    assert got == 200, raw[:300]
    # no max_tokens: the server default (512) is capped to what fits the context (512)
    long = {"messages": [{"role": "user", "content": "word " * 100}]}  # ~440 tokens
    got, raw = _post_raw(srv.url + CHAT, json.dumps(long).encode(), 120)
    assert got == 200, raw[:300]
    usage = json.loads(raw)["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= MAX_CONTEXT


def test_six_million_token_prompt_refused_at_once(srv):
    t = time.perf_counter()
    got, raw = _post_raw(srv.url + "/v1/completions",
                         json.dumps({"prompt": "a " * 6_000_000, "max_tokens": 4}).encode())
    took = time.perf_counter() - t
    assert got in (400, 413), raw[:200]
    assert "context" in raw.decode() or "exceeds" in raw.decode()
    assert took < 10


def _stream_until_killed(s: Server, sig: int, victim: int):
    """Start a long stream, deliver `sig` to rank `victim` mid-way; return what the
    client saw and how long the whole launch took to end."""
    c = s.client()
    pids = s.rank_pids()
    assert set(pids) == {0, 1}, pids
    stream = c.chat.completions.create(model="kimi-k3", messages=MESSAGES, max_tokens=200,
                                       temperature=0.0, stream=True)
    got, error = 0, None
    t_kill = None
    try:
        for _ in stream:
            got += 1
            if got == 3:
                os.kill(pids[victim], sig)
                t_kill = time.time()
    except Exception as e:  # the client must see an error, not hang
        error = e
    s.proc.wait(timeout=60)
    return got, error, time.time() - (t_kill or time.time())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_losing_a_rank_mid_stream_ends_cleanly(ranks, tmp_path, sig):
    s = Server(ranks, tmp_path)
    try:
        got, error, took = _stream_until_killed(s, sig, victim=1)
    finally:
        s.stop()
    out = s.output()
    print(f"\n{signal.Signals(sig).name}: {got} chunks, client error {error!r}, "
          f"launch ended {took:.1f}s after the signal")
    assert took < 30
    assert error is not None and got < 200  # the client saw an error, not a normal end
    if sig == signal.SIGKILL:
        assert "lost rank 1" in out and "was lost" in str(error)
    else:
        assert "stopping: SIGTERM (from rank 1)" in out and "stopping" in str(error)


def test_requests_arriving_together_are_served_intact(srv):
    """Sequential serving (see k3dist.serve.server): concurrent requests queue and each
    gets exactly what it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    c = srv.client()
    prompts = ["def f(x):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]

    def ask(p):
        return c.completions.create(model="kimi-k3", prompt=p, max_tokens=8,
                                    temperature=0.0).choices[0].text

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(ask, prompts))
    assert together == alone
