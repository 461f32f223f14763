"""Real coding agents, unmodified (issue 28): Claude Code (headless, stream-json; default
mode and --bare), Codex `exec` with its default tools, and aider each complete a turn
against the 2-rank mini server (mlx.launch on loopback); Claude Code makes a tool round
trip (Read: tool_use out, the file's text back in as tool_result, then the answer).

The mini's weights are random, so the server runs with scripted token choice
(tests/scripts/serve_scripted.py: the real model on every rank in lockstep, each token
forced): a short answer that ends its message, or a K3 tool call when asked. The
clients are the registry packages `.ci/run` installs (`.agents/` from npm,
`.venv-aider/` from PyPI); a test skips only when its client is not installed. Each
client runs with a fresh HOME, dummy keys, telemetry and update checks off, and only
127.0.0.1 to talk to.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from serving import Server
from util import REPO

CLAUDE = REPO / ".agents/node_modules/.bin/claude"
CODEX = REPO / ".agents/node_modules/.bin/codex"
AIDER = REPO / ".venv-aider/bin/aider"
FILE_TEXT = "hello from the file"


def _installed(p: Path):
    return pytest.mark.skipif(not p.exists(), reason=f"{p.relative_to(REPO)} is not "
                              "installed (.ci/run installs it)")


def k3_call(name: str, args: dict[str, str]) -> str:
    """K3's text for one call of a tool with string arguments."""
    a = "".join(f'<|open|>argument key="{k}" type="string"<|sep|>{v}<|close|>argument<|sep|>'
                for k, v in args.items())
    return f'<|open|>call tool="{name}" index="1"<|sep|>{a}<|close|>call<|sep|>'


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("agent-work")
    (d / "hello.txt").write_text(FILE_TEXT + "\n")
    return d


@pytest.fixture(scope="module")
def srv(ranks, work, tmp_path_factory):
    calls = {"Read": k3_call("Read", {"file_path": str(work / "hello.txt")})}
    s = Server(ranks, tmp_path_factory.mktemp("agent-clients"),
               ("--max-context", "16384", "--prefill-chunk", "512", "--max-batch", "1",
                "--no-warmup"),
               entry=REPO / "tests/scripts/serve_scripted.py",
               env={"K3_TEST_TOOL_CALLS": json.dumps(calls)})
    yield s
    s.stop()


def _env(tmp: Path, **extra: str) -> dict:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return {**keep, "HOME": str(home), "NO_PROXY": "127.0.0.1", **extra}


def _run(cmd: list[str], env: dict, cwd: Path, timeout: float = 900):
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    return r.returncode, r.stdout, r.stderr


def _claude(srv, work: Path, tmp: Path, *args: str) -> list[dict]:
    env = _env(tmp, ANTHROPIC_BASE_URL=srv.url, ANTHROPIC_API_KEY="dummy-key",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1",
               DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1",
               # the mini server's context is small: Claude Code asks 32000 by default
               CLAUDE_CODE_MAX_OUTPUT_TOKENS="200")
    rc, out, err = _run([str(CLAUDE), "-p", *args, "--model", "kimi-k3",
                         "--output-format", "stream-json", "--verbose"], env, work)
    events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert events and events[-1]["type"] == "result", (rc, out[-3000:], err[-3000:])
    result = events[-1]
    assert rc == 0 and result["subtype"] == "success" and not result["is_error"], \
        (result, err[-2000:], srv.output()[-3000:])
    assert result["result"] == "Hi."
    return events


@_installed(CLAUDE)
def test_claude_code_bare_and_default_with_a_tool_round_trip(srv, work, tmp_path):
    # --bare: thinking (adaptive) on, three tools, stream-json
    events = _claude(srv, work, tmp_path, "--bare", "say hi")
    blocks = [b["type"] for e in events if e["type"] == "assistant"
              for b in e["message"]["content"]]
    assert blocks == ["thinking", "text"], blocks
    # default mode (a system message inside messages; /v1/messages?beta=true), its own
    # short system prompt and one tool: the model calls Read, Claude Code runs it and
    # sends the file back as a tool_result, the model answers
    events = _claude(srv, work, tmp_path, "CALL_TOOL: read hello.txt",
                     "--system-prompt", "Be terse.", "--tools", "Read",
                     "--allowedTools", "Read")
    uses = [b for e in events if e["type"] == "assistant" for b in e["message"]["content"]
            if b["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == [
        ("Read", {"file_path": str(work / "hello.txt")})]
    results = [b for e in events if e["type"] == "user"
               for b in (e["message"]["content"] if isinstance(e["message"]["content"], list)
                         else []) if b.get("type") == "tool_result"]
    assert len(results) == 1 and results[0]["tool_use_id"] == uses[0]["id"]
    assert FILE_TEXT in json.dumps(results[0]["content"])
    assert "?beta=true" in srv.output()


@_installed(CODEX)
def test_codex_exec_with_its_default_tools(srv, work, tmp_path):
    (tmp_path / "codex").mkdir()
    (tmp_path / "instructions.md").write_text("You are a coding agent. Be terse.\n")
    provider = (f'{{name="k3", base_url="{srv.url}/v1", env_key="K3_API_KEY", '
                'wire_api="responses", stream_idle_timeout_ms=1800000, '
                'request_max_retries=0, stream_max_retries=0}')
    env = _env(tmp_path, CODEX_HOME=str(tmp_path / "codex"), K3_API_KEY="dummy-key")
    # its default tools (functions, a namespace, web_search) as sent; only the long
    # base instructions are replaced, to keep the mini's prefill short
    rc, out, err = _run([str(CODEX), "exec", "--skip-git-repo-check", "--json",
                         "-m", "kimi-k3", "-c", 'model_provider="k3"',
                         "-c", f"model_providers.k3={provider}",
                         "-c", f'model_instructions_file="{tmp_path / "instructions.md"}"',
                         "-c", "analytics.enabled=false", "say hi"], env, work)
    events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    kinds = [e["type"] for e in events]
    assert rc == 0 and kinds[-1] == "turn.completed", (rc, out[-3000:], err[-3000:])
    said = [e["item"].get("text") for e in events if e["type"] == "item.completed"
            and e["item"]["type"] == "agent_message"]
    assert said == ["Hi."], events
    assert "web_search" in srv.output()  # dropped, with its notice


@_installed(AIDER)
def test_aider_chat_turn(srv, work, tmp_path):
    # aider's model table would be fetched from the internet: its own metadata file
    meta = tmp_path / "models.json"
    meta.write_text(json.dumps({"openai/kimi-k3": {
        "max_input_tokens": 8192, "max_output_tokens": 64, "input_cost_per_token": 0,
        "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}}))
    env = _env(tmp_path, OPENAI_API_BASE=srv.url + "/v1", OPENAI_API_KEY="dummy-key",
               LITELLM_LOCAL_MODEL_COST_MAP="True")
    rc, out, err = _run([str(AIDER), "--model", "openai/kimi-k3", "--model-metadata-file",
                         str(meta), "--no-git", "--yes-always", "--no-check-update",
                         "--analytics-disable", "--no-show-model-warnings", "--no-pretty",
                         "--no-stream", "--map-tokens", "0", "--message", "say hi"],
                        env, work)
    assert rc == 0 and "Hi." in out, (rc, out[-3000:], err[-3000:])
    assert "Error" not in out and "raw.githubusercontent" not in out + err, out[-3000:]
