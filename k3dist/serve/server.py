"""OpenAI-compatible HTTP serving of an expert-parallel K3, on mlx-lm's server.

mlx_lm.server already runs generation in lockstep on every rank (rank 0 shares
each request with an ``all_sum``; all ranks run the same steps). We add only what
expert parallelism and a two-box deployment need:

- ``K3ModelProvider``: the model is this rank's EP model, loaded before serving;
  a request naming another model is refused (mlx-lm would try to load that path).
- ``K3ResponseGenerator``: requests are served one at a time (the warm-up covers
  batch 1 only; mlx-lm's batching would bring new batch shapes mid-flight), and
  each rank can log the tokens it generated, so ranks can be compared.
- ``K3APIHandler``: every request is validated before it reaches the generation
  loop (OpenAI-style 4xx errors), prompts longer than the context are refused at
  once, ``/v1/models`` lists the served model without scanning a Hugging Face
  cache, and ``/v1/k3dist`` reports the deployment.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import socket
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from queue import Queue
from typing import Any

from k3dist.serve import compat, warmup

import mlx.core as mx
from mlx_lm import server as mlx_server

MAX_BODY_BYTES = 32 * 1024 * 1024
ROLES = ("system", "user", "assistant", "tool", "developer")
# A token is rarely more than ~16 characters: longer prompts are refused before
# tokenizing them at all.
MAX_CHARS_PER_TOKEN = 16


class RequestError(ValueError):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error",
                          "param": self.param, "code": self.code}}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_content(content: Any, where: str) -> int:
    """Message content: a string, null (assistant with tool calls) or a list of
    text parts. Returns its character count."""
    if content is None or isinstance(content, str):
        return len(content or "")
    if isinstance(content, list):
        n = 0
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(400, f"{where}.content[{i}] must be an object with a type",
                                   f"{where}.content")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise RequestError(400, f"{where}.content[{i}].text must be a string",
                                       f"{where}.content")
                n += len(part["text"])
            else:
                raise RequestError(400, f"{where}.content[{i}] has type {part['type']!r}; this "
                                   "deployment serves text only", f"{where}.content")
        return n
    raise RequestError(400, f"{where}.content must be a string or a list of parts, not "
                       f"{type(content).__name__}", f"{where}.content")


def validate_request(path: str, body: Any, *, model_id: str, max_context: int) -> int:
    """Check a completion request's shape and values before it is queued.
    Returns the prompt's character count (for the cheap length pre-check)."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    model = body.get("model", model_id)
    if not isinstance(model, str):
        raise RequestError(400, "model must be a string", "model")
    if model not in (model_id, "default_model"):
        raise RequestError(404, f"model {model!r} does not exist; this server serves "
                           f"{model_id!r}", "model", "model_not_found")

    if path.endswith("chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError(400, "messages must be a non-empty list", "messages")
        chars = 0
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise RequestError(400, f"{where} must be an object", "messages")
            role = m.get("role")
            if role not in ROLES:
                raise RequestError(400, f"{where}.role must be one of {list(ROLES)}, not "
                                   f"{role!r}", "messages")
            chars += _check_content(m.get("content"), where)
            if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
                raise RequestError(400, f"{where}.tool_calls must be a list", "messages")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise RequestError(400, "tools must be a list of objects", "tools")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(400, "prompt must be a string", "prompt")
        chars = len(prompt)

    n = body.get("n", 1)
    if not _is_int(n) or n != 1:
        raise RequestError(400, f"n must be 1 (one choice per request), not {n!r}", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not _is_int(v) or not 1 <= v <= max_context):
            raise RequestError(400, f"{key} must be an integer in 1..{max_context}, not {v!r}",
                               key)
    for key, lo, hi in (("temperature", 0, 100), ("top_p", 0, 1), ("min_p", 0, 1),
                        ("presence_penalty", -100, 100), ("frequency_penalty", -100, 100),
                        ("repetition_penalty", 0, 100)):
        v = body.get(key)
        if v is not None and (not _is_num(v) or not lo <= v <= hi):
            raise RequestError(400, f"{key} must be a number in [{lo}, {hi}], not {v!r}", key)
    for key in ("top_k", "seed", "top_logprobs"):
        v = body.get(key)
        if v is not None and not _is_int(v):
            raise RequestError(400, f"{key} must be an integer, not {v!r}", key)
    for key in ("stream", "logprobs"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            raise RequestError(400, f"{key} must be true or false, not {v!r}", key)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and len(stop) <= 16 and all(isinstance(s, str) for s in stop)):
        raise RequestError(400, "stop must be a string or a list of at most 16 strings", "stop")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise RequestError(400, "stream_options must be an object", "stream_options")
    lb = body.get("logit_bias")
    if lb is not None and not isinstance(lb, dict):
        raise RequestError(400, "logit_bias must be an object of token id to bias", "logit_bias")
    for key in ("adapters", "draft_model"):
        if body.get(key) is not None:
            raise RequestError(400, f"{key} is not supported by the expert-parallel server", key)
    return chars


class K3ModelProvider(mlx_server.ModelProvider):
    """Holds the already loaded EP model; never loads anything per request."""

    def __init__(self, cli_args: argparse.Namespace, model, tokenizer, model_id: str):
        super().__init__(cli_args)
        self.served_id = model_id
        self.model, self.tokenizer = model, tokenizer
        self.processor = None
        self.draft_model = None
        self.is_batchable = False
        self.model_key = (model_id, None, None)

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in (self.served_id, "default_model") or adapter_path:
            raise ValueError(f"model {model_path!r} is not served here ({self.served_id!r})")
        return self.model, self.tokenizer

    def load_default(self):
        pass


class _TokenLog(Queue):
    """A request's response queue that also appends generated tokens to a log, so
    the tokens of every rank can be compared (rank 1's queue has no reader)."""

    def __init__(self, inner: Queue | None, path: Path, request_no: int):
        super().__init__()
        self.inner, self.path, self.no = inner, path, request_no
        self.tokens: list[int] = []

    def put(self, item, block=True, timeout=None):
        if isinstance(item, mlx_server.Response):
            self.tokens.append(int(item.token))
        elif item is None or isinstance(item, Exception):
            with open(self.path, "a") as f:
                f.write(json.dumps({"request": self.no, "tokens": self.tokens,
                                    "error": str(item) if item is not None else None}) + "\n")
        if self.inner is not None:
            self.inner.put(item, block, timeout)


class K3ResponseGenerator(mlx_server.ResponseGenerator):
    def __init__(self, model_provider, prompt_cache, token_log: Path | None = None):
        self.token_log = token_log
        self._request_no = 0
        super().__init__(model_provider, prompt_cache)

    def _is_batchable(self, args) -> bool:
        return False

    def _share_request(self, request):
        shared = super()._share_request(request)
        if shared is None or self.token_log is None:
            return shared
        self._request_no += 1
        rq = shared[0] if compat.holds_request(self) else None
        return (_TokenLog(rq, self.token_log, self._request_no), *shared[1:])


_STREAMS: set = set()  # handlers with an SSE stream open (rank 0)
_STREAMS_LOCK = threading.Lock()


def abort_streams(message: str) -> int:
    """Tell every open stream why it ends (the openai client raises on an SSE
    ``error`` event; a bare closed socket would look like a normal end). Called by
    the watchdog when a rank is lost or the group stops. Returns how many."""
    event = f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
    with _STREAMS_LOCK:
        handlers = list(_STREAMS)
    for h in handlers:
        try:
            h.wfile.write(event.encode())
            h.wfile.flush()
        except OSError:
            pass
    return len(handlers)


class K3APIHandler(mlx_server.APIHandler):
    # Set by serve(): what the handler needs to know about the deployment.
    model_id = "kimi-k3"
    max_context = 4096
    info: dict = {}

    def _set_stream_headers(self, status_code: int = 200):
        super()._set_stream_headers(status_code)
        with _STREAMS_LOCK:
            _STREAMS.add(self)

    def handle_completion(self, request, stop_words):
        try:
            return super().handle_completion(request, stop_words)
        finally:
            with _STREAMS_LOCK:
                _STREAMS.discard(self)

    def _error(self, e: RequestError) -> None:
        self._set_completion_headers(e.status)
        self.end_headers()
        self.wfile.write(json.dumps(e.body()).encode())

    def _prompt_tokens(self, body: dict) -> int:
        tok = self.response_generator.model_provider.tokenizer
        if self.path.endswith("chat/completions"):
            ids = tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                          add_generation_prompt=True, tokenize=True)
            return len(ids)
        return len(tok.encode(body["prompt"]))

    def do_POST(self):
        if self.path not in ("/v1/completions", "/v1/chat/completions", "/chat/completions"):
            return super().do_POST()
        try:
            length = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            length = -1
        try:
            if length < 0:
                raise RequestError(411, "a Content-Length header with a length is required")
            if length > MAX_BODY_BYTES:
                raise RequestError(413, f"request body of {length} bytes exceeds "
                                   f"{MAX_BODY_BYTES}", code="request_too_large")
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise RequestError(400, f"request body is not valid UTF-8 ({e})") from None
            except json.JSONDecodeError as e:
                raise RequestError(400, f"request body is not valid JSON ({e})") from None
            chars = validate_request(self.path, body, model_id=self.model_id,
                                     max_context=self.max_context)
            asked = body.get("max_completion_tokens") or body.get("max_tokens")
            if chars > MAX_CHARS_PER_TOKEN * self.max_context:
                raise RequestError(400, f"prompt of {chars} characters cannot fit the context "
                                   f"of {self.max_context} tokens", code="context_length_exceeded")
            try:
                n_prompt = self._prompt_tokens(body)
            except Exception as e:  # a template that cannot render these messages
                raise RequestError(400, f"messages cannot be rendered: {e}") from None
            room = self.max_context - n_prompt
            if room < 1 or (asked is not None and asked > room):
                raise RequestError(400, f"prompt of {n_prompt} tokens plus max_tokens "
                                   f"{asked or 1} exceeds the context of {self.max_context} "
                                   "tokens", code="context_length_exceeded")
            if asked is None:  # unasked: the server default, capped to what fits
                body["max_tokens"] = min(self.response_generator.cli_args.max_tokens, room)
                raw = json.dumps(body).encode()
                self.headers.replace_header("Content-Length", str(len(raw)))
        except RequestError as e:
            return self._error(e)
        # Valid: hand the same bytes to mlx-lm's handler.
        self.rfile = io.BytesIO(raw)
        return super().do_POST()

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps({"object": "list", "data": [
                {"id": self.model_id, "object": "model", "created": self.created,
                 "owned_by": "k3dist"}]}).encode())
        elif self.path == "/v1/k3dist":
            self._set_completion_headers(200)
            self.end_headers()
            live = dict(self.info, jit_kernels=warmup.jit_kernel_count())
            self.wfile.write(json.dumps(live).encode())
        else:
            super().do_GET()


