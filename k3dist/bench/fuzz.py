"""Generated hostile input for the serving APIs (issue 28): property-based requests
(hypothesis) to ``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``,
``/v1/messages/count_tokens`` and ``/v1/responses``, and what every answer must be.

Bodies start from each API's schema (the Anthropic and Responses pydantic models'
JSON schemas; the chat and completion fields the server validates), then are mutated
outside it: wrong types, huge, negative and non-finite numbers, unicode, deep nesting,
empty and giant arrays, malformed tools, tool results and images, missing and unknown
keys, and raw bodies that are not JSON or not UTF-8. Every answer must be a 2xx with a
well-formed body (or a complete event stream) or a 4xx in that API's error shape: no
5xx, no reset. Generation stays cheap: token counts inside the valid range are made
small, and the server's own default (``--max-tokens``) should be small too.
"""

from __future__ import annotations

import copy
import http.client
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from k3dist.serve import anthropic_api, responses_api

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)
MODEL = "kimi-k3"
SMALL_TOKENS = 3  # what a valid token count becomes (generation stays cheap)
TOKEN_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
PNG_1PX = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAA"
    "AABJRU5ErkJggg=="
)

# -- values -------------------------------------------------------------------------

text = st.text(max_size=40)
hostile_text = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=60),
    st.sampled_from(
        [
            "",
            "\x00",
            "\ud7ff\ue000",
            "<|end_of_msg|>",
            "<|open|>tools<|sep|>",
            "{{ raise_exception('x') }}",
            "{% for x in y %}",
            "\u202e\u200b",
            "🙂" * 50,
            "a" * 5000,
            "<|im_end|>",
            "</think>",
            "\\u0000",
        ]
    ),
)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 1e308, -1e308, 0.5, 1e-320]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, hostile_text)


def deep(n: int) -> Any:
    v: Any = "x"
    for i in range(n):
        v = [v] if i % 2 else {"k": v}
    return v


hostile = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(text, scalars, max_size=4),
    st.integers(1, 200).map(deep),
    st.just([]),
    st.just({}),
    st.integers(100, 3000).map(lambda n: ["x"] * n),
    st.integers(100, 2000).map(lambda n: [{"type": "text", "text": "y"}] * n),
)

