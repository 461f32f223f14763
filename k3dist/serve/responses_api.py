"""OpenAI Responses API (``POST /v1/responses``), stateless.

``input`` (a string or items: messages, ``function_call``, ``function_call_output``,
``reasoning``) and ``instructions`` become the chat-completion body the server runs
anyway; function tools become chat tools. Output items: ``reasoning`` (K3's think
channel), ``message`` (``output_text``) and ``function_call``; streamed as
``response.created`` ... ``response.completed`` events. Nothing is stored:
``previous_response_id`` is refused (send the whole conversation in ``input``), and
``store`` is reported false.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from k3dist.serve.notices import dropped_tool
from k3dist.serve.relay import BadRequest, Translator, sse, validation_message

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
EFFORTS = {"low": "low", "medium": "high", "high": "high", "xhigh": "max"}


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Model):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class CustomCallItem(_Model):
    """A call of a ``custom`` (freeform) tool: its input is plain text."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str


class CustomCallOutputItem(_Model):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: list[TextPart] | None = None


Item = Annotated[
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | CustomCallItem
    | CustomCallOutputItem
    | ReasoningItem,
    Field(discriminator="type"),
]


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedChoice(_Model):
    type: Literal["function", "custom"]
    name: str


class Reasoning(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(_Model):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict | None = None
    # set by to_chat: the namespace of each flattened tool, and the custom tools' names
    _namespaces: dict[str, str] = PrivateAttr(default_factory=dict)
    _custom: set[str] = PrivateAttr(default_factory=set)


# A custom (freeform) tool runs as a function of one string argument.
CUSTOM_INPUT = "input"


def _flatten_tools(tools: Any) -> tuple[Any, dict[str, str], set[str]]:
    """The request's tools as function tools: a ``namespace`` tool's tools are listed
    on their own (each remembered with its namespace, for the calls back), a ``custom``
    (freeform) tool becomes a function of one string ``input`` (its grammar or format
    in the description), and the hosted tools this server cannot run (``web_search``,
    ``file_search``, ``code_interpreter``, ...) are left out, with a notice logged.
    Anything else is left as it is, for validation to refuse."""
    if not isinstance(tools, list):
        return tools, {}, set()
    out: list = []
    namespaces: dict[str, str] = {}
    custom: set[str] = set()

    def add(t: Any, ns: str | None) -> None:
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "namespace" and ns is None and isinstance(t.get("tools"), list):
            for sub in t["tools"]:
                add(sub, t.get("name") if isinstance(t.get("name"), str) else "")
        elif kind == "custom" and isinstance(t.get("name"), str):
            fmt = t.get("format")
            how = ""
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                how = (
                    f"\n\nThe input must follow this {fmt.get('syntax', '')} grammar:\n"
                    f"{fmt.get('definition', '')}"
                )
            desc = t.get("description") if isinstance(t.get("description"), str) else ""
            out.append(
                {
                    "type": "function",
                    "name": t["name"],
                    "description": desc + how,
                    "parameters": {
                        "type": "object",
                        "properties": {
                            CUSTOM_INPUT: {
                                "type": "string",
                                "description": "the tool's input, as text",
                            }
                        },
                        "required": [CUSTOM_INPUT],
                    },
                }
            )
            custom.add(t["name"])
        elif isinstance(kind, str) and kind not in ("function", "namespace"):
            dropped_tool("responses", kind)
        else:
            if ns and isinstance(t.get("name"), str):
                namespaces[t["name"]] = ns
            out.append(
                t if kind is not None or not isinstance(t, dict) else dict(t, type="function")
            )

    for t in tools:
        add(t, None)
    return out, namespaces, custom


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _items(body: dict) -> list[dict]:
    if isinstance(body.get("input"), list):  # a message item may leave out its type
        return [
            dict(x, type="message")
            if isinstance(x, dict) and "type" not in x and "role" in x
            else x
            for x in body["input"]
        ]
    return body.get("input")


def _chat_tools(req: ResponsesRequest) -> list[dict]:
    """The request's tools as chat-completion tools: only the named one when tool_choice
    names one (it must be there); 'required' needs at least one."""
    tools = req.tools or []
    if isinstance(req.tool_choice, NamedChoice):  # only the named tool, and it must be called
        tools = [t for t in tools if t.name == req.tool_choice.name][:1]
        if not tools:
            raise BadRequest(
                400,
                f"tool_choice names tool {req.tool_choice.name!r}, which is "
                "not among the request's tools",
                "tool_choice",
            )
    elif req.tool_choice == "required" and not tools:
        raise BadRequest(400, "tool_choice 'required' needs at least one tool", "tool_choice")
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


def to_chat(body: dict) -> tuple[dict, ResponsesRequest]:
    """The chat-completion body for a Responses request body (and the parsed request)."""
    tools, namespaces, custom = _flatten_tools(body.get("tools"))
    try:
        req = ResponsesRequest.model_validate(dict(body, input=_items(body), tools=tools))
    except ValidationError as e:
        raise BadRequest(400, validation_message(e)) from None
    req._namespaces, req._custom = namespaces, custom
    if req.previous_response_id is not None:
        raise BadRequest(
            400,
            "previous_response_id is not supported: this server keeps no "
            "responses; send the whole conversation in input",
            "previous_response_id",
        )
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = (
        [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    )
    calls: set[str] = set()
    reasoning = ""
    for i, it in enumerate(items):
        last = messages[-1] if messages else None
        if isinstance(it, ReasoningItem):
            reasoning += _text(it.content or it.summary)
        elif isinstance(it, FunctionCallItem | CustomCallItem):
            if not (last and last["role"] == "assistant" and not _answered(messages)):
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if isinstance(it, CustomCallItem):
                args: Any = {CUSTOM_INPUT: it.input}
            else:
                try:
                    args = json.loads(it.arguments or "{}")
                except ValueError:
                    raise BadRequest(400, f"input.{i}.arguments is not JSON", "input") from None
            last.setdefault("tool_calls", []).append(
                {
                    "id": it.call_id,
                    "type": "function",
                    "function": {"name": it.name, "arguments": args},
                }
            )
            calls.add(it.call_id)
        elif isinstance(it, FunctionCallOutputItem | CustomCallOutputItem):
            if it.call_id not in calls:
                raise BadRequest(
                    400,
                    f"input.{i}: function_call_output call_id "
                    f"{it.call_id!r} answers no function_call before it",
                    "input",
                )
            messages.append(
                {"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output)}
            )
        else:
            role = "system" if it.role == "developer" else it.role
            messages.append({"role": role, "content": _text(it.content)})
            if role != "assistant":
                calls = set()
        if reasoning and messages and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
            reasoning = ""
    if not any(m["role"] != "system" for m in messages):
        raise BadRequest(400, "input has no message", "input")
    effort = req.reasoning.effort if req.reasoning else None
    kwargs: dict = {"thinking": effort not in ("none", "minimal")}
    if effort in EFFORTS:
        kwargs["thinking_effort"] = EFFORTS[effort]
    chat: dict = {"model": req.model, "messages": messages, "chat_template_kwargs": kwargs}
    tools = _chat_tools(req)
    if tools:
        chat["tools"] = tools
        if req.tool_choice is not None and req.tool_choice != "auto":
            kwargs["tool_choice"] = "none" if req.tool_choice == "none" else "required"
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    for key in ("temperature", "top_p"):
        if getattr(req, key) is not None:
            chat[key] = getattr(req, key)
    return chat, req


def _answered(messages: list[dict]) -> bool:
    return bool(messages) and messages[-1]["role"] == "tool"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class ResponsesTranslator(Translator):
    """The generated stream as Responses events, or one Response body."""

    def __post_init__(self):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.seq = 0
        self.request: ResponsesRequest | None = None

    def _event(self, kind: str, **data) -> bytes:
        self.seq += 1
        return sse(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def _item(self, index: int, block: dict, done: bool) -> dict:
        status = "completed" if done else "in_progress"
        item_id = block.setdefault("item_id", f"{block['kind'][:2]}_{self.id[5:]}_{index}")
        if block["kind"] == "reasoning":
            return {
                "type": "reasoning",
                "id": item_id,
                "summary": [],
                "status": status,
                "content": [{"type": "reasoning_text", "text": block["text"]}] if done else [],
            }
        if block["kind"] == "text":
            return {
                "type": "message",
                "id": item_id,
                "role": "assistant",
                "status": status,
                "content": [self._part(block, done)] if done else [],
            }
        if self._custom(block):
            return {
                "type": "custom_tool_call",
                "id": item_id,
                "call_id": block["id"],
                "name": block["name"],
                "input": self._input(block) if done else "",
                "status": status,
            }
        item = {
            "type": "function_call",
            "id": item_id,
            "call_id": block["id"],
            "name": block["name"],
            "arguments": block["arguments"] if done else "",
            "status": status,
        }
        ns = self.request._namespaces.get(block["name"]) if self.request else None
        if ns:
            item["namespace"] = ns
        return item

    def _custom(self, block: dict) -> bool:
        return (
            block["kind"] == "tool_call"
            and self.request is not None
            and block["name"] in self.request._custom
        )

    @staticmethod
    def _input(block: dict) -> str:
        """A custom tool call's text input (the one argument of its function)."""
        try:
            args = json.loads(block["arguments"])
        except ValueError:
            return block["arguments"]
        v = args.get(CUSTOM_INPUT) if isinstance(args, dict) else None
        return v if isinstance(v, str) else json.dumps(args)

    @staticmethod
    def _part(block: dict, done: bool) -> dict:
        if block["kind"] == "reasoning":
            return {"type": "reasoning_text", "text": block["text"] if done else ""}
        return {
            "type": "output_text",
            "text": block["text"] if done else "",
            "annotations": [],
            "logprobs": [],
        }

    def response(self, status: str) -> dict:
        o, req = self.outcome, self.request
        done = status != "in_progress"
        incomplete = status == "incomplete"
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions if req else None,
            "max_output_tokens": req.max_output_tokens if req else None,
            "output": [self._item(i, b, True) for i, b in enumerate(self.blocks)] if done else [],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": {
                "effort": req.reasoning.effort if req and req.reasoning else None,
                "summary": None,
            },
            "store": False,
            "temperature": req.temperature if req else None,
            "top_p": req.top_p if req else None,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [t.model_dump() for t in (req.tools or [])] if req else [],
            "truncation": "disabled",
            "metadata": {},
            "usage": None,
        }
        if done:
            # reasoning_tokens: not counted apart (the relay sees text, not tokens)
            out["usage"] = {
                "input_tokens": o.prompt_tokens,
                "input_tokens_details": {"cached_tokens": o.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": o.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": o.prompt_tokens + o.completion_tokens,
            }
        return out

    def _status(self) -> str:
        return "incomplete" if self.outcome.finish_reason == "length" else "completed"

    def start(self):
        r = self.response("in_progress")
        return [
            self._event("response.created", response=r),
            self._event("response.in_progress", response=r),
        ]

    def open_block(self, index, block):
        out = [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=self._item(index, block, False),
            )
        ]
        if block["kind"] != "tool_call":
            out.append(
                self._event(
                    "response.content_part.added",
                    output_index=index,
                    item_id=block["item_id"],
                    content_index=0,
                    part=self._part(block, False),
                )
            )
        return out

    def delta(self, index, block, text):
        if self._custom(block):
            return [
                self._event(
                    "response.custom_tool_call_input.delta",
                    output_index=index,
                    item_id=block["item_id"],
                    delta=self._input(block),
                )
            ]
        kind = {
            "reasoning": "response.reasoning_text.delta",
            "text": "response.output_text.delta",
            "tool_call": "response.function_call_arguments.delta",
        }[block["kind"]]
        extra = {} if block["kind"] == "tool_call" else {"content_index": 0}
        if block["kind"] == "text":
            extra["logprobs"] = []
        return [
            self._event(kind, output_index=index, item_id=block["item_id"], delta=text, **extra)
        ]

    def close_block(self, index, block):
        iid = block["item_id"]
        if self._custom(block):
            out = [
                self._event(
                    "response.custom_tool_call_input.done",
                    output_index=index,
                    item_id=iid,
                    input=self._input(block),
                )
            ]
        elif block["kind"] == "tool_call":
            out = [
                self._event(
                    "response.function_call_arguments.done",
                    output_index=index,
                    item_id=iid,
                    name=block["name"],
                    arguments=block["arguments"],
                )
            ]
        else:
            kind = (
                "response.reasoning_text.done"
                if block["kind"] == "reasoning"
                else "response.output_text.done"
            )
            extra = {"logprobs": []} if block["kind"] == "text" else {}
            out = [
                self._event(
                    kind,
                    output_index=index,
                    item_id=iid,
                    content_index=0,
                    text=block["text"],
                    **extra,
                ),
                self._event(
                    "response.content_part.done",
                    output_index=index,
                    item_id=iid,
                    content_index=0,
                    part=self._part(block, True),
                ),
            ]
        return out + [
            self._event(
                "response.output_item.done", output_index=index, item=self._item(index, block, True)
            )
        ]

    def finish(self):
        status = self._status()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [self._event(kind, response=self.response(status))]

    def body(self):
        return self.response(self._status())

    def error_body(self, status, message):
        return error_body(status, message)

    def keepalive(self):
        if self.blocks:  # only before the first output item
            return []
        return [self._event("response.in_progress", response=self.response("in_progress"))]

    def error_event(self, message):
        return [
            self._event("error", code="server_error", message=message, param=None),
            self._event(
                "response.failed",
                response=dict(
                    self.response("failed"), error={"code": "server_error", "message": message}
                ),
            ),
        ]
