"""Real coding agents, unmodified (issue 28): Claude Code (headless, stream-json; default
mode and --bare), Codex `exec` with its default tools, and aider each complete a turn
against the 2-rank mini server (mlx.launch on loopback); Claude Code makes a tool round
trip (Read: tool_use out, the file's text back in as tool_result, then the answer).

Each client is started by its recipe in docs/serving.md, the block whose marker names
the test, run with bash as printed: only the server's URL is substituted
(http://10.10.0.1:8080 -> the test server's), HOME is a fresh folder whose
``~/.k3dist-key`` holds the server's key (the server checks it), and the test's prompt and
its own flags are appended to the recipe's last line (the client's command); aider's
``models.json`` is the doc's JSON block as printed. The environment adds only what keeps
a client off the network (telemetry, update checks) and, for Claude Code, a small output
limit for the mini's context.

The mini's weights are random, so the server runs with scripted token choice
(tests/scripts/serve_scripted.py: the real model on every rank in lockstep, each token
forced): a short answer that ends its message, or a K3 tool call when asked. The
clients are the registry packages `.ci/run` installs (`.agents/` from npm,
`.venv-aider/` from PyPI); a test skips only when its client is not installed. Each
client has only 127.0.0.1 to talk to.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import doc_blocks
import pytest
from serving import Server
from util import REPO

CLAUDE = REPO / ".agents/node_modules/.bin/claude"
CODEX = REPO / ".agents/node_modules/.bin/codex"
AIDER = REPO / ".venv-aider/bin/aider"
FILE_TEXT = "hello from the file"
KEY = "k3-agent-test-key-0123456789"
RECIPES = REPO / "docs" / "serving.md"
RECIPE_URL = "http://10.10.0.1:8080"  # the recipes' server; the test server's URL here


def _installed(p: Path):
    return pytest.mark.skipif(
        not p.exists(), reason=f"{p.relative_to(REPO)} is not installed (.ci/run installs it)"
    )


def k3_call(name: str, args: dict[str, str]) -> str:
    """K3's text for one call of a tool with string arguments."""
    a = "".join(
        f'<|open|>argument key="{k}" type="string"<|sep|>{v}<|close|>argument<|sep|>'
        for k, v in args.items()
    )
    return f'<|open|>call tool="{name}" index="1"<|sep|>{a}<|close|>call<|sep|>'


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("agent-work")
    (d / "hello.txt").write_text(FILE_TEXT + "\n")
    return d


