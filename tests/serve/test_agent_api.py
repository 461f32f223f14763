"""Coding-agent APIs (issue 16): Anthropic Messages and OpenAI Responses, tool calls in
chat completions, prompt reuse across turns, the API key, through the real `anthropic`
and `openai` clients against the 2-rank server (mlx.launch on loopback).

The mini model does not call tools on its own, so the tool-call *output* path is
checked on K3-format generated text: relayed chunk fixtures (mlx-lm's kimi_k3 parser and
ToolCallFormatter), and the real handler, HTTP server and clients over a generator that
emits a fixed K3 tool call token by token (mlx-lm's tokenizer, text state machine and
parser). The 2-rank server tests check tools in, tool results back in, thinking, stop
sequences, refusals and prompt reuse end to end.
"""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

from k3dist.config.deployment import Deployment
from k3dist.serve import anthropic_api, auth, relay, responses_api

import pytest
from mlx_lm.server import ToolCallFormatter
from mlx_lm.tool_parsers.kimi_k3 import parse_tool_call
from mlx_lm.utils import load_tokenizer
from serving import Server, check_alive, token_log, wait_logs
from util import load_f32

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

TOOLS_A = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
TOOLS_R = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather.",
        "parameters": TOOLS_A[0]["input_schema"],
    }
]
TOOLS_C = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "x",
            "parameters": TOOLS_A[0]["input_schema"],
        },
    }
]
# What K3 writes when it calls a tool (its XTML tools section).
K3_CALL = (
    '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
    'type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>'
)


# -- translation, on generated text (no server) --------------------------------------


def _chunks(tool_text: str) -> list[dict]:
    """The chat-completion chunks mlx-lm's handler streams for a generation that
    thinks, writes, then calls a tool (its parser and formatter, as in the server)."""
    calls = ToolCallFormatter(parse_tool_call, TOOLS_C, streaming=True)([tool_text])
    delta = [
        {"reasoning": "Let me"},
        {"reasoning": " look."},
        {"content": "Checking"},
        {"content": " now."},
        {"tool_calls": calls},
    ]
    out = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in delta]
    out.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    out.append(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 50,
                "completion_tokens": 20,
                "prompt_tokens_details": {"cached_tokens": 30},
            },
        }
    )
    return out


def _relay(translator, chunks) -> bytes:
    out = io.BytesIO()
    sink = relay.Relay(out, translator)
    sink.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
    for c in chunks:
        sink.write(f"data: {json.dumps(c)}\n\n".encode())
    sink.write(b"data: [DONE]\n\n")
    sink.end()
    return out.getvalue()


def _events(raw: bytes) -> list[dict]:
    body = raw.split(b"\r\n\r\n", 1)[1].decode()
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]


def _json_body(raw: bytes) -> dict:
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.0 200") and f"Content-Length: {len(body)}".encode() in head
    return json.loads(body)