# -- schema-driven bodies ------------------------------------------------------------


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values that fit a pydantic JSON schema (the subset pydantic writes)."""
    if "$ref" in schema:
        return st.deferred(
            lambda: from_schema(defs[schema["$ref"].split("/")[-1]], defs, depth + 1)
        )
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, defs, depth) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        if not props:
            return st.dictionaries(text, scalars, max_size=3)
        required = set(schema.get("required", []))
        if depth > 4:  # keep bodies small: optional fields stop here
            props = {k: v for k, v in props.items() if k in required}
        return st.fixed_dictionaries(
            {k: from_schema(v, defs, depth + 1) for k, v in props.items() if k in required},
            optional={
                k: from_schema(v, defs, depth + 1) for k, v in props.items() if k not in required
            },
        )
    if kind == "array":
        return st.lists(
            from_schema(schema.get("items", {}), defs, depth + 1),
            min_size=schema.get("minItems", 0),
            max_size=3,
        )
    if kind == "string":
        return text
    if kind == "integer":
        return st.integers(schema.get("minimum", 0), 64)
    if kind == "number":
        return st.floats(schema.get("minimum", 0), schema.get("maximum", 2))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return scalars


def _pydantic(model) -> st.SearchStrategy:
    s = model.model_json_schema()
    return from_schema(s, s.get("$defs", {}))


tool_schema = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    st.dictionaries(text, hostile, max_size=3),
    hostile,
)
image_url = st.one_of(
    st.just(f"data:image/png;base64,{PNG_1PX}"),
    st.just("data:image/png;base64,!!!!"),
    st.just("data:image/png;base64," + "A" * 4000),
    st.just("http://127.0.0.1:9/x.png"),
    st.just("file:///etc/passwd"),
    st.just("data:text/plain;base64,aGk="),
    hostile_text,
)
chat_part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, image_url),
    st.dictionaries(text, hostile, max_size=2),
)
chat_message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "developer"]),
            "content": st.one_of(text, st.lists(chat_part, max_size=3)),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.none(),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": text,
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries(
                            {"name": text, "arguments": st.one_of(text, hostile)}
                        ),
                    }
                ),
                max_size=2,
            ),
        }
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "tool_call_id": text, "content": st.one_of(text, hostile)}
    ),
)
chat_tool = st.builds(
    lambda n, p: {"type": "function", "function": {"name": n, "description": "d", "parameters": p}},
    text,
    tool_schema,
)
sampling = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "seed": st.integers(0, 99),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4),
    "stream": st.booleans(),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 11),
    "presence_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 800).map(str), st.floats(-100, 100), max_size=3),
}
chat_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(chat_message, min_size=1, max_size=4)},
    optional={
        "max_tokens": st.integers(1, 64),
        "tools": st.lists(chat_tool, max_size=3),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["thinking", "tool_choice", "x"]), scalars, max_size=2
        ),
        **sampling,
    },
)
completion_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.one_of(text, hostile_text)},
    optional={"max_tokens": st.integers(1, 64), **sampling},
)
anthropic_block = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.builds(
        lambda u: {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": u},
        },
        st.sampled_from([PNG_1PX, "!!", ""]),
    ),
    st.builds(
        lambda i, c: {"type": "tool_result", "tool_use_id": i, "content": c},
        st.sampled_from(["toolu_1", "nope"]),
        st.one_of(text, hostile),
    ),
    st.builds(
        lambda i, x: {"type": "tool_use", "id": i, "name": "get_weather", "input": x},
        st.sampled_from(["toolu_1", "nope"]),
        st.one_of(st.just({"city": "Paris"}), hostile),
    ),
)
anthropic_tool = st.one_of(
    st.builds(
        lambda n, s: {"name": n, "description": "d", "input_schema": s},
        st.text(min_size=1, max_size=12),
        tool_schema,
    ),
    st.just({"type": "web_search_20250305", "name": "web_search", "max_uses": 1}),
    st.just({"type": "bash_20250124", "name": "bash"}),
)
messages_body = st.one_of(
    _pydantic(anthropic_api.MessagesRequest),
    st.fixed_dictionaries(
        {
            "model": st.just(MODEL),
            "max_tokens": st.integers(1, 64),
            "messages": st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["user", "assistant", "system"]),
                        "content": st.one_of(text, st.lists(anthropic_block, max_size=3)),
                    }
                ),
                min_size=1,
                max_size=4,
            ),
        },
        optional={
            "system": st.one_of(
                text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), max_size=2)
            ),
            "tools": st.lists(anthropic_tool, max_size=3),
            "tool_choice": st.one_of(
                st.sampled_from(
                    [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool"}]
                ),
                st.builds(
                    lambda n: {"type": "tool", "name": n},
                    st.sampled_from(["get_weather", "web_search", "x"]),
                ),
            ),
            "thinking": st.sampled_from(
                [
                    {"type": "enabled", "budget_tokens": 1024},
                    {"type": "adaptive"},
                    {"type": "disabled"},
                ]
            ),
            "stream": st.booleans(),
            "temperature": st.floats(0, 1),
            "stop_sequences": st.lists(st.text(min_size=1, max_size=5), max_size=3),
        },
    ),
)
responses_tool = st.one_of(
    st.builds(
        lambda n, p: {"type": "function", "name": n, "parameters": p},
        st.text(min_size=1, max_size=12),
        tool_schema,
    ),
    st.just({"type": "web_search"}),
    st.just({"type": "file_search", "vector_store_ids": []}),
    st.builds(
        lambda n: {
            "type": "namespace",
            "name": "ns",
            "tools": [{"type": "function", "name": n, "parameters": {"type": "object"}}],
        },
        st.text(min_size=1, max_size=12),
    ),
    st.just(
        {
            "type": "custom",
            "name": "apply_patch",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
        }
    ),
    st.just({"type": "namespace", "tools": "nope"}),
)
responses_item = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "developer", "system"]),
            "content": st.one_of(
                text,
                st.lists(st.builds(lambda t: {"type": "input_text", "text": t}, text), max_size=2),
            ),
        }
    ),
    st.builds(
        lambda c, a: {"type": "function_call", "call_id": c, "name": "f", "arguments": a},
        st.sampled_from(["c1", "c2"]),
        st.one_of(st.just('{"a": 1}'), text),
    ),
    st.builds(
        lambda c, o: {"type": "function_call_output", "call_id": c, "output": o},
        st.sampled_from(["c1", "c2"]),
        st.one_of(text, hostile),
    ),
    st.builds(
        lambda c, i: {"type": "custom_tool_call", "call_id": c, "name": "apply_patch", "input": i},
        st.sampled_from(["c1", "c3"]),
        text,
    ),
    st.builds(
        lambda c, o: {"type": "custom_tool_call_output", "call_id": c, "output": o},
        st.sampled_from(["c1", "c3"]),
        text,
    ),
    st.just({"type": "reasoning", "summary": [], "encrypted_content": None}),
)
responses_body = st.one_of(
    _pydantic(responses_api.ResponsesRequest),
    st.fixed_dictionaries(
        {
            "model": st.just(MODEL),
            "input": st.one_of(text, st.lists(responses_item, min_size=1, max_size=4)),
        },
        optional={
            "instructions": text,
            "max_output_tokens": st.integers(1, 64),
            "tools": st.lists(responses_tool, max_size=3),
            "tool_choice": st.one_of(
                st.sampled_from(["auto", "none", "required"]),
                st.builds(lambda n: {"type": "function", "name": n}, st.sampled_from(["f", "x"])),
            ),
            "reasoning": st.sampled_from(
                [{"effort": "none"}, {"effort": "low"}, {"summary": "auto"}]
            ),
            "stream": st.booleans(),
            "temperature": st.floats(0, 2),
            "store": st.booleans(),
            "include": st.just(["reasoning.encrypted_content"]),
        },
    ),
)
BODIES = {
    "/v1/chat/completions": chat_body,
    "/v1/completions": completion_body,
    "/v1/messages": messages_body,
    "/v1/messages/count_tokens": messages_body,
    "/v1/responses": responses_body,
}

# -- mutations outside the schema ------------------------------------------------------


def _paths(v: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*prefix, k))
    elif isinstance(v, list):
        for i, x in enumerate(v[:8]):
            out += _paths(x, (*prefix, i))
    return out


def _set(v: Any, path: tuple, new: Any, delete: bool = False) -> Any:
    if not path:
        return new
    parent = v
    for p in path[:-1]:
        parent = parent[p]
    if delete and isinstance(parent, dict):
        parent.pop(path[-1], None)
    else:
        parent[path[-1]] = new
    return v


@st.composite
def mutated(draw, endpoint: str) -> tuple[bytes, dict]:
    """(raw body, the JSON value sent or {}) for one request to ``endpoint``."""
    # a copy: st.just values are shared objects, and the mutations below change the body
    body = copy.deepcopy(draw(BODIES[endpoint]))
    if isinstance(body, dict) and draw(st.integers(0, 3)):  # mostly the served model
        body["model"] = MODEL
    how = draw(st.sampled_from(["none", "none", "leaf", "leaf", "delete", "extra", "raw"]))
    if how in ("leaf", "delete") and isinstance(body, dict):
        paths = _paths(body)
        path = draw(st.sampled_from(paths))
        body = _set(body, path, draw(hostile), delete=how == "delete")
    elif how == "extra" and isinstance(body, dict):
        body[draw(text)] = draw(hostile)
    elif how == "raw":
        raw = draw(
            st.sampled_from(
                [
                    b"",
                    b"{",
                    b"[]",
                    b"null",
                    b"\xff\xfe{}",
                    b'{"model": "kimi-k3"',
                    b"1e999",
                    b'{"model": NaN}',
                    b'{"a": "\\ud800"}',
                    b"[" * 5000 + b"]" * 5000,
                    b'{"messages": [' + b'{"role":"user","content":"x"},' * 3 + b"]}",
                ]
            )
        )
        return raw, {}
    if isinstance(body, dict):
        for key in TOKEN_KEYS:  # cheap generation: valid counts become small
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and SMALL_TOKENS < v <= 4096:
                body[key] = SMALL_TOKENS
    try:
        return json.dumps(body, allow_nan=True).encode(), body
    except (ValueError, TypeError, RecursionError):
        return b"{}", {}


# -- what an answer must be ------------------------------------------------------------


def _openai_error(b: Any) -> bool:
    e = b.get("error") if isinstance(b, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) and "type" in e


def _anthropic_error(b: Any) -> bool:
    e = b.get("error") if isinstance(b, dict) else None
    return (
        isinstance(b, dict)
        and b.get("type") == "error"
        and isinstance(e, dict)
        and isinstance(e.get("type"), str)
        and isinstance(e.get("message"), str)
    )


def _ok_body(endpoint: str, b: Any) -> bool:
    if not isinstance(b, dict):
        return False
    if endpoint in ("/v1/chat/completions", "/v1/completions"):
        return isinstance(b.get("choices"), list) and bool(b["choices"])
    if endpoint == "/v1/messages":
        return b.get("type") == "message" and isinstance(b.get("content"), list)
    if endpoint == "/v1/messages/count_tokens":
        return isinstance(b.get("input_tokens"), int)
    return b.get("object") == "response" and isinstance(b.get("output"), list)


def _ok_stream(endpoint: str, raw: bytes) -> str | None:
    """None if the event stream is complete and every event is JSON; else what is wrong."""
    datas = [x[6:] for x in raw.decode("utf-8", "replace").splitlines() if x.startswith("data: ")]
    if not datas:
        return "no events"
    events = []
    for d in datas:
        if d == "[DONE]":
            events.append("[DONE]")
            continue
        try:
            events.append(json.loads(d))
        except ValueError:
            return f"event is not JSON: {d[:80]}"
    if any(
        isinstance(e, dict) and ("error" in e and e.get("type") in (None, "error")) for e in events
    ):
        return f"error event: {str(events)[-300:]}"
    last = events[-1]
    if endpoint in ("/v1/chat/completions", "/v1/completions"):
        return None if last == "[DONE]" else "no [DONE]"
    if endpoint == "/v1/messages":
        return (
            None
            if isinstance(last, dict) and last.get("type") == "message_stop"
            else "no message_stop"
        )
    return (
        None
        if isinstance(last, dict)
        and last.get("type") in ("response.completed", "response.incomplete")
        else "no response.completed"
    )


def judge(endpoint: str, status: int | str, headers: dict, raw: bytes) -> str | None:
    """None if the answer is acceptable; else why not."""
    if not isinstance(status, int):
        return f"connection: {status}"
    if status >= 500:
        return f"{status}: {raw[:300]!r}"
    if status >= 400:
        try:
            b = json.loads(raw)
        except ValueError:
            return f"{status} body is not JSON: {raw[:200]!r}"
        shape = _anthropic_error if endpoint.startswith("/v1/messages") else _openai_error
        return None if shape(b) else f"{status} not in the API's error shape: {raw[:200]!r}"
    if status >= 300:
        return f"unexpected {status}"
    if "text/event-stream" in headers.get("content-type", "").lower():
        return _ok_stream(endpoint, raw)
    try:
        b = json.loads(raw)
    except ValueError:
        return f"200 body is not JSON: {raw[:200]!r}"
    return None if _ok_body(endpoint, b) else f"200 body malformed: {raw[:300]!r}"


def post(port: int, endpoint: str, raw: bytes, timeout: float = 300) -> tuple:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", endpoint, raw, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    except Exception as e:  # a reset or timeout is a finding, not a crash of the fuzzer
        return type(e).__name__, {}, str(e).encode()
    finally:
        conn.close()


@dataclass
class Report:
    requests: int = 0
    by_endpoint: dict = field(default_factory=dict)  # endpoint -> {status: count}
    failures: list = field(default_factory=list)  # (endpoint, why, body excerpt)
    seconds: float = 0.0

    def count(self, endpoint: str, status) -> None:
        self.requests += 1
        self.by_endpoint.setdefault(endpoint, Counter())[str(status)] += 1

    def merge(self, other: Report) -> None:
        self.requests += other.requests
        for k, c in other.by_endpoint.items():
            self.by_endpoint.setdefault(k, Counter()).update(c)
        self.failures += other.failures

    def summary(self) -> dict:
        statuses = Counter()
        for c in self.by_endpoint.values():
            statuses.update(c)
        return {
            "requests": self.requests,
            "seconds": round(self.seconds, 1),
            "by_endpoint": {k: dict(sorted(v.items())) for k, v in self.by_endpoint.items()},
            "5xx": sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500),
            "connection_errors": sum(n for s, n in statuses.items() if not s.isdigit()),
            "failures": len(self.failures),
            "first_failures": self.failures[:20],
        }


def run(
    port: int,
    n: int,
    seed_: int = 0,
    endpoints: tuple[str, ...] = ENDPOINTS,
    report: Report | None = None,
) -> Report:
    """Send ``n`` generated requests (each to one of ``endpoints``), one at a time."""
    report = report or Report()
    t0 = time.monotonic()

    @seed(seed_)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @given(st.data())
    def one(data):
        endpoint = data.draw(st.sampled_from(endpoints))
        raw, _ = data.draw(mutated(endpoint))
        status, headers, out = post(port, endpoint, raw)
        report.count(endpoint, status)
        why = judge(endpoint, status, headers, out)
        if why is not None:
            report.failures.append((endpoint, why, raw[:400].decode("utf-8", "replace")))

    one()
    report.seconds += time.monotonic() - t0
    return report
