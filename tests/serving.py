"""The 2-rank server under mlx.launch on loopback, and what the server tests send it.

Files that only send requests and check the answers read one server per pytest process
(``SHARED``: conftest's session-scoped ``shared`` fixture starts each once, and its
xdist scheduler runs the files that read one in the same worker); files whose tests
kill, fault or restart a server, or need flags of their own, start their own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3dist.pipeline import slicing

import mlx.core as mx
import openai
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model, load_tokenizer
from util import REPO, feed_stdin, free_base_port, launch_cmd

CHAT = "/v1/chat/completions"
MAX_CONTEXT = 512  # a Server's --max-context unless its flags say otherwise

# Servers that several files only read from: name -> (flags, the files that read it).
# A reader sends requests and checks answers; it must not kill, fault, restart or
# reconfigure the server, nor rely on what another file sent it (count token-log
# entries from its own start, not from 0, and expect any prompt-cache state).
SHARED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # tool declarations and K3's system messages take a few hundred tokens of the mini
    # tokenizer: more context than 512 (the later flag wins)
    "text": (
        ("--max-context", "2048"),
        ("test_server.py", "test_agent_api.py", "test_metrics.py"),
    ),
    "vision": (
        (
            "--vision",
            "--max-images",
            "2",
            "--max-image-pixels",
            str(64 * 64),
            "--max-tokens",
            "3",  # k3dist.bench.fuzz.SMALL_TOKENS: a fuzzed request that names none
            "--max-batch",
            "2",
        ),
        ("test_fuzz.py", "test_vision_server.py"),
    ),
}
TEXT_CONTEXT = 2048  # SHARED["text"]'s --max-context
# Eight short prompts decoded together (a batch of 8): the batch fault tests and
# benchmarks/faults/rank_faults.py
BATCH_PROMPTS = (
    "def f(x):",
    "class Queue:",
    "import os\n",
    "for i in range(10):",
    "The river ran",
    "def main():",
    "x = [1, 2, 3]\n",
    "Once upon a time",
)


def free_port() -> int:
    """A port for a server, free now and below the ephemeral range (util.free_base_port)."""
    return free_base_port(1)


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def post_raw(url: str, data: bytes, timeout: float = 30.0):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    def __init__(
        self,
        rank_pattern: str,
        tmp: Path,
        extra: tuple[str, ...] = (),
        entry: Path | None = None,
        env: dict | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        self.entry = entry or REPO / "launch/serve.py"
        # An empty HOME: no Hugging Face cache (mlx_lm.server's /v1/models crashed there).
        env = dict(os.environ, HOME=str(tmp / "home"), **(env or {}))
        (tmp / "home").mkdir(parents=True, exist_ok=True)
        self.log = open(tmp / "server.log", "w")
        cmd = launch_cmd(
            2,
            self.entry,
            "--rank-dir",
            rank_pattern,
            "--port",
            str(self.port),
            "--max-context",
            str(MAX_CONTEXT),
            "--prefill-chunk",
            "32",
            "--token-log",
            str(tmp / "tokens-{rank}.jsonl"),
            "--watchdog-timeout-s",
            "15",
            *extra,
        )
        # stdin a pipe of ours, kept open and filled: mlx.launch spins on a stdin at EOF
        # and on each rank's stdin pipe until it is full or a write to it fails (the
        # ranks close theirs): util.feed_stdin
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        feed_stdin(self.proc.stdin)
        # warm-up compiles every shape first: 240 s was too short on 2 shared cores at
        # load ~17 (test_server's server, loaded, still warming up when it was stopped)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if get_json(self.url + "/health", 2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.tmp / "server.log").read_text()

    def wait_output(self, text: str, count: int, timeout: float = 10.0) -> str:
        """The log once `text` is in it `count` times (or at the deadline): /health can
        answer before mlx.launch has relayed a rank's earlier start-up lines."""
        deadline = time.time() + timeout
        while (out := self.output()).count(text) < count and time.time() < deadline:
            time.sleep(0.1)
        return out

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
            if self.entry.name.encode() not in cmd or f"{self.port}".encode() not in cmd:
                continue
            for kv in env:
                if kv.startswith(b"MLX_RANK="):
                    out[int(kv.split(b"=")[1])] = int(pid)
        return out

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def check_alive(srv: Server, who: str) -> None:
    """The server still runs with both ranks: a shared one checked when a file takes it
    and when it is done with it, so a file that broke it fails itself, not the next."""
    if srv.proc.poll() is not None or set(srv.rank_pids()) != {0, 1}:
        raise AssertionError(
            f"shared server {srv.url} is not running on both ranks ({who}); "
            f"its log {srv.tmp / 'server.log'}:\n{srv.output()[-4000:]}"
        )
    status, _ = get_json(srv.url + "/health", 10)
    assert status == 200, (who, status)