def test_tool_call_text_relayed_as_anthropic_and_responses():
    from anthropic.types import Message
    from openai.types.responses import Response

    kw = {"model": "kimi-k3", "prompt_tokens": 50}
    # Anthropic, not streamed: thinking, text and tool_use blocks, usage split by cache
    msg = Message.model_validate(
        _json_body(_relay(anthropic_api.MessagesTranslator(stream=False, **kw), _chunks(K3_CALL)))
    )
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Let me look." and msg.content[1].text == "Checking now."
    assert msg.content[2].name == "get_weather" and msg.content[2].input == {"city": "Paris"}
    assert msg.stop_reason == "tool_use"
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == (
        20,
        30,
        20,
    )
    # Anthropic, streamed: the documented event order, accumulated by the SDK's own code
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    events = _events(_relay(anthropic_api.MessagesTranslator(stream=True, **kw), _chunks(K3_CALL)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    snapshot, bufs = anthropic.types.Message.model_validate(events[0]["message"]), {}
    for e in events[2:]:  # after message_start and ping (the SDK skips pings)
        snapshot = accumulate_event(
            event=TypeAdapter(RawMessageStreamEvent).validate_python(e),
            current_snapshot=snapshot,
            json_bufs=bufs,
        )
    assert snapshot.content[2].input == {"city": "Paris"} and snapshot.stop_reason == "tool_use"
    assert snapshot.content[0].thinking == "Let me look."

    # Responses, not streamed and streamed
    t = responses_api.ResponsesTranslator(stream=False, **kw)
    resp = Response.model_validate(_json_body(_relay(t, _chunks(K3_CALL))))
    assert [o.type for o in resp.output] == ["reasoning", "message", "function_call"]
    call = resp.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert resp.status == "completed" and resp.usage.input_tokens_details.cached_tokens == 30
    events = _events(_relay(responses_api.ResponsesTranslator(stream=True, **kw), _chunks(K3_CALL)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "response.function_call_arguments.done" in kinds
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "message", "function_call"]
    assert Response.model_validate(events[-1]["response"]).output[2].arguments == call.arguments


def test_requests_translate_to_chat_and_malformed_ones_are_refused():
    chat = anthropic_api.to_chat(
        {
            "model": "kimi-k3",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "S"}],
            "thinking": {"type": "enabled", "budget_tokens": 64},
            "tools": TOOLS_A,
            "tool_choice": {"type": "any"},
            "stop_sequences": ["END"],
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": ""},
                        {
                            "type": "tool_use",
                            "id": "tu1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "tu1", "content": "sunny"},
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
    )
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert chat["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert chat["messages"][2]["reasoning_content"] == "hm"
    assert chat["chat_template_kwargs"] == {"thinking": True, "tool_choice": "required"}
    assert chat["stop"] == ["END"] and chat["tools"][0]["function"]["name"] == "get_weather"

    chat, _ = responses_api.to_chat(
        {
            "model": "kimi-k3",
            "instructions": "S",
            "tools": TOOLS_R,
            "reasoning": {"effort": "none"},
            "input": [
                {"role": "user", "content": "weather?"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
        }
    )
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["chat_template_kwargs"] == {"thinking": False}

    user = [{"role": "user", "content": "hi"}]
    for body, needle in (
        ({"model": "m", "messages": user}, "max_tokens"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
            "messages.0.role",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}],
                    }
                ],
            },
            "answers no tool_use",
        ),
        ({"model": "m", "max_tokens": "5", "messages": user}, "max_tokens"),
    ):
        with pytest.raises(relay.BadRequest, match=needle):
            anthropic_api.to_chat(body)
    for body, needle in (
        ({"model": "m", "input": "hi", "previous_response_id": "r1"}, "keeps no"),
        (
            {
                "model": "m",
                "input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}],
            },
            "answers no function_call",
        ),
        ({"model": "m", "input": [{"role": "wizard", "content": "x"}]}, "input.0"),
    ):
        with pytest.raises(relay.BadRequest, match=needle):
            responses_api.to_chat(body)


def test_api_key_file_and_headers(tmp_path):
    f = tmp_path / "key"
    f.write_text("s3cret-key-123\n")
    key = auth.load_key(None, str(f))
    assert key == "s3cret-key-123"
    assert auth.allowed({"Authorization": "Bearer s3cret-key-123"}, key)
    assert auth.allowed({"x-api-key": "s3cret-key-123"}, key)
    assert not auth.allowed({"x-api-key": "s3cret-key-124"}, key)
    assert not auth.allowed({}, key) and auth.allowed({}, None)
    with pytest.raises(FileNotFoundError, match="api_key_file"):
        auth.load_key(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not both"):
        auth.load_key("abcdefgh", str(f))


# -- the 2-rank server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(shared):
    s = shared.get("text", __name__)  # read also by test_server (serving.SHARED)
    yield s
    check_alive(s, f"after {__name__}")


def _anthropic(srv, key: str = "none"):
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


def _openai(srv, key: str = "none"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _post(url: str, body, headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _alive(srv) -> None:
    r = _openai(srv).chat.completions.create(
        model="kimi-k3", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert r.usage.completion_tokens >= 1


def test_anthropic_messages_end_to_end(srv, ranks):
    a = _anthropic(srv)  # this SDK sends no temperature: the server's default, greedy
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    # thinking off (the Messages default): text only; streamed == not streamed
    r = a.messages.create(model="kimi-k3", max_tokens=12, messages=user, tools=TOOLS_A)
    assert r.content and {b.type for b in r.content} <= {"text", "tool_use"}
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with a.messages.stream(model="kimi-k3", max_tokens=12, messages=user, tools=TOOLS_A) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in r.content]
    assert streamed.usage.output_tokens == r.usage.output_tokens
    # thinking on: the think channel comes back as a thinking block
    th = a.messages.create(
        model="kimi-k3",
        max_tokens=12,
        messages=user,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert th.content[0].type == "thinking" and th.content[0].thinking
    # count_tokens: what create reports as its prompt
    n = a.messages.count_tokens(model="kimi-k3", messages=user, tools=TOOLS_A).input_tokens
    assert n == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    # tool round trip: the tool_use and its tool_result go back in; streamed and not
    turn = [
        *user,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C and sunny"}
            ],
        },
    ]
    back = a.messages.create(model="kimi-k3", max_tokens=8, messages=turn, tools=TOOLS_A)
    assert back.usage.input_tokens + back.usage.cache_read_input_tokens > n
    with a.messages.stream(model="kimi-k3", max_tokens=8, messages=turn, tools=TOOLS_A) as s:
        assert [b.text for b in s.get_final_message().content] == [b.text for b in back.content]

    # stop sequences: a word the model writes ends the message before it
    tok = load_tokenizer(ranks.format(rank=0))
    seen = len(token_log(srv, 0))
    long = a.messages.create(model="kimi-k3", max_tokens=16, messages=user)
    tokens = wait_logs(srv, seen, 1)[0][0]["tokens"]
    stop = next(
        w
        for t in tokens[2:]
        if len((w := tok.decode([t])).strip()) >= 3
        and w.strip().isalpha()
        and tok.encode(w, add_special_tokens=False) == [t]
    )
    cut = a.messages.create(model="kimi-k3", max_tokens=16, messages=user, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert long.content[0].text.startswith(cut.content[0].text) and stop not in cut.content[0].text

    # malformed bodies: 4xx in Anthropic's shape, and the server keeps serving
    url = srv.url + "/v1/messages"
    for body, status in (
        ({"model": "kimi-k3", "messages": user}, 400),  # no max_tokens
        (
            {"model": "kimi-k3", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
            400,
        ),  # bad role
        (
            {
                "model": "kimi-k3",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}
                        ],
                    }
                ],
            },
            400,
        ),
        ({"model": "org/other-model", "max_tokens": 5, "messages": user}, 404),
        ({"model": "kimi-k3", "max_tokens": 10**9, "messages": user}, 400),
        (b"{not json", 400),
        ([1, 2], 400),
    ):
        code, err = _post(url, body)
        assert code == status and err["type"] == "error", (body, code, err)
        assert err["error"]["type"] in ("invalid_request_error", "not_found_error")
        assert err["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        a.messages.create(model="kimi-k3", max_tokens=10**9, messages=user)
    _alive(srv)


def _claude_default_body(query: str, recovery: int) -> dict:
    """A request shaped as Claude Code's default mode sends it: system blocks (its billing
    header first), tools, the first user message, then a system message (its environment)
    last; on each max-token recovery it drops the thinking-only answer and appends its
    resume line to the first user message, which comes before that system message."""
    resume = "Output token limit hit. Resume directly."
    return {
        "model": "kimi-k3",
        "max_tokens": 2,
        "thinking": {"type": "adaptive"},
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=1; n={recovery};"},
            {"type": "text", "text": "You are an agent for system-last chats. Be terse."},
        ],
        "tools": TOOLS_A,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": query + ("\n" if recovery else "")},
                    *([{"type": "text", "text": resume}] * recovery),
                ],
            },
            {"role": "system", "content": "# Environment\n - Platform: linux\n" * 8},
        ],
    }