@pytest.fixture(scope="module")
def srv(ranks, work, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-clients")
    key = tmp / "key"
    key.write_text(KEY + "\n")
    calls = tmp / "tool-calls.json"
    calls.write_text(
        json.dumps(
            {
                "Read": k3_call("Read", {"file_path": str(work / "hello.txt")}),
                "exec_command": k3_call("exec_command", {"cmd": "cat hello.txt"}),
            }
        )
    )
    s = Server(
        ranks,
        tmp,
        (
            "--tool-calls",
            str(calls),
            "--prompt-log",
            str(tmp / "prompts.txt"),
            "--max-context",
            "16384",
            "--prefill-chunk",
            "512",
            "--max-batch",
            "1",
            "--no-warmup",
            "--api-key-file",
            str(key),
        ),
        entry=REPO / "tests/scripts/serve_scripted.py",
    )
    yield s
    s.stop()


def _env(tmp: Path, **extra: str) -> dict:
    """A fresh HOME holding the server's key as ``~/.k3dist-key`` (what the recipes
    read), the clients on PATH as a user's install puts them."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    (home / ".k3dist-key").write_text(KEY + "\n")
    keep = {k: os.environ[k] for k in ("LANG", "TERM") if k in os.environ}
    path = f"{CLAUDE.parent}:{AIDER.parent}:{os.environ['PATH']}"
    return {**keep, "PATH": path, "HOME": str(home), "NO_PROXY": "127.0.0.1", **extra}


def recipe(test: str, lang: str = "sh") -> str:
    """docs/serving.md's block (of ``lang``) whose marker names ``test`` of this file."""
    found = doc_blocks.blocks_run_by(RECIPES, f"tests/serve/test_agent_clients.py::{test}")
    found = [b for b in found if b.lang == lang]
    assert len(found) == 1, f"docs/serving.md: one ```{lang} block marked for {test}"
    return found[0].body


def run_recipe(test: str, url: str, args: list[str], env: dict, cwd: Path):
    """The recipe as printed, its URL substituted, ``args`` appended to its last line."""
    body = recipe(test)
    assert RECIPE_URL in body, f"docs/serving.md: {test}'s recipe names {RECIPE_URL}"
    text = body.replace(RECIPE_URL, url).rstrip("\n") + " " + shlex.join(args) + "\n"
    return _run(["bash", "-ec", text], env, cwd)


def _run(cmd: list[str], env: dict, cwd: Path, timeout: float = 900):
    r = subprocess.run(
        cmd,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return r.returncode, r.stdout, r.stderr


def _claude(srv, work: Path, tmp: Path, *args: str) -> list[dict]:
    env = _env(
        tmp,
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        # the mini server's context is small: Claude Code asks 32000 by default
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="200",
    )
    rc, out, err = run_recipe(
        "test_claude_code_bare_and_default_with_a_tool_round_trip",
        srv.url,
        ["-p", *args, "--output-format", "stream-json", "--verbose"],
        env,
        work,
    )
    events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert events and events[-1]["type"] == "result", (rc, out[-3000:], err[-3000:])
    result = events[-1]
    assert rc == 0 and result["subtype"] == "success" and not result["is_error"], (
        result,
        err[-2000:],
        srv.output()[-3000:],
    )
    assert result["result"] == "Hi."
    return events


@_installed(CLAUDE)
def test_claude_code_bare_and_default_with_a_tool_round_trip(srv, work, tmp_path):
    # --bare: thinking (adaptive) on, three tools, stream-json
    events = _claude(srv, work, tmp_path, "--bare", "say hi")
    blocks = [
        b["type"] for e in events if e["type"] == "assistant" for b in e["message"]["content"]
    ]
    assert blocks == ["thinking", "text"], blocks
    # default mode (a system message inside messages; /v1/messages?beta=true), its own
    # short system prompt and one tool: the model calls Read, Claude Code runs it and
    # sends the file back as a tool_result, the model answers
    events = _claude(
        srv,
        work,
        tmp_path,
        "CALL_TOOL: read hello.txt",
        "--system-prompt",
        "Be terse.",
        "--tools",
        "Read",
        "--allowedTools",
        "Read",
    )
    uses = [
        b
        for e in events
        if e["type"] == "assistant"
        for b in e["message"]["content"]
        if b["type"] == "tool_use"
    ]
    assert [(u["name"], u["input"]) for u in uses] == [
        ("Read", {"file_path": str(work / "hello.txt")})
    ]
    results = [
        b
        for e in events
        if e["type"] == "user"
        for b in (e["message"]["content"] if isinstance(e["message"]["content"], list) else [])
        if b.get("type") == "tool_result"
    ]
    assert len(results) == 1 and results[0]["tool_use_id"] == uses[0]["id"]
    assert FILE_TEXT in json.dumps(results[0]["content"])
    assert "?beta=true" in srv.output()


def _codex(srv, work: Path, tmp: Path, prompt: str) -> list[dict]:
    tmp.mkdir(parents=True)
    (tmp / "instructions.md").write_text("You are a coding agent. Be terse.\n")
    env = _env(tmp)
    # its default tools (functions, a namespace, web_search) as sent; only the long
    # base instructions are replaced, to keep the mini's prefill short. No retries (a
    # failure shows as one); idle timeout 60 s: a prefill longer than that (minutes here
    # under load) must send progress events
    rc, out, err = run_recipe(
        "test_codex_exec_with_its_default_tools_and_a_tool_round_trip",
        srv.url,
        [
            "exec",
            "--skip-git-repo-check",
            "--json",
            "-c",
            "model_providers.k3.request_max_retries=0",
            "-c",
            "model_providers.k3.stream_max_retries=0",
            "-c",
            "model_providers.k3.stream_idle_timeout_ms=60000",
            "-c",
            f'model_instructions_file="{tmp / "instructions.md"}"',
            "-c",
            "analytics.enabled=false",
            prompt,
        ],
        env,
        work,
    )
    events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    kinds = [e["type"] for e in events]
    assert rc == 0 and kinds[-1] == "turn.completed", (rc, out[-3000:], err[-3000:])
    said = [
        e["item"].get("text")
        for e in events
        if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
    ]
    assert said == ["Hi."], events
    return events


@_installed(CODEX)
def test_codex_exec_with_its_default_tools_and_a_tool_round_trip(srv, work, tmp_path):
    # one Codex run (a run's first request prefills ~13k tokens of default tools, a
    # minute here): the model calls exec_command (Codex's default shell tool); Codex
    # runs it and sends its output back as a function_call_output; the model answers
    # as a plain turn does ("Hi.", which _codex checks)
    prompts = srv.tmp / "prompts.txt"
    seen = prompts.read_text() if prompts.exists() else ""
    events = _codex(srv, work, tmp_path / "tool", "CALL_TOOL: cat hello.txt")
    assert "web_search" in srv.output()  # dropped, with its notice
    runs = [
        e["item"]
        for e in events
        if e["type"] == "item.completed" and e["item"]["type"] == "command_execution"
    ]
    assert len(runs) == 1 and "cat hello.txt" in runs[0]["command"], events
    assert FILE_TEXT in runs[0]["aggregated_output"] and runs[0]["exit_code"] == 0, runs
    # what reached the model: the call's request, then the one with the command's output
    new = (prompts.read_text())[len(seen) :].split("<|end of prompt|>")[:-1]
    assert len(new) == 2 and 'role="tool"' not in new[0], new
    assert 'role="tool"' in new[1] and FILE_TEXT in new[1].split('role="tool"', 1)[1]


@_installed(AIDER)
def test_aider_chat_turn(srv, work, tmp_path):
    # aider's model table would be fetched from the internet: the doc's settings file,
    # as printed, where aider runs
    settings = recipe("test_aider_chat_turn", "json")
    assert json.loads(settings)["openai/kimi-k3"]["litellm_provider"] == "openai"
    (work / "models.json").write_text(settings)
    env = _env(tmp_path, LITELLM_LOCAL_MODEL_COST_MAP="True")
    rc, out, err = run_recipe(
        "test_aider_chat_turn",
        srv.url,
        [
            "--no-git",
            "--yes-always",
            "--no-check-update",
            "--analytics-disable",
            "--no-show-model-warnings",
            "--no-pretty",
            "--no-stream",
            "--map-tokens",
            "0",
            "--message",
            "say hi",
        ],
        env,
        work,
    )
    assert rc == 0 and "Hi." in out, (rc, out[-3000:], err[-3000:])
    assert "Error" not in out and "raw.githubusercontent" not in out + err, out[-3000:]


def test_scripted_server_calls_the_tool_of_its_flag(srv, work):
    """--tool-calls is in force without any agent client installed: the Anthropic SDK
    gets the scripted Read call as a tool_use block, then the answer after its result."""
    import anthropic

    client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)
    tools = [
        {
            "name": "Read",
            "description": "read a file",
            "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
        }
    ]
    ask = [{"role": "user", "content": "CALL_TOOL: read hello.txt"}]
    m = client.messages.create(model="kimi-k3", max_tokens=1024, tools=tools, messages=ask)
    use = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(use) == 1, m
    assert use[0].name == "Read" and use[0].input == {"file_path": str(work / "hello.txt")}
    done = client.messages.create(
        model="kimi-k3",
        max_tokens=1024,
        tools=tools,
        messages=[
            *ask,
            {"role": "assistant", "content": m.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use[0].id, "content": FILE_TEXT}
                ],
            },
        ],
    )
    assert done.stop_reason == "end_turn" and done.content[-1].text == "Hi.", done


