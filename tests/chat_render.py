"""Kimi K3's XTML chat format in Python: the reference the served Jinja template
(``k3dist/format/chat_template.jinja``) is tested against.

XTML writes markup with three control tokens in place of angle brackets, ``<|open|>tag
k="v"<|sep|>`` … ``<|close|>tag<|sep|>``, and ends every message with ``<|end_of_msg|>``::

    [tool-declare] [thinking-effort] messages… [tool-choice] [response-format] [prompt]

    <|open|>message role="system" type="tool-declare"<|sep|># Tools …```json
    [...compact, key-sorted tool schemas...]
    ```<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|>
      <|open|>think<|sep|>…<|close|>think<|sep|>            (thinking mode only, even empty)
      <|open|>response<|sep|>…<|close|>response<|sep|>
      <|open|>tools<|sep|>                                  (only with tool calls)
        <|open|>call tool="f" index="1"<|sep|>
          <|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>
        <|close|>call<|sep|>
      <|close|>tools<|sep|>
    <|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="f" index="1"<|sep|>22C<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>      (generation prompt)

(line breaks above are for reading only; the format has none between tags).

Sources. Confirmed by Moonshot's K3 technical report (appendix F, "chat template"): messages
and option messages; global options (``type="tool-declare"``, thinking effort) before the
input messages, one-shot options (``tool_choice``, ``response_format``) after them, mid-chat
tool declarations; channels ``think`` / ``response`` / ``tools``; the mode chosen only by the
generation prefix (``<|open|>think<|sep|>`` vs ``<|open|>response<|sep|>``); preserved
thinking (the think channel stays in history in thinking mode, even empty; instruct mode keeps
only response and tools); calls carry ``tool`` and ``index`` and each tool result repeats
them in call order; typed arguments with strings raw; a JSON fallback block for arguments that
do not decompose; effort levels named low/medium/high/max, K3 supporting a subset. The exact
strings (attribute escaping, the option messages' wording, ``json.dumps`` for non-string
argument values, which efforts are accepted, reordering tool results by ``tool_call_id``,
defaulting to ``thinking_effort="max"``) follow Moonshot's ``encoding_k3.py`` as carried by
mlx-vlm 0.7.10 (``models/kimi_k3/encoding_k3.py``, ``processing_kimi_k3.py``) and agree with
llama.cpp's ``models/templates/Kimi-K3.jinja``, ms-swift's K3 agent template and mlx-lm's
``tool_parsers/kimi_k3.py`` (which parses our calls back).

Assumptions and choices of ours:
- Tool-result ``index`` counts tool messages since the last assistant message (as the
  reference code does), also when results were reordered or some are missing.
- The technical report calls non-string argument values "compactly serialised"; every public
  implementation writes ``json.dumps(value)`` (``", "``/``": "`` separators); we follow the code.
- Unknown roles raise (the reference skips them); images render as the plain-text
  placeholder ``<|kimi_image_placeholder|>`` for a processor to expand (text-only serving).
- Reasoning is read from ``reasoning_content``, then ``thinking``, then ``reasoning`` (first
  not None): transformers aliases those names before a template sees the message.

Jinja vs Python. The template renders exactly what ``render`` does for the inputs a
chat template can get from mlx_lm.server (which ``json.loads`` tool-call arguments first).
One difference: ``render`` parses tool-call arguments given as a JSON-object *string* into
typed arguments, as the reference does; Jinja cannot parse JSON, so the template writes any
non-blank string as the JSON fallback block. The template uses transformers' ``tojson``
(``separators``/``sort_keys``/``ensure_ascii``), so it targets transformers' renderer.

Tokens. Rendering to one string and encoding it (what every chat template does) matches
K3's segment-wise encoding except where an attribute value starts or ends with punctuation
(BPE pieces may then join ``="``), and control-token spellings inside user text become
control tokens instead of text unless the caller passes transformers 5's
``apply_chat_template(..., sanitize_control_tokens=True)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from k3dist.format.tokens import CLOSE, END_OF_MSG, IMAGE_PLACEHOLDER, OPEN, SEP

THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
NEW_TOOLS_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n```json\n"
)
EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including "
    "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\n"
    "You MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\n"
    "You MUST NOT call any tools in the next message.",
}
_RAW_JSON = (
    "Your response must be raw JSON data without markdown code blocks (```json) "
    "or any additional formatting."
)
JSON_OBJECT_TEXT = f"The system is invoked with `response_format=json_object`.\n{_RAW_JSON}"
JSON_SCHEMA_TEXT = (
    f"The system is invoked with `response_format=json_schema`.\n{_RAW_JSON}\n"
    "The JSON data must match the following schema:\n```json\n{}\n```"
)


# ----------------------------------------------------------------------------- Python renderer


def _attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag: str, **attrs: Any) -> str:
    return OPEN + tag + "".join(f' {k}="{_attr(v)}"' for k, v in attrs.items()) + SEP


def close_tag(tag: str) -> str:
    return CLOSE + tag + SEP


def _message(body: str, **attrs: Any) -> str:
    return open_tag("message", **attrs) + body + close_tag("message") + END_OF_MSG


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Mapping) or not isinstance(content, Sequence):
        raise ValueError(f"message content must be a string or a list of parts, got {content!r}")
    out = []
    for part in content:
        if part.get("type") in ("image", "image_url"):
            out.append(IMAGE_PLACEHOLDER)
        elif isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            raise ValueError(f"content part {part!r} is neither text nor an image")
    return "".join(out)


def _named(role: str, message: Mapping) -> dict:
    name = message.get("name")
    return {"role": role, "name": name} if name else {"role": role}


def _first(message: Mapping, keys: Sequence[str]) -> Any:
    return next((message[k] for k in keys if message.get(k) is not None), None)


def _function(call: Mapping) -> Mapping:
    fn = call.get("function")
    return fn if isinstance(fn, Mapping) else call


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, Mapping) else "array"


def _arguments(arguments: Any) -> str:
    """Typed ``argument`` blocks; a JSON ``json`` block when they do not decompose."""
    if isinstance(arguments, str):
        if not arguments.strip():
            return ""
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):  # the reference's "_xtml_json_block" fallback
            return open_tag("json", type="object") + arguments + close_tag("json")
        arguments = parsed
    if arguments is None:
        return ""
    if not isinstance(arguments, Mapping):
        raise ValueError(
            f"tool-call arguments must be an object or a JSON string, got {arguments!r}"
        )
    return "".join(
        open_tag("argument", key=key, type=_value_type(value))
        + (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
        + close_tag("argument")
        for key, value in arguments.items()
    )


def _assistant(message: Mapping, thinking: bool) -> str:
    body = ""
    if thinking:
        reasoning = _first(message, _REASONING_KEYS)
        text = str(reasoning) if reasoning is not None and str(reasoning).strip() else ""
        body += open_tag("think") + text + close_tag("think")
    body += open_tag("response") + _content(message.get("content")) + close_tag("response")
    calls = message.get("tool_calls")
    if calls:
        body += open_tag("tools")
        for index, call in enumerate(calls, start=1):
            fn = _function(call)
            if fn.get("name") is None:
                raise ValueError(f"tool call {call!r} has no function name")
            body += (
                open_tag("call", tool=fn["name"], index=index)
                + _arguments(fn.get("arguments"))
                + close_tag("call")
            )
        body += close_tag("tools")
    return _message(body, **_named("assistant", message))


def _result_id(message: Mapping) -> Any:
    return _first(message, ("tool_call_id", "id"))


def _tool_run(run: list[Mapping], calls: list[Mapping] | None) -> list[tuple[Mapping, Any]]:
    """Consecutive tool results in call order, with the name each one renders under.

    When every result's ``tool_call_id`` names one of the preceding assistant's calls,
    results are sorted by that call's position and take its function name; otherwise they
    stay in the order given and carry their own ``tool``/``name``.
    """
    first_pos: dict[str, int] = {}
    for pos, call in enumerate(calls or []):
        if call.get("id") is not None:
            first_pos.setdefault(str(call["id"]), pos)
    ids = [_result_id(m) for m in run]
    if all(i is not None and str(i) in first_pos for i in ids):
        order = sorted(range(len(run)), key=lambda k: (first_pos[str(ids[k])], k))
        return [(run[k], _function(calls[first_pos[str(ids[k])]]).get("name")) for k in order]
    return [(m, _first(m, ("tool", "name"))) for m in run]


def render(
    messages: Sequence[Mapping],
    tools: Sequence[Mapping] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = DEFAULT_THINKING_EFFORT,
    tool_choice: Any = None,
    response_format: Mapping | None = None,
) -> str:
    """Render an OpenAI-style chat in K3's XTML format.

    ``thinking`` selects thinking mode (think channels in history, the prompt opens
    ``think``) or instruct mode (the prompt opens ``response``). ``thinking_effort`` is one of
    ``THINKING_EFFORTS`` or None (no effort message); it only applies in thinking mode.
    ``tool_choice`` "required"/"none" and ``response_format`` {"type": "json_object"} /
    {"type": "json_schema", "json_schema": {"schema": ...}} add one-shot option messages.
    """
    out = []
    if tools:
        out.append(
            _message(
                TOOLS_HEADER + _compact_json(tools) + "\n```", role="system", type="tool-declare"
            )
        )
    if thinking and thinking_effort is not None:
        if thinking_effort not in THINKING_EFFORTS:
            raise ValueError(
                f"thinking_effort={thinking_effort!r} is not supported; use one "
                f"of {', '.join(THINKING_EFFORTS)} or None"
            )
        out.append(
            _message(EFFORT_TEXT.format(thinking_effort), role="system", type="thinking-effort")
        )

    calls: list[Mapping] | None = None
    tool_index = 0
    i = 0
    while i < len(messages):
        message = messages[i]
        role = message.get("role")
        if role == "tool":
            j = i
            while j < len(messages) and messages[j].get("role") == "tool":
                j += 1
            for result, name in _tool_run(list(messages[i:j]), calls):
                tool_index += 1
                if name is None and calls and tool_index <= len(calls):
                    name = _function(calls[tool_index - 1]).get("name")
                if name is None:
                    raise ValueError(
                        f"tool message {result!r} needs a tool name: give `tool`"
                        "/`name` or a `tool_call_id` of the assistant's calls"
                    )
                out.append(
                    _message(
                        _content(result.get("content")), role="tool", tool=name, index=tool_index
                    )
                )
            i = j
            continue
        if role == "user":
            out.append(_message(_content(message.get("content")), **_named("user", message)))
        elif role == "system" and message.get("tools"):
            out.append(
                _message(
                    NEW_TOOLS_HEADER + _compact_json(message["tools"]) + "\n```",
                    role="system",
                    type="tool-declare",
                )
            )
        elif role == "system":
            out.append(_message(_content(message.get("content")), **_named("system", message)))
        elif role == "assistant":
            calls, tool_index = message.get("tool_calls"), 0
            out.append(_assistant(message, thinking))
        else:
            raise ValueError(
                f"unknown message role {role!r}; K3 knows system, user, assistant and tool"
            )
        i += 1

    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_TEXT:
        out.append(_message(TOOL_CHOICE_TEXT[tool_choice], role="system", type="tool-choice"))
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "json_object":
        out.append(_message(JSON_OBJECT_TEXT, role="system", type="response-format"))
    elif kind == "json_schema":
        wrapper = response_format.get("json_schema")
        schema = wrapper.get("schema", wrapper) if isinstance(wrapper, Mapping) else wrapper
        out.append(
            _message(
                JSON_SCHEMA_TEXT.format(_compact_json(schema)),
                role="system",
                type="response-format",
            )
        )
    if add_generation_prompt:
        out.append(
            open_tag("message", role="assistant") + open_tag("think" if thinking else "response")
        )
    return "".join(out)


# ----------------------------------------------------------------------------- Jinja template
