"""Time to first token for the real agent clients' full default prompts (issue 28):
Claude Code's (its system prompt and ~24 tools), Codex `exec`'s and aider's, cold and
then warm (a second session: the same prefix, reused from the prompt cache), on the
2-rank mini server of the README's first command (launch/run.py over mlx.launch on
loopback) with a context large enough for them.

    python benchmarks/agents/agent_clients.py [--clients claude codex aider] [--max-tokens 8]
        [--max-context 65536] --out benchmarks/results/DATE/agent-clients.json

A cold prefill of ~28K tokens takes many minutes on a small CPU box, so each client runs
once against a capture server on loopback (stdlib HTTP: it records each POST body and
answers 400 in that API's error shape, so the client stops there), and its largest
request body (its real turn: system prompt, tools, user message) is replayed against the
k3dist server, streamed, with only ``max_tokens`` lowered. Session 2 is the same body
with another user line at the end: its prefix (everything before) is the prompt cache's.
Reports per client: the version, the body's size and tool count, the prompt tokens
(count endpoint and usage), TTFT cold and warm, cached tokens, and the load average.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _served.py: benchmarks/
from _served import REPO, Served, free_port  # noqa: E402

CLAUDE = REPO / ".agents/node_modules/.bin/claude"
CODEX = REPO / ".agents/node_modules/.bin/codex"
AIDER = REPO / ".venv-aider/bin/aider"
USER = "List the files here and say what each one is for."
FOLLOW_UP = "And which of them is the largest?"


# ------------------------------------------------------------------------- capture


class _Capture(http.server.ThreadingHTTPServer):
    bodies: list[tuple[str, dict]]


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n)
        path = self.path.split("?", 1)[0]
        try:
            self.server.bodies.append((path, json.loads(raw)))
        except ValueError:
            pass
        if path.startswith("/v1/messages"):
            err = {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "captured"},
            }
        else:
            err = {"error": {"message": "captured", "type": "invalid_request_error", "code": None}}
        data = json.dumps(err).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        data = json.dumps({"object": "list", "data": [{"id": "kimi-k3", "object": "model"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *a) -> None:
        pass


def _env(home: Path, **extra: str) -> dict:
    home.mkdir(parents=True, exist_ok=True)
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return {**keep, "HOME": str(home), "NO_PROXY": "127.0.0.1", **extra}


def _client_cmd(
    name: str, url: str, tmp: Path, *, own_retries: bool = False
) -> tuple[list[str], dict]:
    """The client with its defaults (no --bare, its own system prompt and tools).
    Codex retries nothing unless ``own_retries`` (then its own counts apply)."""
    if name == "claude":
        return (
            [
                str(CLAUDE),
                "-p",
                USER,
                "--model",
                "kimi-k3",
                "--output-format",
                "stream-json",
                "--verbose",
            ],
            _env(
                tmp / "home",
                ANTHROPIC_BASE_URL=url,
                ANTHROPIC_API_KEY="dummy-key",
                CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                DISABLE_TELEMETRY="1",
                DISABLE_AUTOUPDATER="1",
                DISABLE_ERROR_REPORTING="1",
            ),
        )
    if name == "codex":
        (tmp / "codex").mkdir(parents=True, exist_ok=True)
        retries = "" if own_retries else ", request_max_retries=0, stream_max_retries=0"
        provider = (
            f'{{name="k3", base_url="{url}/v1", env_key="K3_API_KEY", '
            f'wire_api="responses"{retries}}}'
        )
        return (
            [
                str(CODEX),
                "exec",
                "--skip-git-repo-check",
                "--json",
                "-m",
                "kimi-k3",
                "-c",
                'model_provider="k3"',
                "-c",
                f"model_providers.k3={provider}",
                "-c",
                "analytics.enabled=false",
                USER,
            ],
            _env(tmp / "home", CODEX_HOME=str(tmp / "codex"), K3_API_KEY="dummy-key"),
        )
    meta = tmp / "models.json"
    meta.write_text(
        json.dumps(
            {
                "openai/kimi-k3": {
                    "max_input_tokens": 65536,
                    "max_output_tokens": 4096,
                    "input_cost_per_token": 0,
                    "output_cost_per_token": 0,
                    "litellm_provider": "openai",
                    "mode": "chat",
                }
            }
        )
    )
    return (
        [
            str(AIDER),
            "--model",
            "openai/kimi-k3",
            "--model-metadata-file",
            str(meta),
            "--no-git",
            "--yes-always",
            "--no-check-update",
            "--analytics-disable",
            "--no-show-model-warnings",
            "--no-pretty",
            "--message",
            USER,
        ],
        _env(
            tmp / "home",
            OPENAI_API_BASE=url + "/v1",
            OPENAI_API_KEY="dummy-key",
            LITELLM_LOCAL_MODEL_COST_MAP="True",
        ),
    )


def version(name: str) -> str:
    exe = {"claude": CLAUDE, "codex": CODEX, "aider": AIDER}[name]
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    return (r.stdout or r.stderr).strip().splitlines()[-1]


def capture(name: str, tmp: Path) -> tuple[str, dict]:
    """The client's largest POST (its turn) to a capture server: (path, body)."""
    tmp.mkdir(parents=True, exist_ok=True)
    srv = _Capture(("127.0.0.1", free_port()), _Handler)
    srv.bodies = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cmd, env = _client_cmd(name, f"http://127.0.0.1:{srv.server_address[1]}", tmp)
        work = tmp / "work"
        work.mkdir(exist_ok=True)
        (work / "notes.txt").write_text("a file for the agent to list\n")
        subprocess.run(
            cmd, env=env, cwd=work, capture_output=True, timeout=300, stdin=subprocess.DEVNULL
        )
    finally:
        srv.shutdown()
    turns = [(p, b) for p, b in srv.bodies if "count_tokens" not in p]
    if not turns:
        raise RuntimeError(f"{name} sent no request to the capture server")
    return max(turns, key=lambda pb: len(json.dumps(pb[1])))


