"""The HTTP handler of an expert-parallel K3 (rank 0), on mlx-lm's ``APIHandler``: every
request validated before it reaches the generation loop (4xx errors in each API's
shape), routed to its API module, admitted (``k3dist.serve.admission``) and answered;
the streams a stop must end (``abort_streams``). ``k3dist.serve.server`` builds one for a
deployment and serves it."""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import socket
import threading
import time
from http import HTTPStatus
from typing import Any

from k3dist.config.deployment import Deployment
from k3dist.serve import (
    anthropic_api,
    auth,
    lockstep,
    metrics,
    openai_api,
    prefix_api,
    relay,
    responses_api,
    status_page,
    warmup,
)
from k3dist.serve.admission import Admission
from k3dist.serve.lockstep import ClientGone
from k3dist.serve.openai_api import IMAGE_PART_TYPES, RequestError

from mlx_lm import server as mlx_server

MAX_BODY_BYTES = 32 * 1024 * 1024
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
# The agent APIs: each translates its body into a chat completion (k3dist.serve.relay).
AGENT_PATHS = ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses")
# A token is rarely more than ~16 characters: longer prompts are refused before
# tokenizing them at all.
MAX_CHARS_PER_TOKEN = 16

# Handlers with a completion in flight (rank 0): what each has written so far.
_OPEN: dict = {}  # handler -> "queued" (nothing sent) or "stream" (SSE headers sent)
_OPEN_LOCK = threading.Lock()
# What /v1/k3dist tells a caller that is not on this machine (no paths, no memory).
PUBLIC_INFO = (
    "ranks",
    "build_hash",
    "placement",
    "placement_hash",
    "moe_form",
    "attention",
    "dtype",
    "max_context",
    "prefill_chunks",
    "max_batch",
    "vocab_size",
)


class _LateFailure(Exception):
    """mlx-lm answers a request its generator refused with an error head, but this
    stream's head was sent already: the failure becomes an error event (``_fail``)."""


