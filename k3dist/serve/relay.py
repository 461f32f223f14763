"""The chat-completions stream, retold in another API's shape.

The Anthropic Messages and OpenAI Responses endpoints translate their request into
a chat-completion body that runs through the same handler as ``/v1/chat/completions``
(validation, admission, lockstep on every rank, agreed stops). The handler is told to
stream, with usage; its ``wfile`` is a ``Relay`` that reads those OpenAI chunks back
(reasoning, text, tool calls, finish, usage, errors) and hands them to a ``Translator``,
which writes the other API's events, or one JSON body at the end when the client did
not ask to stream. ``Tap`` records the raw generated text and tokens, so a ``stop``
finish can be told apart: a stop sequence (which one) or the end-of-turn token.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any


class BadRequest(ValueError):
    """A request the API refuses (its status and message, in the API's own shape)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def validation_message(e) -> str:
    """A pydantic ValidationError in one line: where, and what is wrong."""
    err = max(e.errors(), key=lambda x: len(x["loc"]))  # the deepest: a union's member
    where = ".".join(
        str(x)
        for x in err["loc"]
        if not (isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x))
    )
    return f"{where}: {err['msg']}" if where else err["msg"]


@dataclass
class Outcome:
    """What the generation produced, as far as the relay has read it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None  # OpenAI's: stop, length, tool_calls
    raw_text: str = ""  # every generated token's text, control sequences included
    last_token: int | None = None


class Tap:
    """The handler's response generator, recording each generated token."""

    def __init__(self, inner, outcome: Outcome):
        self._inner, self._outcome = inner, outcome

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, request, args, progress_callback=None):
        ctx, responses = self._inner.generate(request, args, progress_callback)

        def tapped():
            for r in responses:
                text = r.text
                if not text and r.finish_reason == "stop":
                    # the batch path does not decode the token that completed a stop
                    # sequence: decode it here, so the sequence can be told apart
                    text = self._inner.model_provider.tokenizer.decode([r.token])
                self._outcome.raw_text += text
                self._outcome.last_token = r.token
                yield r

        return ctx, tapped()


@dataclass
class Translator:
    """One request's events in another API. Subclasses write blocks: ``open_block``,
    ``delta``, ``close_block``, ``finish`` (streamed) and ``body`` (not streamed)."""

    model: str
    stream: bool
    prompt_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    outcome: Outcome = field(default_factory=Outcome)
    blocks: list[dict] = field(default_factory=list)  # {"kind", "text"|"call"}
    _open: str | None = None

    def __post_init__(self):  # subclasses set their ids here
        pass

    # -- what the relay calls -------------------------------------------------
    def on_text(self, kind: str, text: str) -> list[bytes]:
        """``kind``: "reasoning" or "text"."""
        out = []
        if self._open != kind:
            out += self._close()
            self.blocks.append({"kind": kind, "text": ""})
            self._open = kind
            out += self.open_block(len(self.blocks) - 1, self.blocks[-1])
        self.blocks[-1]["text"] += text
        return out + self.delta(len(self.blocks) - 1, self.blocks[-1], text)

    def on_tool_call(self, call: dict) -> list[bytes]:
        out = self._close()
        fn = call.get("function") or {}
        block = {
            "kind": "tool_call",
            "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "name": fn.get("name", ""),
            "arguments": fn.get("arguments") or "{}",
        }
        self.blocks.append(block)
        i = len(self.blocks) - 1
        out += self.open_block(i, block)
        out += self.delta(i, block, block["arguments"])
        return out + self.close_block(i, block)

    def on_end(self) -> list[bytes]:
        return self._close() + self.finish()

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return self.close_block(len(self.blocks) - 1, self.blocks[-1])

    def stop_sequence(self) -> str | None:
        """The stop sequence that ended generation, if one did."""
        o = self.outcome
        if o.finish_reason != "stop" or o.last_token in self.eos_token_ids:
            return None
        tail = o.raw_text[-4 * max((len(s) for s in self.stop_sequences), default=0) - 16 :]
        hits = [(tail.rfind(s), s) for s in self.stop_sequences if s in tail]
        return max(hits)[1] if hits else None

    # -- what each API defines ------------------------------------------------
    def start(self) -> list[bytes]:
        return []

    def open_block(self, index: int, block: dict) -> list[bytes]:
        return []

    def delta(self, index: int, block: dict, text: str) -> list[bytes]:
        return []

    def close_block(self, index: int, block: dict) -> list[bytes]:
        return []

    def finish(self) -> list[bytes]:
        return []

    def body(self) -> dict:
        raise NotImplementedError

    def error_body(self, status: int, message: str) -> dict:
        raise NotImplementedError

    def error_event(self, message: str) -> list[bytes]:
        raise NotImplementedError

    def keepalive(self) -> list[bytes]:
        """An event while the prompt is prefilled (agents drop a silent stream); sent
        when nothing else was for the handler's ``keepalive_s``."""
        return []


def sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def head(status: int, content_type: str, length: int | None = None, extra: bytes = b"") -> bytes:
    """A response head; ``extra``: header lines as the handler wrote them (CORS)."""
    lines = [f"HTTP/1.0 {status} {HTTPStatus(status).phrase}", f"Content-Type: {content_type}"]
    if content_type == "text/event-stream":
        lines.append("Cache-Control: no-cache")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n").encode() + extra + b"\r\n"