def cli_args(*, model_id: str, max_tokens: int, temp: float, top_p: float,
             prefill_step_size: int) -> argparse.Namespace:
    """The settings mlx_lm.server reads, with its defaults where we have no say."""
    return argparse.Namespace(
        model=model_id, adapter_path=None, draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, chat_template="", use_default_chat_template=False,
        chat_template_args={}, allowed_origins=["*"], temp=temp, top_p=top_p, top_k=0,
        min_p=0.0, max_tokens=max_tokens, decode_concurrency=1, prompt_concurrency=1,
        prefill_step_size=prefill_step_size, prompt_cache_size=4, prompt_cache_bytes=None,
        kv_bits=None, kv_group_size=64, quantized_kv_start=5000, pipeline=False)


def serve(host: str, port: int, provider: K3ModelProvider, *, max_context: int, info: dict,
          token_log: Path | None = None) -> None:
    """mlx_lm.server.run with our generator and handler; rank 0 serves HTTP."""
    group = mx.distributed.init()
    prompt_cache = mlx_server.LRUPromptCache(provider.cli_args.prompt_cache_size)
    generator = K3ResponseGenerator(provider, prompt_cache, token_log)
    if group.rank() != 0:
        generator.join()
        return
    handler = type("Handler", (K3APIHandler,), {
        "model_id": provider.served_id, "max_context": max_context, "info": info})
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    ThreadingHTTPServer.address_family, _, _, _, address = infos[0]
    httpd = ThreadingHTTPServer(
        address, lambda *a, **k: handler(generator, *a, **k))
    logging.info("serving %s on http://%s:%d", provider.served_id, host, port)
    print(f"k3dist: serving {provider.served_id} on http://{host}:{port}", flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        generator.stop_and_join()