def _error_body(message: str, kind: str = "server_error", code: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()


def abort_streams(message: str) -> int:
    """End every open completion with an explicit error: an SSE ``error`` event on a
    stream (the openai client raises on it; a bare closed socket would look like a
    normal end), a 503 on a request that has not been answered yet. Called by the
    watchdog when a rank is lost or the group stops. Returns how many."""
    event = f"data: {_error_body(message).decode()}\n\n".encode()
    body = _error_body(message)
    reply = (
        f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    with _OPEN_LOCK:
        handlers = list(_OPEN.items())
        _OPEN.clear()
    for h, state in handlers:
        h.aborted = True
        try:
            h.wfile.write(event if state == "stream" else reply)
            h.wfile.flush()
        except OSError:
            pass
    return len(handlers)


class K3APIHandler(mlx_server.APIHandler):
    # Set by handler_class() from the deployment: what the handler knows of it.
    deployment: Deployment
    model_id: str
    max_context: int
    vocab_size: int
    info: dict
    admission: Admission
    # k3dist.serve.vision.VisionLimits when the deployment serves images; None: text only
    vision_limits = None
    # socket timeout: a client that sends nothing (or reads nothing) for this long
    # gives its handler thread back
    timeout = 30
    aborted = False  # set by abort_streams: the answer was written from elsewhere
    _in_completion = False
    api_key: str | None = None  # every endpoint but /health asks for it when set
    _api = None  # the agent API module of this request (Anthropic's: errors in its shape)
    metrics: metrics.ServeMetrics | None  # /metrics, and requests counted by API
    _status: int | None = None  # the last status this request was answered with
    _route_path = ""

    def send_response(self, code, message=None):
        self._status = code
        super().send_response(code, message)

    def handle_one_request(self):
        """mlx-lm's, then the request counted once by API and final status."""
        self._status, self._route_path = None, ""
        super().handle_one_request()
        if self.metrics is not None and self._status is not None:
            api = metrics.api_of(self._route_path)
            if api != "other":
                self.metrics.requests.labels(api, str(self._status)).inc()

    keepalive_s: float  # the deployment's: the longest a stream stays silent
    _stream_open = False  # chat/completions: our head and first chunk are sent
    _last_beat = 0.0

    def _set_cors_headers(self):
        origins = self.response_generator.cli_args.allowed_origins
        origin = self.headers.get("Origin")
        if "*" in origins:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin is not None and origin in origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        else:
            return  # no cross-origin access configured: no CORS headers at all
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header(
            "Access-Control-Allow-Headers",
            "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta",
        )

    def _set_completion_headers(self, status_code: int = 200):
        if self._stream_open:
            raise _LateFailure(f"status {status_code} after the stream began")
        if self._in_completion and status_code == 404:
            # mlx-lm answers 404 when generate() fails (the request was valid): the
            # generation loop is gone (503) or failed on this request (500).
            status_code = 500 if self.response_generator.generation_available() else 503
        super()._set_completion_headers(status_code)

    def _set_stream_headers(self, status_code: int = 200):
        if self._stream_open:  # sent at once by _open_stream
            return
        super()._set_stream_headers(status_code)
        with _OPEN_LOCK:
            if self in _OPEN:
                _OPEN[self] = "stream"

    def end_headers(self):
        if self._stream_open and not getattr(self, "_headers_buffer", None):
            return  # mlx-lm ends the head _open_stream sent already
        super().end_headers()

    def _open_stream(self) -> None:
        """A streamed answer begins at once: its head and opening event, before the
        request reaches the generation loop (the agent APIs' through their relay)."""
        self._last_beat = time.monotonic()
        if isinstance(self.wfile, relay.Relay):
            self.wfile.open()
            return
        self._set_stream_headers(200)
        self.end_headers()
        first = self.generate_response("", None)
        delta = first["choices"][0].get("delta")
        if delta is not None:
            delta["content"] = ""
        self.wfile.write(f"data: {json.dumps(first)}\n\n".encode())
        self.wfile.flush()
        self._stream_open = True

    def _idle(self) -> None:
        """Called by the generator while this handler waits for its request's next event
        (lockstep.SUBMITTER.idle): a keep-alive once nothing was sent for keepalive_s. A
        client that went away is found by the ranks' next check of its socket."""
        now = time.monotonic()
        if now - self._last_beat < self.keepalive_s:
            return
        self._last_beat = now
        try:
            if isinstance(self.wfile, relay.Relay):
                self.wfile.beat()
            elif self._stream_open:
                self.wfile.write(b": keep-alive\n\n")
                self.wfile.flush()
        except OSError:
            pass

    def handle_completion(self, request, stop_words):
        with _OPEN_LOCK:
            _OPEN[self] = "queued"
        self._in_completion = True
        lockstep.SUBMITTER.socket = self.connection
        lockstep.SUBMITTER.idle = self._idle if self.stream else None
        try:
            if self.stream:
                self._open_stream()
            super().handle_completion(request, stop_words)
        except (BrokenPipeError, ConnectionResetError, ClientGone) as e:
            # the client went away: ctx.stop() (in mlx-lm's finally) ends the request on
            # every rank at the next agreed check, which logs it (one line)
            logging.debug("client %s went away mid-request (%r)", self.address_string(), e)
        except _LateFailure as e:  # the generator refused it after our head was sent
            logging.error("request failed: %s", e.__context__ or e)
            self._fail(e.__context__ or e)
        except Exception as e:  # noqa: BLE001 - the client must hear about it
            logging.exception("request failed")
            self._fail(e)
        finally:
            lockstep.SUBMITTER.socket = None
            lockstep.SUBMITTER.idle = None
            with _OPEN_LOCK:
                _OPEN.pop(self, None)

    def _fail(self, e: Exception) -> None:
        """End a request that failed after mlx-lm took it, explicitly: an SSE error
        event if the stream has begun, else a 5xx instead of the pending 200."""
        if self.aborted:
            return
        alive = self.response_generator.generation_available()
        why = str(e) or type(e).__name__
        message = (
            f"generation failed: {why}"
            if alive
            else (f"the generation loop has stopped ({why}); the server must be restarted")
        )
        try:
            if self.stream and getattr(self, "_headers_buffer", None) == []:
                self.wfile.write(f"data: {_error_body(message).decode()}\n\n".encode())
            else:
                self._headers_buffer = []  # drop the unsent "200 OK"
                body = _error_body(message)
                super()._set_completion_headers(500 if alive else 503)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            pass

    def _error(self, e: RequestError, headers: dict | None = None) -> None:
        body = json.dumps(
            anthropic_api.error_body(e.status, str(e)) if self._api is anthropic_api else e.body()
        ).encode()
        self._set_completion_headers(e.status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if e.status == 413:
            self._linger()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals; a request line or header too long (414, 431) leaves
        the rest of the request unread: linger so the client reads the answer, not a
        reset."""
        super().send_error(code, message, explain)
        if code in (HTTPStatus.REQUEST_URI_TOO_LONG, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE):
            self._linger()

    def _linger(self, seconds: float = 5.0) -> None:
        """The body was not read: closing now would reset the connection (unread data)
        before a client still sending it reads the answer. Half-close, then discard
        what is still coming for a few seconds (nginx's lingering close)."""
        self.close_connection = True
        if self.command == "HEAD":  # no body; the head is still being written (do_HEAD)
            return
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(1 << 20):
                    break
        except OSError:
            pass

    def _check_images(self, body: dict) -> list:
        """A chat request's images, each checked (and made a data URL) before any rank
        works: 400 naming the image and what is wrong."""
        if self.vision_limits is None:
            return []
        from k3dist.serve import vision

        parts = [
            (f"messages[{i}].content[{j}]", p)
            for i, m in enumerate(body["messages"])
            if isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"])
            if p.get("type") in IMAGE_PART_TYPES
        ]
        if len(parts) > self.vision_limits.max_images:
            raise RequestError(
                400,
                f"{len(parts)} images in one request; at most {self.vision_limits.max_images}",
                "messages",
            )
        try:
            return [vision.check_image_part(p, self.vision_limits, where) for where, p in parts]
        except vision.ImageError as e:
            raise RequestError(400, str(e), "messages") from None

    def _prompt(
        self, req: openai_api.ChatRequest | openai_api.TextRequest
    ) -> tuple[mlx_server.CompletionRequest, int]:
        """mlx-lm's request for ``req`` (its handler's own ``handle_*_completions``) and
        the prompt's token count. The prompt is rendered and tokenized here, once: the
        tokens travel with the request to every rank (``lockstep.Prompt``). A chat with
        images is counted as the processor expands it, and tokenized by every rank's
        generator (its pixels stay off the collective)."""
        self.body = req.body()  # what mlx-lm's handle_*_completions read
        chat = isinstance(req, openai_api.ChatRequest)
        images = self._check_images(self.body) if chat else []
        if req.chars() > MAX_CHARS_PER_TOKEN * self.max_context:
            raise RequestError(
                400,
                f"prompt of {req.chars()} characters cannot fit the "
                f"context of {self.max_context} tokens",
                code="context_length_exceeded",
            )
        request = self.handle_chat_completions() if chat else self.handle_text_completions()
        try:
            if not images:
                prompt = self.response_generator.tokenize(request, self.chat_template_kwargs)
                return prompt, len(prompt.tokens)
            from k3dist.serve import vision

            tok = self.response_generator.model_provider.tokenizer
            text = tok.apply_chat_template(
                self.body["messages"],
                tools=self.body["tools"],
                add_generation_prompt=True,
                tokenize=False,
                **(self.chat_template_kwargs or {}),
            )
            processor = self.response_generator.model_provider.processor
            return request, len(vision.prompt_tokens(tok, processor, text, images))
        except Exception as e:  # a template that cannot render these messages
            raise RequestError(400, f"messages cannot be rendered: {e}") from None

    def _read_json(self) -> Any:
        """The request's body, read and parsed: the only parse of it."""
        try:
            length = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            length = -1
        if length < 0:
            raise RequestError(411, "a Content-Length header with a length is required")
        if length > MAX_BODY_BYTES:
            raise RequestError(
                413,
                f"request body of {length} bytes exceeds {MAX_BODY_BYTES}",
                code="request_too_large",
            )
        raw = self.rfile.read(length)
        if not self.response_generator.generation_available():
            raise RequestError(
                503,
                "the generation loop has stopped; the server must be restarted",
                code="generation_stopped",
            )
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RequestError(400, f"request body is not valid UTF-8 ({e})") from None
        except json.JSONDecodeError as e:
            raise RequestError(400, f"request body is not valid JSON ({e})") from None
        except RecursionError:
            raise RequestError(
                400,
                f"request body is nested too deeply (at most {openai_api.MAX_JSON_DEPTH} levels)",
            ) from None

    def _check(
        self, path: str, body: Any, **stream
    ) -> openai_api.ChatRequest | openai_api.TextRequest:
        """``body`` checked by the OpenAI API module, and set on this handler as
        mlx-lm's ``do_POST`` would (``stream``: what an agent API's relay needs)."""
        req = openai_api.validate(
            path,
            body,
            model_id=self.model_id,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
            images=self.vision_limits is not None,
        )
        fields = openai_api.handler_fields(req, self.response_generator.cli_args)
        for k, v in (fields | stream).items():
            setattr(self, k, v)
        return req

    def _authorized(self) -> bool:
        """Refuse (401, in the API's shape) a request without the deployment's key."""
        if auth.allowed(self.headers, self.api_key):
            return True
        self._error(
            RequestError(
                401,
                "a valid API key is required (Authorization: Bearer <key> or x-api-key: <key>)",
                code="invalid_api_key",
            )
        )
        self._linger()  # the body was not read
        return False

    def _route(self) -> str:
        """Route on the URL's path: the query string is ignored (Claude Code posts to
        ``/v1/messages?beta=true``), and ``self.path`` becomes the bare path (mlx-lm's
        handler routes on it). Errors under ``/v1/messages`` take Anthropic's shape."""
        path = self.path.partition("?")[0].partition("#")[0]
        if "://" in path:  # absolute-form (through a proxy): its path
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        self.path = self._route_path = path
        if path == "/v1/messages" or path.startswith("/v1/messages/"):
            self._api = anthropic_api
        elif path == "/v1/responses" or path.startswith("/v1/responses/"):
            self._api = responses_api
        return path

    def _not_found(self) -> None:
        self._error(
            RequestError(
                404, f"no such endpoint: {self.command} {self.path[:200]}", code="not_found"
            )
        )
        self._linger()  # a body, if any, was not read

    def do_POST(self):
        path = self._route()
        if not self._authorized():
            return
        if path == prefix_api.PATH:
            return self._precompute()
        if path not in COMPLETION_PATHS + AGENT_PATHS:
            return self._not_found()
        agent = None  # the agent API's request (Responses: the parsed request)
        try:
            body = self._read_json()
            if self._api is not None:
                agent, body = self._agent_body(body)
                self.path = "/v1/chat/completions"  # what is run
            req = self._check(
                self.path,
                body,
                **(
                    {}
                    if agent is None
                    else {"stream": True, "stream_options": {"include_usage": True}}
                ),
            )
            prompt, n_prompt = self._prompt(req)
            if path == "/v1/messages/count_tokens":
                return self._json(200, {"input_tokens": n_prompt})
            if n_prompt < 1:  # mlx-lm's batch loop dies on an empty prompt (every rank)
                raise RequestError(
                    400, "prompt is empty: it must have at least one token", "prompt"
                )
            room = self.max_context - n_prompt
            if room < 1 or (req.asked is not None and req.asked > room):
                raise RequestError(
                    400,
                    f"prompt of {n_prompt} tokens plus max_tokens "
                    f"{req.asked or 1} exceeds the context of "
                    f"{self.max_context} tokens",
                    code="context_length_exceeded",
                )
            if req.asked is None:  # unasked: the server default, capped to what fits
                self.max_tokens = min(self.response_generator.cli_args.max_tokens, room)
        except RequestError as e:
            return self._error(e)
        except relay.BadRequest as e:
            return self._error(RequestError(e.status, str(e), e.param))
        if not self._admit():
            return
        t0 = time.monotonic()
        sink = self._relay(agent, n_prompt, req.stop_words()) if agent is not None else None
        try:
            return self.handle_completion(prompt, req.stop_words())
        finally:
            self.admission.leave(time.monotonic() - t0)
            if sink is not None:
                sink.end()

    def _admit(self) -> bool:
        """Take a place among the completions in flight, or answer 429 with a
        Retry-After (the caller then returns)."""
        if self.admission.enter():
            return True
        self._error(
            RequestError(
                429,
                f"{self.admission.limit} requests are already in flight; retry later",
                code="too_many_requests",
            ),
            {"Retry-After": str(self.admission.retry_after())},
        )
        return False

    def _precompute(self) -> None:
        """``POST /v1/k3dist/prefix`` (``k3dist.serve.prefix_api``): the prefix runs as a
        one-token chat completion through the lockstep loop (mlx-lm keeps a chat's system
        segment as a ``system`` entry)."""
        try:
            chat = prefix_api.to_chat(self._read_json(), self.model_id)
            self.path = "/v1/chat/completions"
            prompt, _ = self._prompt(self._check(self.path, chat))
            ids = prompt.tokens
            # the system segment mlx-lm's cache keeps (its _tokenize found it)
            segments, kinds = prompt.tokenized[1], prompt.tokenized[2]
            n = len(segments[0]) if kinds[0] == "system" else 0
            if len(ids) + 1 > self.max_context:
                raise RequestError(
                    400,
                    f"prefix of {len(ids)} tokens exceeds the context of {self.max_context}",
                    code="context_length_exceeded",
                )
        except RequestError as e:
            return self._error(e)
        except (ValueError, TypeError, AttributeError) as e:  # the template
            return self._error(RequestError(400, str(e)))
        if not self._admit():
            return
        out, self.wfile = self.wfile, io.BytesIO()  # mlx-lm's answer is not the reply
        t0 = time.monotonic()
        try:
            self.handle_completion(prompt, [])
        finally:
            self.admission.leave(time.monotonic() - t0)
            answered, self.wfile = self.wfile.getvalue(), out
        if b" 200 " not in answered.split(b"\r\n", 1)[0]:
            return self._error(
                RequestError(
                    500, "the prefix run failed: " + answered.decode("utf-8", "replace")[-300:]
                )
            )
        store = getattr(self.response_generator.prompt_cache, "store", None)
        self._json(200, prefix_api.answer(n, time.monotonic() - t0, ids, store))

    def _agent_body(self, body: Any) -> tuple[Any, dict]:
        """An agent API request (Responses: parsed; Anthropic: its body) and the
        chat-completion body it runs as: translated once."""
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        if self._api is responses_api:
            chat, req = responses_api.to_chat(body)
            return req, chat
        return body, anthropic_api.to_chat(body, count_only=self.path.endswith("count_tokens"))

    def _relay(self, agent: Any, n_prompt: int, stops: list[str]) -> relay.Relay:
        """Run the chat completion streamed, and answer in the agent API's shape: the
        handler's wfile becomes a Relay (what it writes is translated), its generator a
        Tap (the raw text tells which stop sequence ended generation)."""
        tok = self.response_generator.model_provider.tokenizer
        client_stream = agent.stream if self._api is responses_api else agent.get("stream")
        t = (
            responses_api.ResponsesTranslator
            if self._api is responses_api
            else anthropic_api.MessagesTranslator
        )(
            model=self.model_id,
            stream=bool(client_stream),
            prompt_tokens=n_prompt,
            stop_sequences=stops,
            eos_token_ids=tuple(tok.eos_token_ids),
        )
        if self._api is responses_api:
            t.request = agent
        saved, self._headers_buffer = getattr(self, "_headers_buffer", []), []
        self._set_cors_headers()  # the relay writes its own heads: with these lines
        cors, self._headers_buffer = b"".join(self._headers_buffer), saved
        sink = relay.Relay(self.wfile, t, cors)
        self.wfile = sink
        self.response_generator = relay.Tap(self.response_generator, t.outcome)
        return sink

    def _json(self, status: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _static(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _is_local(self) -> bool:
        try:
            addr = ipaddress.ip_address(self.client_address[0])
        except ValueError:
            return False
        mapped = getattr(addr, "ipv4_mapped", None)
        return (mapped or addr).is_loopback

    def do_GET(self):
        path = self._route()
        if path == "/health":
            return self.handle_health_check()
        if path == "/":  # a client's probe of the base URL (HEAD / too)
            return self._json(200, {"status": "ok"})
        if path in status_page.FILES and self.metrics is not None:  # no data: no key
            return self._static(*status_page.FILES[path])
        if not self._authorized():
            return
        if path in ("/metrics", status_page.PLACEMENT_PATH) and self.metrics is not None:
            if path == "/metrics":
                return self._static(self.metrics.render(), metrics.CONTENT_TYPE)
            return self._static(self.metrics.placement_json(), "application/json")
        if self.path.startswith("/v1/models"):
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(
                json.dumps(
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": self.model_id,
                                "object": "model",
                                "created": self.created,
                                "owned_by": "k3dist",
                            }
                        ],
                    }
                ).encode()
            )
        elif self.path == "/v1/k3dist":
            self._set_completion_headers(200)
            self.end_headers()
            if self._is_local():
                model = self.response_generator.model_provider.model
                loaded = warmup.jit_kernels_loaded()
                warmed = set(self.info.get("warmup_kernels") or ())
                info = dict(
                    self.info,
                    jit_kernels=warmup.jit_kernel_count(),
                    jit_kernels_loaded=None if loaded is None else len(loaded),
                    jit_kernels_after_warmup=None
                    if loaded is None
                    else sorted(set(loaded) - warmed),
                    shapes_seen=sorted(getattr(model, "shapes_seen", set()).copy()),
                )
                # the requests in flight, each with its prefill's progress
                info["requests"] = self.response_generator.progress()
                store = getattr(self.response_generator.prompt_cache, "store", None)
                if store is not None:  # now, not at start: its writes so far
                    info["prefix_cache"] = store.report()
            else:  # folders, free memory and library paths stay on this machine
                info = {k: self.info[k] for k in PUBLIC_INFO if k in self.info}
            self.wfile.write(json.dumps(info).encode())
        else:
            self._not_found()

    def do_HEAD(self):
        """GET's status and headers, without the body (http.server answers 501)."""
        real, self.wfile = self.wfile, io.BytesIO()
        try:
            self.do_GET()
        finally:
            out, self.wfile = self.wfile.getvalue(), real
        head, _, body = out.partition(b"\r\n\r\n")
        if b"\r\ncontent-length:" not in head.lower():
            head += f"\r\nContent-Length: {len(body)}".encode()
        self.wfile.write(head + b"\r\n\r\n")