def test_system_last_chat_keeps_its_system_prompt_for_the_recovery(srv, ranks):
    # Claude Code's default mode: each recovery changes the first user message, before
    # the closing system message; the system prompt and tools before it are reused
    a = _anthropic(srv)
    first = a.messages.create(**_claude_default_body("List the files here.", 0))
    again = a.messages.create(**_claude_default_body("List the files here.", 1))
    # where the server cuts: the system prompt and tools, as rendered before a user turn
    tok = load_tokenizer(ranks.format(rank=0))
    chat = anthropic_api.to_chat(_claude_default_body("List the files here.", 1))
    kw = {"tools": chat["tools"], **chat["chat_template_kwargs"]}
    head = tok.apply_chat_template(
        [chat["messages"][0], {"role": "user", "content": ""}], add_generation_prompt=False, **kw
    )
    prompt = tok.apply_chat_template(chat["messages"], add_generation_prompt=True, **kw)
    n = next(i for i, (x, y) in enumerate(zip(head, prompt, strict=False)) if x != y)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(prompt)
    assert again.usage.cache_read_input_tokens == n > 100, (again.usage, n, first.usage)


def test_openai_responses_end_to_end(srv):
    o = _openai(srv)
    r = o.responses.create(
        model="kimi-k3",
        input="What is the weather in Paris?",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,
        reasoning={"effort": "none"},
    )
    assert [i.type for i in r.output] == ["message"] and r.output_text
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1
    s = o.responses.create(
        model="kimi-k3",
        input="What is the weather in Paris?",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0,
        reasoning={"effort": "none"},
        stream=True,
    )
    events = list(s)
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert events[-1].response.output_text == r.output_text
    # reasoning on: a reasoning item first
    th = o.responses.create(
        model="kimi-k3", input="Hi", max_output_tokens=4, temperature=0, reasoning={"effort": "low"}
    )
    assert th.output[0].type == "reasoning" and th.output[0].content[0].text
    # a function_call and its output go back in, streamed and not
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]
    back = o.responses.create(
        model="kimi-k3", input=items, tools=TOOLS_R, max_output_tokens=8, temperature=0
    )
    streamed = list(
        o.responses.create(
            model="kimi-k3",
            input=items,
            tools=TOOLS_R,
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    assert streamed[-1].response.output_text == back.output_text
    # refused: no state kept, an orphan function_call_output, an unknown model
    for kwargs, needle in (
        ({"input": "hi", "previous_response_id": "resp_1"}, "keeps no"),
        ({"input": items[2:]}, "answers no function_call"),
    ):
        with pytest.raises(openai.BadRequestError, match=needle):
            o.responses.create(model="kimi-k3", **kwargs)
    with pytest.raises(openai.NotFoundError):
        o.responses.create(model="/etc/some/path", input="hi")
    _alive(srv)


def test_chat_completions_tools_and_prompt_reuse(srv, mini_build):
    c = _openai(srv)
    msgs = [
        {
            "role": "system",
            "content": "You answer with tools. "
            + " ".join(f"Note {i}: item {i} weighs {3 * i} kg." for i in range(25)),
        },
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    kw = {
        "model": "kimi-k3",
        "max_tokens": 6,
        "temperature": 0,
        "tools": TOOLS_C,
        "extra_body": {"chat_template_kwargs": {"thinking": False}},
    }
    seen = len(token_log(srv, 0))
    r1 = c.chat.completions.create(messages=msgs, **kw)
    # tools in; the assistant's tool call and the tool's answer back in, streamed and not
    turn = [
        *msgs,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    r2 = c.chat.completions.create(messages=turn, **kw)
    chunks = list(
        c.chat.completions.create(
            messages=turn, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == (r2.choices[0].message.content or "")
    # prompt reuse: turn 2 starts with turn 1's prompt, prefilled once; the same prompt
    # again reuses all but its last token
    p1, p2 = r1.usage.prompt_tokens, r2.usage.prompt_tokens
    assert r1.usage.prompt_tokens_details.cached_tokens < p1 // 2
    assert r2.usage.prompt_tokens_details.cached_tokens >= p1 - 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == p2 - 1
    logs = wait_logs(srv, seen, 3)
    assert logs[0] == logs[1]  # both ranks: the same tokens and the same cached counts
    assert [e["cached"] for e in logs[0]] == [
        r1.usage.prompt_tokens_details.cached_tokens,
        r2.usage.prompt_tokens_details.cached_tokens,
        p2 - 1,
    ]
    # and the reused cache gives what a fresh single-process run gives
    assert logs[0][1]["tokens"] == _greedy(mini_build, turn, 6)
    _alive(srv)


def _greedy(build, messages, max_tokens: int) -> list[int]:
    """Single-process mlx-lm, no cache reuse: the tokens the server must give."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _ = load_f32(build)
    tok = load_tokenizer(build)
    prompt = tok.apply_chat_template(
        messages, tools=TOOLS_C, add_generation_prompt=True, tokenize=True, thinking=False
    )
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        out.append(int(t))
        if out[-1] in tok.eos_token_ids:
            break
    return out


KEY = "k3-test-key-0123456789"


@pytest.fixture(scope="module")
def keyed(ranks, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-keyed")
    (tmp / "key").write_text(KEY + "\n")
    s = Server(ranks, tmp, ("--api-key-file", str(tmp / "key"), "--no-warmup"))
    yield s
    s.stop()


def _listen_addresses(port: int) -> set[str]:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                out.add(addr)
    return out


def test_api_key_required_everywhere_but_health_and_localhost_only(keyed):
    assert _listen_addresses(keyed.port) == {"0100007F"}  # 127.0.0.1 only
    # rank 0 prints it before serving; mlx.launch relays its output with a lag
    deadline = time.time() + 30
    while "API key required" not in keyed.output() and time.time() < deadline:
        time.sleep(0.2)
    assert "API key required" in keyed.output()
    chat = {"model": "kimi-k3", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    posts = {
        "/v1/chat/completions": chat,
        "/chat/completions": chat,
        "/v1/completions": {"model": "kimi-k3", "prompt": "x", "max_tokens": 2},
        "/v1/messages": chat,
        "/v1/messages/count_tokens": chat,
        "/v1/responses": {"model": "kimi-k3", "input": "x"},
        "/v1/nothing": {},
    }
    for headers in (
        {},
        {"Authorization": "Bearer wrong-key-000"},
        {"x-api-key": "wrong"},
        {"Authorization": KEY},
    ):
        for path, body in posts.items():
            code, err = _post(keyed.url + path, body, headers)
            assert code == 401, (path, headers, code)
            if path.startswith("/v1/messages"):
                assert err["error"]["type"] == "authentication_error"
            else:
                assert err["error"]["code"] == "invalid_api_key"
        for path in ("/v1/models", "/v1/k3dist", "/v1/nothing", "/metrics", "/status/placement"):
            req = urllib.request.Request(keyed.url + path, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
    with urllib.request.urlopen(keyed.url + "/health", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(anthropic.AuthenticationError):
        _anthropic(keyed, "wrong").messages.create(
            model="kimi-k3", max_tokens=2, messages=chat["messages"]
        )
    # with the key: each client's own header
    assert (
        _anthropic(keyed, KEY)
        .messages.create(model="kimi-k3", max_tokens=2, messages=chat["messages"])
        .content
    )
    assert (
        _openai(keyed, KEY).responses.create(model="kimi-k3", input="x", max_output_tokens=2).output
    )
    assert [m.id for m in _openai(keyed, KEY).models.list().data] == ["kimi-k3"]
    # /metrics takes the same key; the status page's files carry no data and need none
    req = urllib.request.Request(keyed.url + "/metrics", headers={"x-api-key": KEY})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert b"k3dist_requests_total" in r.read()
    with urllib.request.urlopen(keyed.url + "/status", timeout=10) as r:
        assert b"status/app.js" in r.read()


# -- tool calls out, through the real handler (a generator that writes K3 tool calls) ---


# the scripted server's deployment (in this process, one rank)
SCRIPTED = Deployment(
    max_tokens=64,
    temperature=0.0,
    prefill_chunk=32,
    cors_origins=["https://app.example"],
    max_queued_requests=4,
)


class ScriptedGenerator:
    """mlx-lm's ResponseGenerator interface, "generating" a fixed K3 text token by token
    (the real tokenizer, detokenizer, text state machine and tool parser): the handler,
    relay and clients are the server's own; only the model's choice of tokens is fixed,
    since the mini model does not call tools."""

    def __init__(self, tokenizer, text: str):
        from k3dist.serve import server

        self.tok, self.text = tokenizer, text
        self.cli_args = server.cli_args(SCRIPTED)
        self.model_provider = type("P", (), {"tokenizer": tokenizer})()

    def generation_available(self) -> bool:
        return True

    def tokenize(self, request, chat_template_kwargs):
        """The handler's one tokenization of the prompt (K3ResponseGenerator's)."""
        from k3dist.serve.lockstep import Prompt

        ids = self.tok.apply_chat_template(
            request.messages,
            tools=request.tools,
            add_generation_prompt=True,
            tokenize=True,
            **(chat_template_kwargs or {}),
        )
        return Prompt(**vars(request), tokenized=(ids, [ids], ["assistant"], "normal", None))

    def generate(self, request, args, progress_callback=None):
        from mlx_lm.generate import make_text_state_machine
        from mlx_lm.server import GenerationContext, Response

        tok = self.tok
        prompt = request.tokens
        ctx = GenerationContext(
            has_tool_calling=True,
            has_thinking=True,
            tool_parser=tok.tool_parser,
            text_sm=make_text_state_machine(tok, args.stop_words),
            initial_state="normal",
            prompt=prompt,
            prompt_cache_count=0,
        )
        ids = tok.encode(self.text, add_special_tokens=False) + [min(tok.eos_token_ids)]

        def run():
            detok = tok.detokenizer
            detok.reset()
            for i, t in enumerate(ids):
                detok.add_token(t)
                last = i == len(ids) - 1
                yield Response(detok.last_segment, t, 0.0, "stop" if last else None, ())

        return ctx, run()


@pytest.fixture(scope="module")
def scripted(mini_build):
    import threading

    from k3dist.serve import server

    tok = load_tokenizer(mini_build)
    text = (
        "Checking.<|close|>response<|sep|><|open|>tools<|sep|>"
        + K3_CALL
        + "<|close|>tools<|sep|><|close|>message<|sep|>"
    )
    gen = ScriptedGenerator(tok, text)
    handler = server.handler_class(SCRIPTED, tok.vocab_size)
    httpd = server.K3HTTPServer(
        ("127.0.0.1", 0),
        lambda *a, **k: handler(gen, *a, system_fingerprint="test", **k),
        max_connections=8,
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield type("S", (), {"url": f"http://127.0.0.1:{httpd.server_address[1]}"})()
    httpd.shutdown()


def test_tool_calls_out_on_every_api_streamed_and_not(scripted):
    c, a = _openai(scripted), _anthropic(scripted)
    user = [{"role": "user", "content": "Weather in Paris?"}]
    kw = {"extra_body": {"chat_template_kwargs": {"thinking": False}}}
    # chat completions: tool_calls, streamed and not
    r = c.chat.completions.create(model="kimi-k3", messages=user, tools=TOOLS_C, **kw)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(
        c.chat.completions.create(model="kimi-k3", messages=user, tools=TOOLS_C, stream=True, **kw)
    )
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # Anthropic: a tool_use block, stop_reason tool_use; streamed and not
    m = a.messages.create(model="kimi-k3", max_tokens=64, messages=user, tools=TOOLS_A)
    use = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use[0].input == {"city": "Paris"}
    with a.messages.stream(model="kimi-k3", max_tokens=64, messages=user, tools=TOOLS_A) as s:
        sm = s.get_final_message()
    assert [(b.name, b.input) for b in sm.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Paris"})
    ] and sm.stop_reason == "tool_use"
    # the round trip: that tool_use answered by a tool_result is accepted
    back = a.messages.create(
        model="kimi-k3",
        max_tokens=64,
        tools=TOOLS_A,
        messages=[
            *user,
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "18 C"}],
            },
        ],
    )
    assert back.stop_reason == "tool_use"
    # Responses: a function_call item; streamed and not
    o = c.responses.create(
        model="kimi-k3", input="Weather in Paris?", tools=TOOLS_R, reasoning={"effort": "none"}
    )
    fc = [i for i in o.output if i.type == "function_call"][0]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    events = list(
        c.responses.create(
            model="kimi-k3",
            input="Weather in Paris?",
            tools=TOOLS_R,
            reasoning={"effort": "none"},
            stream=True,
        )
    )
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(x) for x in done] == [{"city": "Paris"}]
    back = c.responses.create(
        model="kimi-k3",
        tools=TOOLS_R,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": fc.call_id,
                "name": fc.name,
                "arguments": fc.arguments,
            },
            {"type": "function_call_output", "call_id": fc.call_id, "output": "18 C"},
        ],
    )
    assert back.status == "completed"
    # the relayed answers carry the configured CORS headers, streamed and not
    for stream in (False, True):
        req = urllib.request.Request(
            scripted.url + "/v1/messages",
            data=json.dumps(
                {"model": "kimi-k3", "max_tokens": 8, "messages": user, "stream": stream}
            ).encode(),
            headers={"Content-Type": "application/json", "Origin": "https://app.example"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
            assert "x-api-key" in r.headers["Access-Control-Allow-Headers"]
            r.read()


def test_prompt_cache_bound_by_tokens_and_exact_hits_keep_a_token():
    """Rank-independent eviction (entries and tokens, never bytes); a prompt whose exact
    cache is held still prefills a token (KDA state cannot be trimmed back)."""
    from k3dist.serve.prompt_cache import K3PromptCache

    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache

    def filled(n: int) -> list:
        c = [KVCache(), ArraysCache(1)]
        k = mx.zeros((1, 1, n, 4))
        c[0].update_and_fetch(k, k)
        c[1][0] = mx.full((1, 2), n)
        return c

    pc = K3PromptCache(8, lambda: [KVCache(), ArraysCache(1)], max_tokens=25)
    pc.insert_cache("m", list(range(10)), filled(10))
    pc.insert_cache("m", list(range(100, 112)), filled(12))
    pc.insert_cache("m", list(range(200, 206)), filled(6))  # 28 > 25 tokens: one goes
    assert (len(pc), pc.tokens()) == (2, 18)
    cache, rest = pc.fetch_nearest_cache("m", list(range(100, 115)))
    assert cache[0].offset == 12 and rest == [112, 113, 114]
    cache, rest = pc.fetch_nearest_cache("m", list(range(100, 112)))  # exact: not usable
    assert cache[0].offset == 0 and len(rest) == 12
    pc.insert_cache("m", list(range(100, 111)), filled(11))  # a snapshot one token short
    cache, rest = pc.fetch_nearest_cache("m", list(range(100, 112)))
    assert cache[0].offset == 11 and rest == [111]