# -------------------------------------------------------------------------- replay


def follow_up(path: str, body: dict) -> dict:
    """Session 2: the same request with one more user line at the end."""
    b = copy.deepcopy(body)
    if path.endswith("/responses"):
        items = (
            b["input"]
            if isinstance(b["input"], list)
            else [{"role": "user", "content": b["input"]}]
        )
        b["input"] = [*items, {"role": "user", "content": FOLLOW_UP}]
    else:
        b["messages"].append({"role": "user", "content": FOLLOW_UP})
        if path.startswith("/v1/messages"):  # Anthropic: one user turn after another
            b["messages"].insert(-1, {"role": "assistant", "content": "Ok."})
    return b


def _first_token(event: dict) -> bool:
    """Whether an SSE event carries generated output (not a ping or a start event)."""
    t = event.get("type", "")
    if t == "content_block_delta" or (t.startswith("response.") and t.endswith(".delta")):
        return True
    for c in event.get("choices") or []:
        d = c.get("delta") or {}
        if (
            d.get("content")
            or d.get("reasoning")
            or d.get("reasoning_content")
            or d.get("tool_calls")
        ):
            return True
    return False


def _usage(event: dict) -> dict | None:
    if event.get("type") == "message_start":
        return event["message"].get("usage")
    if event.get("type") in ("response.completed", "response.incomplete"):  # max_tokens
        return event["response"].get("usage")
    return event.get("usage") or None


def replay(url: str, path: str, body: dict, max_tokens: int) -> dict:
    """One streamed request: TTFT, total time, the usage the server reports."""
    b = dict(body, stream=True)
    for key in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
        b.pop(key, None)
    b["max_output_tokens" if path.endswith("/responses") else "max_tokens"] = max_tokens
    if path.endswith("/chat/completions"):
        b["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        url + path, data=json.dumps(b).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    ttft, usage = None, {}
    with urllib.request.urlopen(req, timeout=7200) as r:
        for line in r:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ttft is None and _first_token(ev):
                ttft = time.monotonic() - t0
            usage = {**usage, **(_usage(ev) or {})}
    return {"ttft_s": ttft, "total_s": time.monotonic() - t0, "usage": usage}


def count_tokens(url: str, path: str, body: dict) -> int | None:
    """The prompt's tokens as the server counts them (Anthropic's count endpoint;
    the others: the usage of the cold run)."""
    if not path.startswith("/v1/messages"):
        return None
    b = {
        k: v
        for k, v in body.items()
        if k in ("model", "messages", "system", "tools", "tool_choice", "thinking")
    }
    req = urllib.request.Request(
        url + "/v1/messages/count_tokens",
        data=json.dumps(b).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["input_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--clients",
        nargs="+",
        default=["claude", "codex", "aider"],
        choices=["claude", "codex", "aider"],
    )
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--capture-only",
        action="store_true",
        help="capture the bodies and report their sizes; no server",
    )
    ap.add_argument(
        "--serve-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="more launch/serve.py flags (last on the line)",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="agent-clients-"))
    report: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "clients": {},
    }
    bodies = {}
    for name in a.clients:
        path, body = capture(name, tmp / name)
        bodies[name] = (path, body)
        report["clients"][name] = {
            "version": version(name),
            "path": path,
            "body_bytes": len(json.dumps(body)),
            "tools": len(body.get("tools") or []),
            "max_tokens_sent": body.get("max_tokens", body.get("max_output_tokens")),
        }
        (tmp / f"{name}-body.json").write_text(json.dumps(body))
    report["bodies_dir"] = str(tmp)
    if not a.capture_only:
        args = ["--max-context", str(a.max_context), "--no-warmup", *a.serve_args]
        report["serve_args"] = args
        srv = Served(tmp / "serve", args)
        try:
            report["server_ready_s"] = srv.ready_s
            for name, (path, body) in bodies.items():
                r = report["clients"][name]
                r["count_tokens"] = count_tokens(srv.url, path, body)
                r["loadavg_before"] = os.getloadavg()
                r["cold"] = replay(srv.url, path, body, a.max_tokens)
                r["warm"] = replay(srv.url, path, follow_up(path, body), a.max_tokens)
                r["loadavg_after"] = os.getloadavg()
                _emit(report, a.out)  # each client's figures as soon as they are in
        finally:
            srv.stop()
    report["loadavg_end"] = os.getloadavg()
    print(_emit(report, a.out))


def _emit(report: dict, out: Path | None) -> str:
    text = json.dumps(report, indent=1)
    if out:
        out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