def test_routes_ignore_the_query_and_answer_head_and_unknown_paths(srv):
    from serving import post_conn

    auth = {"Authorization": f"Bearer {KEY}"}
    hi = {
        "model": "kimi-k3",
        "max_tokens": 64,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "Mid-conversation note."},
        ],
    }
    status, _, body = post_conn(srv.port, hi, "/v1/messages/count_tokens?beta=true", auth)
    assert status == 200 and json.loads(body)["input_tokens"] > 0, body
    status, _, body = post_conn(srv.port, hi, "/v1/messages?beta=true&x=1", auth)
    assert status == 200 and json.loads(body)["content"][-1]["text"] == "Hi.", body
    # unknown paths: 404 in the API's shape (the body unread, no reset)
    status, _, body = post_conn(srv.port, hi, "/v1/messages/batches?beta=true", auth)
    err = json.loads(body)
    assert status == 404 and err["type"] == "error" and err["error"]["type"] == "not_found_error", (
        body
    )
    status, _, body = post_conn(srv.port, {"x": 1}, "/v1/nothing", auth)
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found", body
    # HEAD: GET's status and headers, no body
    for path, want in (
        ("/", 200),
        ("/health?probe=1", 200),
        ("/v1/models", 200),
        ("/v1/nothing", 404),
    ):
        status, headers, body = post_conn(srv.port, b"", path, auth, method="HEAD")
        assert status == want and body == b"", (path, status, body)
        assert int(headers["Content-Length"]) > 0
    status, _, body = post_conn(srv.port, b"", "/v1/models?limit=5", auth, method="GET")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "kimi-k3"


