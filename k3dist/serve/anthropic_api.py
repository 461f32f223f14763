"""Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

A request is validated (pydantic) and translated into the chat-completion body the
server runs anyway: ``system`` -> a system message, ``tool_use`` blocks -> the
assistant's ``tool_calls``, ``tool_result`` blocks -> ``tool`` messages (each must
answer a ``tool_use`` of the assistant message before it), ``thinking`` blocks -> the
assistant's reasoning, ``thinking`` -> K3's think channel on or off (off unless asked,
as Anthropic's API), ``tool_choice`` -> K3's tool-choice system message. The generated
stream comes back as Messages events: ``message_start``, ``content_block_start`` /
``_delta`` / ``_stop`` for each thinking, text and tool_use block, ``message_delta``
(``stop_reason``, usage) and ``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal

from k3dist.serve.notices import dropped_tool
from k3dist.serve.relay import BadRequest, Translator, sse, validation_message

from pydantic import BaseModel, ConfigDict, Field, ValidationError

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ImageSource(_Model):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Model):
    type: Literal["image"]
    source: ImageSource


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = (
        None
    )
    is_error: bool | None = None


Block = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class Message(_Model):
    # "system": Claude Code's mid-conversation system messages, rendered where they stand
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(_Model):
    # no type (or "custom"): a tool the client runs, described by input_schema; any other
    # type is one of Anthropic's built-in tools (web_search_20250305, bash_20250124, ...)
    type: str | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(_Model):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False


# Claude Code's first system block, ``x-anthropic-billing-header: cc_version=...;
# cc_prev_msg=...``: it changes with every request, and rendered first in the prompt it
# left no prefix for the prompt cache to reuse across a session's requests (each of Claude
# Code's 17K-token requests prefilled from zero); Anthropic's API takes it as request
# metadata, so it is left out of the prompt here.
BILLING_HEADER = "x-anthropic-billing-header:"


def _text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def _tool_content(b: ToolResultBlock, where: str) -> str | list[dict]:
    """A tool_result's content as the tool message's: text, or (with images, as a
    client's Read of a screenshot sends) image parts then the text, as user content."""
    blocks = b.content if isinstance(b.content, list) else []
    images = [
        _image_part(x, f"{where}.content.{k}")
        for k, x in enumerate(blocks)
        if isinstance(x, ImageBlock)
    ]
    text = ("Error: " if b.is_error else "") + _text(
        [x for x in blocks if isinstance(x, TextBlock)] if blocks else b.content
    )
    if not images:
        return text
    return [*images, *([{"type": "text", "text": text}] if text else [])]


def _image_part(b: ImageBlock, where: str) -> dict:
    """An image block as the chat image part the server checks (vision or not)."""
    src = b.source
    if src.type == "base64":
        if not (src.media_type and src.data):
            raise BadRequest(400, f"{where}.source: a base64 image needs media_type and data")
        url = f"data:{src.media_type};base64,{src.data}"
    else:
        if not src.url:
            raise BadRequest(400, f"{where}.source: a url image needs url")
        url = src.url
    return {"type": "image_url", "image_url": {"url": url}}


def _tools(tools: list[Tool], choice: ToolChoice | None) -> tuple[list[dict], str | None]:
    """Chat tools and K3's tool_choice ("required", "none" or None) for the request's
    tools: Anthropic's built-in tools, which this server cannot run, are left out (a
    notice is logged); ``tool_choice`` naming a tool keeps only that tool, required."""
    out = []
    for t in tools:
        if t.type not in (None, "custom"):
            dropped_tool("anthropic", t.type)
            continue
        if t.input_schema is None:
            raise BadRequest(400, f"tools: tool {t.name!r} has no input_schema")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
        )
    if choice is None or choice.type == "auto" or (not out and choice.type == "none"):
        return out, None
    if choice.type == "none":
        return out, "none"
    if choice.type == "tool":
        named = [t for t in out if t["function"]["name"] == choice.name]
        if not named:
            raise BadRequest(
                400,
                f"tool_choice: names tool {choice.name!r}, which is not "
                f"among the request's tools {[t['function']['name'] for t in out]}",
            )
        return named[:1], "required"
    if not out:
        raise BadRequest(400, f"tool_choice: {choice.type!r} needs at least one tool")
    return out, "required"


def _assistant(i: int, blocks: list) -> dict:
    """An assistant message as the chat's: its text, thinking as reasoning, tool_use blocks
    as tool_calls."""
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
    bad = [b.type for b in blocks if isinstance(b, ToolResultBlock | ImageBlock)]
    if bad:
        raise BadRequest(400, f"messages.{i}: {bad[0]} blocks belong in a user message")
    msg: dict = {"role": "assistant", "content": text}
    if thinking:
        msg["reasoning_content"] = thinking
    if uses:
        msg["tool_calls"] = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in uses
        ]
    return msg