class SharedServers:
    """The ``SHARED`` servers of one pytest process, each started on first use."""

    def __init__(self, ranks: str, tmp_path_factory):
        self.ranks, self.tmp_path_factory = ranks, tmp_path_factory
        self.up: dict[str, Server] = {}

    def get(self, name: str, who: str) -> Server:
        if name not in self.up:
            tmp = self.tmp_path_factory.mktemp(f"shared-{name}")
            self.up[name] = Server(self.ranks, tmp, SHARED[name][0])
        srv = self.up[name]
        check_alive(srv, f"taken by {who}")
        return srv

    def stop(self) -> None:
        for srv in self.up.values():
            srv.stop()


def rank_folders(build: Path, out: Path) -> str:
    for r in range(2):
        slicing.slice_rank(build, out / f"rank{r}", r, 2, None, progress=False)
    return str(out / "rank{rank}")


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a Python function that adds two numbers."},
]


def reference_tokens(build: Path, messages, max_tokens: int, temp: float, seed: int):
    """Single-process mlx-lm on the unsliced build: the same prompt, sampler and seed."""
    model, _ = load_model(build)
    model.set_dtype(mx.float32)
    tok = load_tokenizer(build, {"trust_remote_code": False})
    prompt = tok.apply_chat_template(
        messages, add_generation_prompt=True, tools=None, tokenize=True
    )
    mx.random.seed(seed)
    out = []
    for t, _ in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(temp, top_p=1.0)
    ):
        t = int(t)
        out.append(t)
        if t in tok.eos_token_ids:
            break
    return out


def token_log(srv, rank: int) -> list[dict]:
    p = srv.tmp / f"tokens-{rank}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def wait_logs(srv, seen: int, n: int, timeout: float = 30.0) -> list[list[dict]]:
    """Both ranks' token-log entries after `seen`: rank 1 writes its entry when its
    own generation ends, which can trail rank 0's HTTP reply a little."""
    deadline = time.time() + timeout
    while True:
        logs = [token_log(srv, r)[seen:] for r in range(2)]
        if all(len(x) >= n for x in logs) or time.time() > deadline:
            return logs
        time.sleep(0.1)


def text_of(message) -> str:
    extra = message.model_extra or {}
    return (extra.get("reasoning") or "") + (message.content or "")


COMPL = "/v1/completions"
HI = {"prompt": "hi", "max_tokens": 2}


def post_conn(
    port: int,
    body: dict | bytes,
    path: str = COMPL,
    headers: dict | None = None,
    method: str = "POST",
    host: str = "127.0.0.1",
    timeout: float = 300,
):
    """One request on its own connection: (status or exception name, headers, body)."""
    import http.client

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(
            method,
            path,
            data if method == "POST" else None,
            {"Content-Type": "application/json", **(headers or {})},
        )
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    except Exception as e:  # a reset must show up as such, not fail the thread
        return type(e).__name__, {}, str(e).encode()
    finally:
        conn.close()


def burst(port: int, n: int, body: dict) -> list[tuple]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda _: post_conn(port, body), range(n)))


def check_burst(results: list[tuple]) -> tuple[int, int]:
    """Every request answered 200 (all the same greedy text) or 429 with Retry-After;
    none reset or dropped. Returns (served, refused)."""
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429}, statuses
    texts = {json.loads(b)["choices"][0]["text"] for s, _, b in results if s == 200}
    assert len(texts) == 1, texts
    for s, headers, b in results:
        if s == 429:
            assert int(headers["Retry-After"]) >= 1, headers
            assert json.loads(b)["error"]["code"] == "too_many_requests"
    return statuses.count(200), statuses.count(429)


def outside_address() -> str | None:
    """This machine's address on a non-loopback interface (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent for a UDP connect
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def stream_socket(port: int, body: dict, chunks: int) -> socket.socket:
    """Open a streamed completion on a raw socket and read until `chunks` data events."""
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    data = json.dumps({**body, "stream": True}).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: k3\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data
    )
    got = b""
    while got.count(b"data: {") < chunks:
        more = s.recv(65536)
        assert more, got
        got += more
    return s