def test_agent_tool_kinds_and_system_messages_translate():
    from k3dist.serve import anthropic_api, relay, responses_api

    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    chat = anthropic_api.to_chat(
        {
            "model": "kimi-k3",
            "max_tokens": 8,
            "tools": [
                {"name": "Read", "input_schema": schema},
                {"name": "Grep", "input_schema": schema},
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
            ],
            "tool_choice": {"type": "tool", "name": "Grep"},
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "env"}]},
            ],
        }
    )
    assert [(m["role"], m["content"]) for m in chat["messages"]] == [
        ("user", "a"),
        ("system", "env"),
    ]
    assert [t["function"]["name"] for t in chat["tools"]] == ["Grep"]  # the named one
    assert chat["chat_template_kwargs"]["tool_choice"] == "required"
    for choice, needle in (
        ({"type": "tool", "name": "web_search"}, "not among"),
        ({"type": "tool"}, "not among"),
    ):
        with pytest.raises(relay.BadRequest, match=needle):
            anthropic_api.to_chat(
                {
                    "model": "m",
                    "max_tokens": 5,
                    "tool_choice": choice,
                    "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                    "messages": [{"role": "user", "content": "a"}],
                }
            )

    body = {
        "model": "kimi-k3",
        "input": "hi",
        "tools": [
            {"type": "function", "name": "exec_command", "parameters": schema},
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "d",
                "tools": [{"type": "function", "name": "spawn_agent", "parameters": schema}],
            },
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "Patch.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            },
            {"type": "web_search", "external_web_access": False},
        ],
    }
    chat, req = responses_api.to_chat(body)
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "exec_command",
        "spawn_agent",
        "apply_patch",
    ]
    assert "lark" in chat["tools"][2]["function"]["description"]
    t = responses_api.ResponsesTranslator(model="kimi-k3", stream=False, prompt_tokens=1)
    t.request = req
    spawn = {"kind": "tool_call", "id": "c1", "name": "spawn_agent", "arguments": "{}"}
    patch = {
        "kind": "tool_call",
        "id": "c2",
        "name": "apply_patch",
        "arguments": json.dumps({"input": "*** Begin Patch"}),
    }
    assert t._item(0, spawn, True)["namespace"] == "multi_agent_v1"
    item = t._item(1, patch, True)
    assert (item["type"], item["input"]) == ("custom_tool_call", "*** Begin Patch")
    # the custom call and its output come back in as a function call and a tool message
    chat, _ = responses_api.to_chat(
        dict(
            body,
            input=[
                {"role": "user", "content": "hi"},
                {
                    "type": "custom_tool_call",
                    "call_id": "c2",
                    "name": "apply_patch",
                    "input": "*** Begin Patch",
                },
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done"},
            ],
            tool_choice={"type": "function", "name": "exec_command"},
        )
    )
    assert chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
        "input": "*** Begin Patch"
    }
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "c2", "content": "Done"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command"]


def test_prefill_progress_reaches_agent_streams():
    """The handler's timed keep-alives during prefill (``Relay.beat``) become events the
    agents count as activity (Codex drops a stream idle for its stream_idle_timeout_ms):
    Anthropic's ping, Responses' response.in_progress; the stream's head and opening
    events go out at once (``Relay.open``), and not again when mlx-lm's head follows."""
    import io

    from k3dist.serve import anthropic_api, relay, responses_api

    for t, opening, kind in (
        (
            anthropic_api.MessagesTranslator(model="k", stream=True, prompt_tokens=1),
            "message_start",
            "ping",
        ),
        (
            responses_api.ResponsesTranslator(model="k", stream=True, prompt_tokens=1),
            "response.created",
            "response.in_progress",
        ),
    ):
        out = io.BytesIO()
        sink = relay.Relay(out, t)
        sink.beat()  # nothing before the stream is open
        assert out.getvalue() == b""
        sink.open()
        assert out.getvalue().startswith(b"HTTP/1.0 200 OK\r\n")
        typed = f'"type": "{kind}"'.encode()
        before = out.getvalue().count(typed)
        sink.beat()
        sink.beat()
        assert out.getvalue().count(typed) == before + 2, out.getvalue()
        sink.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        assert out.getvalue().count(f'"type": "{opening}"'.encode()) == 1, out.getvalue()
        assert out.getvalue().count(b"HTTP/1.0") == 1


def test_claude_codes_billing_header_is_not_prompt():
    """Claude Code's first system block changes with every request (its attribution
    header): left in, no two of its requests shared a prefix for the prompt cache."""
    from k3dist.serve import anthropic_api

    def body(header: str) -> dict:
        return {
            "model": "kimi-k3",
            "max_tokens": 8,
            "system": [
                {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; {header}"},
                {"type": "text", "text": "You are Claude Code."},
            ],
            "messages": [{"role": "user", "content": "hi"}],
        }

    a = anthropic_api.to_chat(body("cc_prev_msg=1;"))
    assert a == anthropic_api.to_chat(body("cc_prev_msg=2; cc_prev_turn_index=1;"))
    assert a["messages"][0] == {"role": "system", "content": "You are Claude Code."}