def _user(i: int, blocks: list, calls: set[str]) -> list[dict]:
    """A user message as chat messages: one ``tool`` message per tool_result (each must
    answer one of ``calls``, the tool_use ids of the assistant message before it), then the
    user's text (and images), if any."""
    out: list[dict] = []
    text: list[str] = []
    images: list[dict] = []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if isinstance(b, ToolResultBlock):
            if b.tool_use_id not in calls:
                raise BadRequest(
                    400,
                    f"{where}: tool_result block's tool_use_id {b.tool_use_id!r} answers no "
                    "tool_use block of the assistant message before it",
                )
            out.append(
                {"role": "tool", "tool_call_id": b.tool_use_id, "content": _tool_content(b, where)}
            )
        elif isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ImageBlock):
            images.append(_image_part(b, where))
        else:
            raise BadRequest(400, f"{where}: a {b.type} block belongs in an assistant message")
    if images:
        out.append(
            {"role": "user", "content": [*images, *({"type": "text", "text": t} for t in text)]}
        )
    elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
        out.append({"role": "user", "content": "".join(text)})
    return out


def _messages(req: CountTokensRequest) -> list[dict]:
    """The request's system prompt and messages as chat messages."""
    messages: list[dict] = []
    system = req.system
    if isinstance(system, list):  # Claude Code's per-request header is metadata, not prompt
        system = [b for b in system if not b.text.startswith(BILLING_HEADER)]
    if system:
        messages.append({"role": "system", "content": _text(system)})
    calls: set[str] = set()  # tool_use ids of the latest assistant message
    for i, m in enumerate(req.messages):
        blocks = (
            [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        )
        if m.role == "system":
            bad = [b.type for b in blocks if not isinstance(b, TextBlock)]
            if bad:
                raise BadRequest(
                    400, f"messages.{i}: a system message holds text blocks only, not {bad[0]}"
                )
            messages.append({"role": "system", "content": _text(blocks)})
        elif m.role == "assistant":
            msg = _assistant(i, blocks)
            calls = {c["id"] for c in msg.get("tool_calls", [])}
            messages.append(msg)
        else:
            messages += _user(i, blocks, calls)
            calls = set()
    return messages


def to_chat(body: dict, *, count_only: bool = False) -> dict:
    """The chat-completion body for a Messages (or count_tokens) request body."""
    try:
        req = (CountTokensRequest if count_only else MessagesRequest).model_validate(body)
    except ValidationError as e:
        raise BadRequest(400, validation_message(e)) from None
    chat: dict = {
        "model": req.model,
        "messages": _messages(req),
        "chat_template_kwargs": {
            "thinking": bool(req.thinking and req.thinking.type != "disabled")
        },
    }
    tools, choice = _tools(req.tools or [], req.tool_choice)
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["chat_template_kwargs"]["tool_choice"] = choice
    if count_only:
        return chat
    chat["max_tokens"] = req.max_tokens
    for key in ("temperature", "top_p", "top_k"):
        if getattr(req, key) is not None:
            chat[key] = getattr(req, key)
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    return chat


def error_body(status: int, message: str) -> dict:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


class MessagesTranslator(Translator):
    """The generated stream as Messages events, or one Message body."""

    def __post_init__(self):
        self.id = f"msg_{uuid.uuid4().hex}"

    def _message(self, content: list) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }

    def _usage(self) -> dict:
        o = self.outcome
        return {
            "input_tokens": o.prompt_tokens - o.cached_tokens,
            "output_tokens": o.completion_tokens,
            "cache_read_input_tokens": o.cached_tokens,
            "cache_creation_input_tokens": 0,
        }

    def _stop(self) -> tuple[str, str | None]:
        seq = self.stop_sequence()
        if seq is not None:
            return "stop_sequence", seq
        return STOP_REASONS.get(self.outcome.finish_reason or "stop", "end_turn"), None

    @staticmethod
    def _block(block: dict, *, full: bool) -> dict:
        if block["kind"] == "reasoning":
            return {"type": "thinking", "thinking": block["text"] if full else "", "signature": ""}
        if block["kind"] == "text":
            return {"type": "text", "text": block["text"] if full else ""}
        try:
            args = json.loads(block["arguments"]) if full else {}
        except ValueError:
            args = {"_raw": block["arguments"]}
        return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": args}

    def start(self) -> list[bytes]:
        return [
            sse("message_start", {"type": "message_start", "message": self._message([])}),
            sse("ping", {"type": "ping"}),
        ]

    def open_block(self, index, block):
        return [
            sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": self._block(block, full=False),
                },
            )
        ]

    def delta(self, index, block, text):
        kind = {
            "reasoning": ("thinking_delta", "thinking"),
            "text": ("text_delta", "text"),
            "tool_call": ("input_json_delta", "partial_json"),
        }[block["kind"]]
        return [
            sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": kind[0], kind[1]: text},
                },
            )
        ]

    def close_block(self, index, block):
        out = []
        if block["kind"] == "reasoning":
            out.append(
                sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "signature_delta", "signature": ""},
                    },
                )
            )
        return out + [sse("content_block_stop", {"type": "content_block_stop", "index": index})]

    def finish(self):
        reason, seq = self._stop()
        return [
            sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": self._usage(),
                },
            ),
            sse("message_stop", {"type": "message_stop"}),
        ]

    def body(self) -> dict:
        msg = self._message([self._block(b, full=True) for b in self.blocks])
        msg["stop_reason"], msg["stop_sequence"] = self._stop()
        msg["usage"] = self._usage()
        return msg

    def error_body(self, status, message):
        return error_body(status, message)

    def error_event(self, message):
        return [sse("error", error_body(500, message))]

    def keepalive(self):
        return [sse("ping", {"type": "ping"})]
