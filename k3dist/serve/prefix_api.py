"""``POST /v1/k3dist/prefix``: pre-compute a chat prefix (system prompt + tools) into the
prompt caches and, with ``prefix_cache_dir``, their on-disk store, so a session's first
turn is warm even after a restart. The request as a pydantic model (what it accepts),
the one-token chat completion it runs as, and the answer.

    {"messages": [system or developer messages], "tools": [...], "chat_template_kwargs": {...}}

Answers ``prefix_tokens`` (the system segment mlx-lm's cache keeps), ``seconds``,
``stored`` and the entry's ``key``, and the store's report."""

from __future__ import annotations

from typing import Any, Literal

from k3dist.serve.openai_api import RequestError

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PATH = "/v1/k3dist/prefix"
MESSAGES = (
    "messages must be a non-empty list of system (or developer) messages: the prefix every "
    "session starts with"
)


class PrefixMessage(BaseModel):
    """A system or developer message; its other keys go to the chat template as sent."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer"]


class PrefixRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[PrefixMessage] = Field(min_length=1)
    # checked as a chat completion's (k3dist.serve.openai_api), which this runs as
    tools: Any = None
    chat_template_kwargs: Any = None


def to_chat(body: Any, model_id: str) -> dict:
    """The one-token chat completion that prefills the prefix: its messages, then a
    placeholder user turn (the prefix is the start of a chat whose first turn is to
    come). RequestError (400) if the body is not a prefix."""
    if not isinstance(body, dict):
        raise RequestError(400, MESSAGES, "messages")
    try:
        req = PrefixRequest.model_validate(body)
    except ValidationError:
        raise RequestError(400, MESSAGES, "messages") from None
    return {
        "model": model_id,
        "tools": req.tools,
        "max_tokens": 1,
        "temperature": 0,
        "chat_template_kwargs": req.chat_template_kwargs,
        "messages": [*(m.model_dump() for m in req.messages), {"role": "user", "content": "."}],
    }


def answer(n: int, seconds: float, ids: list[int], store) -> dict:
    """The reply: the prefix's token count ``n`` of the prompt ``ids``, and whether the
    prompt cache's store (None: memory only) holds it now."""
    stored = bool(store is not None and n and store.has(ids[:n]))
    return {
        "prefix_tokens": n,
        "seconds": round(seconds, 3),
        "stored": stored,
        "key": store.key(ids[:n]) if stored else None,
        "prefix_cache": store.report() if store is not None else None,
    }