class Relay:
    """Stands in for the handler's ``wfile`` while mlx-lm's handler streams a
    chat completion: parses what it writes and forwards the translation to ``out``."""

    def __init__(self, out, translator: Translator, headers: bytes = b""):
        self.out, self.t, self.headers = out, translator, headers
        self.buf = b""
        self.status: int | None = None  # of mlx-lm's reply, once its headers are read
        self.started = False  # our own headers sent (streaming)
        self.done = False
        self.client_gone = False  # a write to the client failed: nothing more is sent

    # file protocol -------------------------------------------------------------
    def write(self, data: bytes) -> int:
        if self.client_gone:  # the handler stops at its next write
            raise BrokenPipeError("the client went away")
        self.buf += bytes(data)
        if self.status is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if self.buf.startswith(b"data: "):  # abort_streams / _fail mid-stream
                    self.status = 200
                else:
                    return len(data)
            else:
                first = self.buf[:end].split(b"\r\n", 1)[0].split()
                self.status = int(first[1]) if len(first) > 1 and first[1].isdigit() else 500
                self.buf = self.buf[end + 4 :]
            if self.status == 200 and not self.started:
                self._send(self.t.start())
        if self.status == 200:
            while (end := self.buf.find(b"\n\n")) >= 0:
                event, self.buf = self.buf[:end], self.buf[end + 2 :]
                if event.startswith(b"data: "):
                    self._chunk(event[6:].decode("utf-8", "replace"))
        return len(data)

    def open(self) -> None:
        """A streamed answer's head and opening events, sent at once (before the request
        reaches the generation loop): a client sees the stream begin while it waits."""
        if self.status is None and not self.started:
            self._send(self.t.start())

    def beat(self) -> None:
        """A keep-alive in the API's own form, while nothing else is sent (the prefill)."""
        if self.started and not self.done:
            self._send(self.t.keepalive())

    def flush(self) -> None:
        try:
            self.out.flush()
        except OSError:
            pass

    @property
    def closed(self) -> bool:
        return self.out.closed

    def close(self) -> None:
        self.out.close()

    def end(self) -> None:
        """The handler is done: answer what has not been answered (never raises: a
        client that went away is not told)."""
        if self.done or self.client_gone:
            return
        if self.status not in (None, 200):  # mlx-lm's error reply before any token
            try:
                message = json.loads(self.buf.decode("utf-8", "replace")).get("error")
            except ValueError:
                message = None
            message = message.get("message") if isinstance(message, dict) else message
            self._fail(str(message or "generation failed"), self.status)
        else:
            self._fail("the generation ended without a finish")

    # ------------------------------------------------------------------------------
    def _out(self, data: bytes) -> None:
        """Write to the client. One that went away ends the answer here; the handler
        raises on its own next write to the relay (``write``), which stops the request
        on every rank."""
        if self.client_gone:
            raise BrokenPipeError("the client went away")
        try:
            self.out.write(data)
            self.out.flush()
        except OSError:
            self.client_gone = self.done = True
            raise

    def _send(self, parts: list[bytes]) -> None:
        if not parts or not self.t.stream:
            return
        if not self.started:
            parts = [head(200, "text/event-stream", extra=self.headers), *parts]
            self.started = True
        self._out(b"".join(parts))

    def _reply(self, status: int, body: dict) -> None:
        self.done = True
        raw = json.dumps(body, ensure_ascii=False).encode()
        self._out(head(status, "application/json", len(raw), self.headers) + raw)

    def _fail(self, message: str, status: int = 500) -> None:
        """An error: an error event if our stream has begun, else an error reply."""
        if self.client_gone:
            self.done = True
            return
        if not self.started:
            try:
                return self._reply(status, self.t.error_body(status, message))
            except OSError:
                return  # nobody left to tell
        self.done = True
        try:
            self._out(b"".join(self.t.error_event(message)))
        except OSError:
            pass

    def _chunk(self, data: str) -> None:
        if self.done:
            return
        if data.strip() == "[DONE]":
            self.done = True
            parts = self.t.on_end()
            if self.t.stream:
                self._send(parts)
            else:
                raw = json.dumps(self.t.body(), ensure_ascii=False).encode()
                self._out(head(200, "application/json", len(raw), self.headers) + raw)
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if "error" in chunk:  # the generation failed mid-way, or the group stopped
            err = chunk["error"]
            return self._fail(err.get("message", "failed") if isinstance(err, dict) else str(err))
        o = self.t.outcome
        if chunk.get("usage"):
            u = chunk["usage"]
            o.prompt_tokens = u.get("prompt_tokens", 0)
            o.completion_tokens = u.get("completion_tokens", 0)
            o.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        parts: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                parts += self.t.on_text("reasoning", delta["reasoning"])
            if delta.get("content"):
                parts += self.t.on_text("text", delta["content"])
            for call in delta.get("tool_calls") or []:
                parts += self.t.on_tool_call(call)
            if choice.get("finish_reason"):
                o.finish_reason = choice["finish_reason"]
        self._send(parts)
