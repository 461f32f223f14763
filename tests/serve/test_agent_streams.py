"""Issue 41: streams show life from the start, through the official SDKs.

A 2-rank server (mlx.launch on loopback) whose prefill sleeps in every chunk on every
rank (tests/scripts/serve_paused.py ``--prefill-pause-s``): each request's prefill is
silent for longer than its client's idle (read) time-out. The openai and anthropic
packages, given that time-out, still finish each stream: its opening event (a first
chat chunk, ``response.created``, ``message_start``) comes at once and keep-alives
(``keepalive_s``) keep coming while the prefill runs; on the wire they are each API's
own (an SSE comment on chat completions, Anthropic ``ping``, Responses
``response.in_progress``)."""

from __future__ import annotations

import json
import socket
import time

import anthropic
import openai
import pytest
from serving import Server
from util import REPO

PAUSE_S = 3.0  # each prefill chunk, every rank
CHUNK = 512  # each prompt (K3's template and a short user turn, no thinking): one chunk
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}  # no think tail: one segment
KEEPALIVE_S = 0.5
READ_TIMEOUT_S = 2.0  # the clients' idle time-out: shorter than one chunk's pause


@pytest.fixture(scope="module")
def slow(ranks, tmp_path_factory):
    s = Server(
        ranks,
        tmp_path_factory.mktemp("streams"),
        (
            "--no-warmup",
            "--prefill-chunk",
            str(CHUNK),
            "--keepalive-s",
            str(KEEPALIVE_S),
            "--prefill-pause-s",
            str(PAUSE_S),
        ),
        entry=REPO / "tests/scripts/serve_paused.py",
    )
    yield s
    s.stop()


def _text(name: str) -> str:
    """A user turn of about 40 tokens, its own per test, so that no request finds
    another's prompt in the cache."""
    return f"{name}: " + " ".join(f"item {i} of the {name} list" for i in range(6))


def _timeout(sdk):
    """The SDK's own time-out object: READ_TIMEOUT_S between two reads of the stream."""
    return sdk.Timeout(READ_TIMEOUT_S, connect=5.0)


def _check(events, kind: str) -> None:
    first, last = events[0][0], events[-1][0]
    print(f"\n{kind}: first event after {first:.2f}s, stream done after {last:.2f}s")
    assert first < PAUSE_S, events[:2]  # before the prefill's first chunk is done
    assert last > PAUSE_S, last  # the prefill was silent past the clients' time-out


def test_openai_chat_stream_outlives_idle_timeout(slow):
    c = openai.OpenAI(
        base_url=slow.url + "/v1", api_key="none", max_retries=0, timeout=_timeout(openai)
    )
    t0 = time.perf_counter()
    stream = c.chat.completions.create(
        model="kimi-k3",
        messages=[{"role": "user", "content": _text("chat")}],
        max_tokens=3,
        temperature=0,
        stream=True,
        extra_body=NO_THINKING,
    )
    events = [(time.perf_counter() - t0, e) for e in stream]
    _check(events, "chat.completions")
    assert events[0][1].choices[0].delta.role == "assistant"
    assert events[-1][1].choices[0].finish_reason is not None


def test_openai_responses_stream_outlives_idle_timeout(slow):
    c = openai.OpenAI(
        base_url=slow.url + "/v1", api_key="none", max_retries=0, timeout=_timeout(openai)
    )
    t0 = time.perf_counter()
    stream = c.responses.create(
        model="kimi-k3",
        input=_text("responses"),
        max_output_tokens=3,
        reasoning={"effort": "none"},  # no thinking (k3dist.serve.responses_api)
        stream=True,
    )
    events = [(time.perf_counter() - t0, e) for e in stream]
    _check(events, "responses")
    kinds = [e.type for _, e in events]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    # the keep-alives of the silent prefill: in progress, before any output item
    assert kinds.count("response.in_progress") >= PAUSE_S / KEEPALIVE_S / 2, kinds


def test_anthropic_stream_outlives_idle_timeout(slow):
    c = anthropic.Anthropic(
        base_url=slow.url, api_key="none", max_retries=0, timeout=_timeout(anthropic)
    )
    t0 = time.perf_counter()
    stream = c.messages.create(
        model="kimi-k3",
        max_tokens=3,
        messages=[{"role": "user", "content": _text("messages")}],
        stream=True,
    )
    events = [(time.perf_counter() - t0, e) for e in stream]
    _check(events, "messages")
    kinds = [e.type for _, e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds


def _raw(port: int, path: str, body: dict) -> list[tuple[float, bytes]]:
    """A streamed request on a raw socket: each SSE event or comment with its arrival."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: k3\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    t0, buf, out = time.perf_counter(), b"", []
    try:
        while more := s.recv(65536):
            buf += more
            while (end := buf.find(b"\n\n")) >= 0:
                out.append((time.perf_counter() - t0, buf[:end]))
                buf = buf[end + 2 :]
    finally:
        s.close()
    return out


@pytest.mark.parametrize(
    "path,keepalive",
    [("/v1/chat/completions", b": keep-alive"), ("/v1/messages", b"event: ping")],
    ids=["chat", "messages"],
)
def test_keepalives_are_each_apis_own_at_a_bounded_interval(slow, path, keepalive):
    body = {
        "model": "kimi-k3",
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": _text(f"raw {path}")}],
        **(NO_THINKING if path.endswith("completions") else {}),
    }
    events = _raw(slow.port, path, body)
    beats = [t for t, e in events if keepalive in e]
    opening = events[0][1]
    assert opening.startswith(b"HTTP/1.0 200"), opening
    assert events[0][0] < PAUSE_S, events[:2]
    # the silent part: from the opening event to the next one that is not a keep-alive
    first_text = next(t for t, e in events[1:] if keepalive not in e)
    times = [events[0][0], *(t for t in beats if t < first_text), first_text]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    print(f"\n{path}: {len(beats)} keep-alives, longest silence {max(gaps):.2f}s")
    assert first_text > PAUSE_S, events
    assert len(beats) >= 2, events
    assert max(gaps) < READ_TIMEOUT_S, gaps
