"""OpenAI-compatible HTTP serving of an expert-parallel K3, on mlx-lm's server.

mlx_lm.server already runs generation in lockstep on every rank (rank 0 shares
each request with an ``all_sum``; all ranks run the same steps). We add only what
expert parallelism and a two-box deployment need:

- ``K3ModelProvider``: the model is this rank's EP model, loaded before serving;
  a request naming another model is refused (mlx-lm would try to load that path).
- ``K3ResponseGenerator``: concurrent requests are decoded together, up to
  ``max_batch`` (mlx-lm's BatchGenerator, in lockstep on every rank; prefill one
  request at a time; the warm-up covers every batch size up to ``max_batch``), the
  rest wait; each rank can log the tokens it generated, so ranks can be compared.
- ``K3APIHandler``: every request is validated before it reaches the generation
  loop (OpenAI-style 4xx errors), prompts longer than the context are refused at
  once, ``/v1/models`` lists the served model without scanning a Hugging Face
  cache, and ``/v1/k3dist`` reports the deployment (in full to loopback callers
  only); CORS is off unless origins are configured.
- ``K3HTTPServer``: a deep listen backlog and a bounded number of handler threads,
  so a burst of clients is queued, never reset; past ``max_queued_requests``
  completions in flight a request gets 429 with ``Retry-After``.

Lockstep: every rank runs the same generation steps, so anything that ends a
request early must end it on every rank at the same token. mlx-lm stops a request
whose client went away on rank 0 alone (``ctx.stop()``); here that only marks the
request, and the ranks agree to stop every ``STOP_CHECK_EVERY`` tokens and after
every prefill chunk (one scalar ``all_sum``, read one check later so it never stalls
decoding). Rank 0 also looks at the client's socket at each check (a closed
connection reads as EOF), so a client that hangs up during a long prefill, or while
a non-streamed answer is generated, stops its request too.

Idle: a rank other than 0 waiting for the next request blocks on the watchdog's
side channel (``IdleGate``) and enters the collective only when rank 0 says a
request is coming; the ring backend's collectives spin while they wait.
"""

from __future__ import annotations

import argparse
import io
import ipaddress
import json
import logging
import math
import resource
import select
import socket
import threading
import time
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from queue import Empty as QueueEmpty
from queue import Queue
from typing import Any

from k3dist import __version__ as k3dist_version
from k3dist.model import compat
from k3dist.serve import anthropic_api, auth, relay, responses_api, warmup
from k3dist.serve.prompt_cache import K3PromptCache

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache

MAX_BODY_BYTES = 32 * 1024 * 1024
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
# The agent APIs: each translates its body into a chat completion (k3dist.serve.relay).
AGENT_PATHS = ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses")
# Pre-compute a chat prefix (system prompt + tools) into the prompt caches (_precompute).
PREFIX_PATH = "/v1/k3dist/prefix"
ROLES = ("system", "user", "assistant", "tool", "developer")
# A token is rarely more than ~16 characters: longer prompts are refused before
# tokenizing them at all.
MAX_CHARS_PER_TOKEN = 16
# Bounds on what a request may carry into the generation loop (OpenAI's where it has
# one): each costs time or memory before the first token, or crashes out of range.
MAX_STOP = 4  # stop sequences (OpenAI: up to 4)
MAX_STOP_CHARS = 256  # characters per stop sequence
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI: 300)
MAX_TOOLS = 128  # tools (OpenAI: 128)
MAX_TOP_LOGPROBS = 11  # mlx-lm's own bound
MAX_TEMPLATE_KWARGS = 16
SEED_MAX = 2**64 - 1  # mx.random.seed takes a uint64
# A smaller top_p times the float32 probability mass is 0: mlx-lm's apply_top_p then drops
# every token and takes its threshold one past the vocabulary, an out-of-bounds read that
# gave each rank another first token (found by the fuzzer: benchmarks/fuzz.py).
MIN_TOP_P = 1e-30
MAX_JSON_DEPTH = 64  # the request is pickled to the other ranks: no deep recursion
MAX_JSON_VALUES = 100_000
# Keys mlx-lm passes to apply_chat_template itself: a request may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "tokenize", "add_generation_prompt", "chat_template",
    "return_dict", "return_tensors", "continue_final_message", "documents", "tokenizer_kwargs",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length"})
# Tokens between the ranks' checks whether a request's client went away.
STOP_CHECK_EVERY = 8
# Idle: how long a rank waits (blocked) for a request before it looks at its stop flag.
IDLE_WAIT_S = 0.5
# OpenAI-style image parts (mlx-lm's reading of them)
IMAGE_PART_TYPES = ("image_url", "input_image", "image")


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


def _check_content(content: Any, where: str, images: bool = False) -> int:
    """Message content: a string, null (assistant with tool calls) or a list of
    text parts (and image parts when ``images``: checked by k3dist.serve.vision).
    Returns its character count."""
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
            elif images and part["type"] in IMAGE_PART_TYPES:
                continue
            else:
                raise RequestError(400, f"{where}.content[{i}] has type {part['type']!r}; this "
                                   "deployment serves text only", f"{where}.content")
        return n
    raise RequestError(400, f"{where}.content must be a string or a list of parts, not "
                       f"{type(content).__name__}", f"{where}.content")


def _json_shape(value: Any) -> tuple[int, int]:
    """(deepest nesting, number of values) of parsed JSON, without recursion; stops
    counting past the limits (the request is refused then anyway)."""
    depth, count = 0, 0
    stack = [(value, 1)]
    while stack and depth <= MAX_JSON_DEPTH and count <= MAX_JSON_VALUES:
        v, d = stack.pop()
        count += 1
        if isinstance(v, dict):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v)
    return depth, count


def _check_range(body: dict, key: str, lo: float, hi: float, *, integer: bool = False) -> None:
    v = body.get(key)
    if v is None:
        return
    ok = _is_int(v) if integer else _is_num(v)
    # NaN and the infinities (Python's json accepts them) fail the comparison too
    if not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"{key} must be {kind} in [{lo}, {hi}], not {v!r}", key)


def _check_logit_bias(lb: Any, vocab_size: int) -> dict[str, float] | None:
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise RequestError(400, "logit_bias must be an object of token id to bias", "logit_bias")
    if len(lb) > MAX_LOGIT_BIAS:
        raise RequestError(400, f"logit_bias has {len(lb)} entries; at most {MAX_LOGIT_BIAS}",
                           "logit_bias")
    out = {}
    for k, v in lb.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10 and int(k) < vocab_size):
            raise RequestError(400, f"logit_bias key {k[:32]!r} is not a token id in "
                               f"[0, {vocab_size})", "logit_bias")
        if not _is_num(v) or not -100 <= v <= 100:
            raise RequestError(400, f"logit_bias[{k}] must be a number in [-100, 100], not "
                               f"{v!r}", "logit_bias")
        out[str(int(k))] = float(v)
    return out


def _check_stop(stop: Any) -> None:
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(400, "stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(400, f"stop has {len(stops)} sequences; at most {MAX_STOP}", "stop")
    for s in stops:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise RequestError(400, f"each stop sequence must have 1 to {MAX_STOP_CHARS} "
                               f"characters, not {len(s)}", "stop")


def _check_template_kwargs(kw: Any) -> None:
    if kw is None:
        return
    if not isinstance(kw, dict) or len(kw) > MAX_TEMPLATE_KWARGS:
        raise RequestError(400, "chat_template_kwargs must be an object of at most "
                           f"{MAX_TEMPLATE_KWARGS} entries", "chat_template_kwargs")
    for k, v in kw.items():
        if not k.isidentifier() or k in RESERVED_TEMPLATE_KWARGS:
            raise RequestError(400, f"chat_template_kwargs may not set {k[:32]!r}",
                               "chat_template_kwargs")
        if not (v is None or isinstance(v, (bool, int, float))
                or (isinstance(v, str) and len(v) <= 256)):
            raise RequestError(400, f"chat_template_kwargs[{k!r}] must be a number, a bool, "
                               "null or a string of at most 256 characters",
                               "chat_template_kwargs")


def _check_tool_call(tc: Any, where: str) -> None:
    """An assistant message's tool call: an object whose function has a name and JSON
    object arguments (a string is parsed here, as mlx-lm would later, past the checks)."""
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(400, f"{where} must be an object with a function object that has "
                           "a name", "messages")
    args = fn.get("arguments")
    if args is None:
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except ValueError:
            raise RequestError(400, f"{where}.function.arguments is not JSON: "
                               f"{args[:80]!r}", "messages") from None
    if not isinstance(args, dict):
        raise RequestError(400, f"{where}.function.arguments must be a JSON object, not "
                           f"{type(args).__name__}", "messages")
    fn["arguments"] = args


def validate_request(path: str, body: Any, *, model_id: str, max_context: int,
                     vocab_size: int, images: bool = False) -> int:
    """Check a completion request's shape and values before it is queued, and
    normalise what mlx-lm would otherwise trip over later (``body`` is updated in
    place). Every field mlx-lm 0.32.2's server reads is checked here; values that
    reach the lockstep loop out of range can crash both ranks (a ``logit_bias`` id
    past the vocabulary corrupts memory) or fail after the response has begun.
    Returns the prompt's character count (for the cheap length pre-check)."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    depth, count = _json_shape(body)
    if depth > MAX_JSON_DEPTH or count > MAX_JSON_VALUES:
        raise RequestError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} or has "
                           f"more than {MAX_JSON_VALUES} values")
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
            chars += _check_content(m.get("content"), where, images)
            if m.get("tool_calls") is not None:
                if not isinstance(m["tool_calls"], list):
                    raise RequestError(400, f"{where}.tool_calls must be a list", "messages")
                for j, tc in enumerate(m["tool_calls"]):
                    _check_tool_call(tc, f"{where}.tool_calls[{j}]")
                chars += len(json.dumps(m["tool_calls"], ensure_ascii=False))
        tools = body.get("tools")
        if tools is not None:
            if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise RequestError(400, "tools must be a list of objects", "tools")
            if len(tools) > MAX_TOOLS:
                raise RequestError(400, f"tools has {len(tools)} entries; at most {MAX_TOOLS}",
                                   "tools")
            chars += len(json.dumps(tools, ensure_ascii=False))  # rendered into the prompt
        _check_template_kwargs(body.get("chat_template_kwargs"))
        if body.get("role_mapping") is not None:
            raise RequestError(400, "role_mapping is not supported (the model has a chat "
                               "template)", "role_mapping")
    else:
        prompt = body.get("prompt")
        if body.get("images") is not None or (isinstance(prompt, list) and any(
                isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in prompt)):
            raise RequestError(400, "images are accepted only as image_url parts of "
                               "/v1/chat/completions messages", "prompt")
        if not isinstance(prompt, str):
            raise RequestError(400, "prompt must be a string", "prompt")
        chars = len(prompt)
        for key in ("messages", "tools", "chat_template_kwargs", "role_mapping"):
            if body.get(key) is not None:
                raise RequestError(400, f"{key} belongs to /v1/chat/completions", key)

    n = body.get("n", 1)
    if not _is_int(n) or n != 1:
        raise RequestError(400, f"n must be 1 (one choice per request), not {n!r}", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        _check_range(body, key, 1, max_context, integer=True)
    for key, lo, hi in (("temperature", 0, 2), ("top_p", 0, 1), ("min_p", 0, 1),
                        ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
                        ("repetition_penalty", 0, 10), ("xtc_probability", 0, 1),
                        ("xtc_threshold", 0, 0.5)):
        _check_range(body, key, lo, hi)
    top_p = body.get("top_p")
    if top_p is not None and 0 < top_p < MIN_TOP_P:
        raise RequestError(400, f"top_p must be 0 or at least {MIN_TOP_P:g}, not {top_p!r} "
                           f"(in float32 it rounds to 0, and mlx-lm's top-p filter then reads "
                           f"past the vocabulary); {MIN_TOP_P:g} already keeps only the top "
                           f"token", "top_p")
    for key in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _check_range(body, key, 0, max_context, integer=True)
    _check_range(body, "top_k", 0, vocab_size - 1, integer=True)  # mlx-lm: k < vocab
    _check_range(body, "seed", 0, SEED_MAX, integer=True)
    _check_range(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    for key in ("stream", "logprobs"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            raise RequestError(400, f"{key} must be true or false, not {v!r}", key)
    _check_stop(body.get("stop"))
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
            raise RequestError(400, "stream_options must be an object with include_usage "
                               "true or false", "stream_options")
        so.setdefault("include_usage", False)  # mlx-lm reads it unguarded at the end
    lb = _check_logit_bias(body.get("logit_bias"), vocab_size)
    if lb is not None:
        body["logit_bias"] = lb
    for key in ("xtc_probability", "xtc_threshold"):  # mlx-lm wants floats
        if body.get(key) is not None:
            body[key] = float(body[key])
    for key in ("adapters", "draft_model", "num_draft_tokens", "images"):
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
        # mlx-lm's test: every cache can be merged into a batch (kimi_k3's can)
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
        self.model_key = (model_id, None, None)

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path not in (self.served_id, "default_model") or adapter_path:
            raise ValueError(f"model {model_path!r} is not served here ({self.served_id!r})")
        return self.model, self.tokenizer

    def load_default(self):
        pass


class ClientGone(Exception):
    """The request was stopped on every rank because its client went away."""


# The handler submitting a request (rank 0): its socket is probed for a hang-up.
_SUBMITTER = threading.local()


def _client_closed(sock: socket.socket | None) -> bool:
    """Whether the client closed its end of ``sock`` (EOF or reset waiting to be read).
    Pipelined bytes count as alive; a socket closed here already counts as gone."""
    if sock is None:
        return False
    try:  # poll, not select: a server with 1,000 connections has fds past FD_SETSIZE
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return False  # nothing to read: still there
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False
    except (OSError, ValueError):
        return True


class _CuttableBudget(mlx_server.TimeBudget):
    """mlx-lm's time budget for one pass of its batch loop (a count of steps agreed by
    all ranks), which a stopped request can end early: the loop removes stopped
    requests only after the pass, and a pass of long prefill chunks lasts many
    seconds. ``cut`` is set by an agreed stop, so at the same step on every rank."""

    cut = False

    def __next__(self):
        if self.cut:
            self.cut = False
            raise StopIteration()
        return super().__next__()


class _Requests(Queue):
    """The generator's request queue: each response queue is tagged with the socket of
    the handler that submitted it (read from the handler's thread)."""

    def put(self, item, block=True, timeout=None):
        item[0].client_socket = getattr(_SUBMITTER, "socket", None)
        super().put(item, block, timeout)


class _RequestQueue(Queue):
    """One request's response queue on every rank (rank 1's has no reader).

    It keeps the ranks in lockstep when a client goes away: mlx-lm's handler calls
    ``ctx.stop()`` on rank 0 alone, and its loop then abandons the request on rank 0
    while the other ranks go on (their next collective meets rank 0's next request:
    seen here, every later request hung while /health said ok). Here ``ctx.stop()``
    only marks the request; every
    ``STOP_CHECK_EVERY`` tokens the ranks ``all_sum`` rank 0's mark and all stop at
    the same token (in a batch, the others go on). It also logs the generated tokens
    when asked (``log``), so the tokens of every rank can be compared."""

    def __init__(self, inner: Queue | None, rank: int, size: int, log: Path | None,
                 request_no: int, on_progress=None, *, batched: bool = True,
                 client_socket: socket.socket | None = None,
                 budget: _CuttableBudget | None = None):
        super().__init__()
        self.inner, self.rank, self.size = inner, rank, size
        self.on_progress = on_progress  # the prompt cache's prefill snapshot
        self.log, self.no = log, request_no
        # mlx-lm's batch loop (stops a request it finds marked) or its single path
        # (stream_generate: only an exception ends a prefill)
        self.batched = batched
        self.client_socket = client_socket  # rank 0: the client's connection
        self.budget = budget  # the batch loop's pass, ended at once by a stop
        self.tokens: list[int] = []
        self.progress: tuple[int, int] | None = None
        self.ctx = None
        self.client_gone = False
        self.stopped = False  # the ranks agreed to stop this request
        self.pending: mx.array | None = None
        self.logged = False

    def _client_gone(self) -> None:
        self.client_gone = True
        if self.size == 1 and self.ctx is not None:
            compat.stop_generation(self.ctx)

    def _gone_here(self) -> bool:
        """Rank 0: the handler saw the client leave, or its socket says so now."""
        if not self.client_gone and _client_closed(self.client_socket):
            self.client_gone = True
        return self.client_gone

    def _agree_on_stop(self) -> bool:
        """True once every rank has agreed to stop this request (the same call on every
        rank: the checks happen at the same tokens and prefill chunks everywhere)."""
        if self.stopped:
            return True
        if self.size == 1:  # no peers to agree with: stop at this check
            if not (self.rank == 0 and self._gone_here()):
                return False
        # Read the previous check's sum (long done: no stall of the decode pipeline),
        # then queue this one behind the step already in flight. Every rank reads the
        # same sums at the same tokens, so all stop together, 8-16 tokens (or one
        # prefill chunk) after.
        elif self.pending is None or not self.pending.item():
            mark = mx.array(1 if self.rank == 0 and self._gone_here() else 0)
            self.pending = mx.distributed.all_sum(mark)
            mx.async_eval(self.pending)
            return False
        self.stopped = True
        compat.stop_generation(self.ctx)
        where = (f"after {len(self.tokens)} generated tokens" if self.tokens else
                 f"at prompt token {self.progress[0]} of {self.progress[1]}"
                 if self.progress else "before its prefill")
        (logging.warning if self.rank == 0 else logging.debug)(
            "request %d: the client went away; stopped on every rank %s", self.no, where)
        self._write_log("client went away")
        if self.batched:
            if self.budget is not None:
                self.budget.cut = True  # removed after this step, not after the pass
            if self.inner is not None:
                # mlx-lm's batch loop drops a stopped request without a word on its
                # queue: end the handler's wait
                self.inner.put(ClientGone("the client went away"))
        return True

    def put(self, item, block=True, timeout=None):
        if self.stopped:
            # after the stop: the single path's own "stopped" error, or a last token
            # of the step in flight; the handler has had its ClientGone (batched)
            if (self.inner is not None and not self.batched
                    and (item is None or isinstance(item, Exception))):
                self.inner.put(ClientGone("the client went away"), block, timeout)
            return
        if isinstance(item, mlx_server.GenerationContext):
            self.ctx = item
            item.stop = self._client_gone  # shadows the method, for this request only
        elif isinstance(item, tuple):
            if self.on_progress is not None:
                self.on_progress(*item)
            self.progress = item
            if self.inner is not None:
                self.inner.put(item, block, timeout)
            if self._agree_on_stop() and not self.batched:
                # stream_generate's prefill ends only by an exception; every rank
                # raises at this same chunk, and _serve_single reports it here
                raise ClientGone("the client went away")
            return
        elif isinstance(item, mlx_server.Response):
            self.tokens.append(int(item.token))
            if self.inner is not None:
                self.inner.put(item, block, timeout)
            if len(self.tokens) % STOP_CHECK_EVERY == 0 and item.finish_reason is None:
                self._agree_on_stop()
            return
        elif item is None or isinstance(item, Exception):
            self._write_log(None if item is None else (str(item) or type(item).__name__))
        if self.inner is not None:
            self.inner.put(item, block, timeout)

    def _write_log(self, error: str | None) -> None:
        if self.log is None or self.logged:
            return
        self.logged = True
        with open(self.log, "a") as f:
            f.write(json.dumps({"request": self.no, "tokens": self.tokens,
                                "cached": getattr(self.ctx, "prompt_cache_count", None),
                                "error": error}) + "\n")


class K3ResponseGenerator(mlx_server.ResponseGenerator):
    def __init__(self, model_provider, prompt_cache, token_log: Path | None = None,
                 idle_gate=None):
        self.token_log = token_log
        self._request_no = 0
        self.idle_gate = idle_gate  # k3dist.serve.watchdog.IdleGate (multi-rank)
        super().__init__(model_provider, prompt_cache)
        self.requests = _Requests()
        self._time_budget = _CuttableBudget()

    def _is_batchable(self, args) -> bool:
        # decode_concurrency is max_batch (cli_args); 1: one request at a time
        return self.cli_args.decode_concurrency > 1 and super()._is_batchable(args)

    def _next_request(self, timeout=None):
        """mlx-lm's, but idle ranks block instead of spinning in a collective: with no
        batch in flight (``timeout`` set: the same on every rank) rank 0 waits for a
        request and wakes the others (``idle_gate``) before it shares it; the others
        wait for that wake-up, then enter the collective."""
        gate = self.idle_gate
        if gate is None or timeout is None or not self._is_distributed:
            return super()._next_request(timeout)
        if self._rank == 0:
            try:
                request = self.requests.get(timeout=IDLE_WAIT_S)
            except QueueEmpty:
                return None  # no collective: the others stay at the gate
            gate.wake_peers()
            return self._share_request(request)
        while not self._stop:
            if gate.wait_wake(IDLE_WAIT_S):
                return self._share_request(None)
        return None

    def _share_request(self, request):
        shared = super()._share_request(request)
        if shared is None:
            return shared
        self._request_no += 1
        group = mx.distributed.init()
        rq = shared[0] if compat.holds_request(self) else None
        request, args = shared[1], shared[2]
        # mlx-lm's own choice of path (its _generate): batched unless images or a seed
        batched = self._is_batchable(args) and not compat.has_images(request)
        return (_RequestQueue(rq, group.rank(), group.size(), self.token_log, self._request_no,
                              getattr(self.prompt_cache, "prefill_progress", None),
                              batched=batched,
                              client_socket=getattr(rq, "client_socket", None),
                              budget=self._time_budget),
                *shared[1:])


# Handlers with a completion in flight (rank 0): what each has written so far.
_OPEN: dict = {}  # handler -> "queued" (nothing sent) or "stream" (SSE headers sent)
_OPEN_LOCK = threading.Lock()
# What /v1/k3dist tells a caller that is not on this machine (no paths, no memory).
PUBLIC_INFO = ("ranks", "build_hash", "placement", "placement_hash", "moe_form", "attention",
               "dtype", "max_context", "prefill_chunks", "max_batch", "vocab_size")


def _error_body(message: str, kind: str = "server_error", code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()


def abort_streams(message: str) -> int:
    """End every open completion with an explicit error: an SSE ``error`` event on a
    stream (the openai client raises on it; a bare closed socket would look like a
    normal end), a 503 on a request that has not been answered yet. Called by the
    watchdog when a rank is lost or the group stops. Returns how many."""
    event = f"data: {_error_body(message).decode()}\n\n".encode()
    body = _error_body(message)
    reply = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
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


class Admission:
    """How many completions may be in flight (queued or generating) at once; past
    that a request gets 429 with a Retry-After from the recent time per request."""

    def __init__(self, limit: int):
        self.limit, self.in_flight, self.seconds = limit, 0, 1.0
        self.lock = threading.Lock()

    def enter(self) -> bool:
        with self.lock:
            if self.in_flight >= self.limit:
                return False
            self.in_flight += 1
            return True

    def leave(self, seconds: float) -> None:
        with self.lock:
            self.in_flight -= 1
            self.seconds = 0.8 * self.seconds + 0.2 * seconds

    def retry_after(self) -> int:
        return max(1, min(60, math.ceil(self.seconds)))


class K3APIHandler(mlx_server.APIHandler):
    # Set by serve(): what the handler needs to know about the deployment.
    model_id = "kimi-k3"
    max_context = 4096
    vocab_size = 0
    info: dict = {}
    admission = Admission(64)
    # k3dist.serve.vision.VisionLimits when the deployment serves images; None: text only
    vision_limits = None
    # socket timeout: a client that sends nothing (or reads nothing) for this long
    # gives its handler thread back
    timeout = 30
    aborted = False  # set by abort_streams: the answer was written from elsewhere
    _in_completion = False
    api_key: str | None = None  # every endpoint but /health asks for it when set
    _api = None  # the agent API module of this request (Anthropic's: errors in its shape)

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
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type, x-api-key, "
                         "anthropic-version, anthropic-beta")

    def _set_completion_headers(self, status_code: int = 200):
        if self._in_completion and status_code == 404:
            # mlx-lm answers 404 when generate() fails (the request was valid): the
            # generation loop is gone (503) or failed on this request (500).
            status_code = 500 if self.response_generator.generation_available() else 503
        super()._set_completion_headers(status_code)

    def _set_stream_headers(self, status_code: int = 200):
        super()._set_stream_headers(status_code)
        with _OPEN_LOCK:
            if self in _OPEN:
                _OPEN[self] = "stream"

    def handle_completion(self, request, stop_words):
        with _OPEN_LOCK:
            _OPEN[self] = "queued"
        self._in_completion = True
        _SUBMITTER.socket = self.connection
        try:
            super().handle_completion(request, stop_words)
        except (BrokenPipeError, ConnectionResetError, ClientGone) as e:
            # the client went away: ctx.stop() (in mlx-lm's finally) ends the request on
            # every rank at the next agreed check, which logs it (one line)
            logging.debug("client %s went away mid-request (%r)", self.address_string(), e)
        except Exception as e:  # noqa: BLE001 - the client must hear about it
            logging.exception("request failed")
            self._fail(e)
        finally:
            _SUBMITTER.socket = None
            with _OPEN_LOCK:
                _OPEN.pop(self, None)

    def _fail(self, e: Exception) -> None:
        """End a request that failed after mlx-lm took it, explicitly: an SSE error
        event if the stream has begun, else a 5xx instead of the pending 200."""
        if self.aborted:
            return
        alive = self.response_generator.generation_available()
        why = str(e) or type(e).__name__
        message = f"generation failed: {why}" if alive else (
            f"the generation loop has stopped ({why}); the server must be restarted")
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
        body = json.dumps(anthropic_api.error_body(e.status, str(e))
                          if self._api is anthropic_api else e.body()).encode()
        self._set_completion_headers(e.status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if e.status == 413:
            self._linger()

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """http.server's own refusals; a request line or header too long (414, 431) leaves
        the rest of the request unread: linger so the client reads the answer, not a
        reset."""
        super().send_error(code, message, explain)
        if code in (HTTPStatus.REQUEST_URI_TOO_LONG,
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE):
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

    def _check_images(self, body: dict, path: str) -> list:
        """A chat request's images, each checked (and made a data URL) before any rank
        works: 400 naming the image and what is wrong."""
        if self.vision_limits is None or not path.endswith("chat/completions"):
            return []
        from k3dist.serve import vision

        parts = [(f"messages[{i}].content[{j}]", p) for i, m in enumerate(body["messages"])
                 if isinstance(m.get("content"), list)
                 for j, p in enumerate(m["content"]) if p.get("type") in IMAGE_PART_TYPES]
        if len(parts) > self.vision_limits.max_images:
            raise RequestError(400, f"{len(parts)} images in one request; at most "
                               f"{self.vision_limits.max_images}", "messages")
        try:
            return [vision.check_image_part(p, self.vision_limits, where) for where, p in parts]
        except vision.ImageError as e:
            raise RequestError(400, str(e), "messages") from None

    def _prompt_tokens(self, body: dict, path: str, images: list | None = None) -> int:
        tok = self.response_generator.model_provider.tokenizer
        if path.endswith("chat/completions"):
            kwargs = body.get("chat_template_kwargs") or {}
            if images:  # the prompt as the processor expands it: one pad per feature
                from k3dist.serve import vision

                text = tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                               add_generation_prompt=True, tokenize=False,
                                               **kwargs)
                processor = self.response_generator.model_provider.processor
                return len(vision.prompt_tokens(tok, processor, text, images))
            ids = tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                          add_generation_prompt=True, tokenize=True, **kwargs)
            return len(ids)
        return len(tok.encode(body["prompt"]))

    def _authorized(self) -> bool:
        """Refuse (401, in the API's shape) a request without the deployment's key."""
        if auth.allowed(self.headers, self.api_key):
            return True
        self._error(RequestError(401, "a valid API key is required (Authorization: Bearer "
                                 "<key> or x-api-key: <key>)", code="invalid_api_key"))
        self._linger()  # the body was not read
        return False

    def _route(self) -> str:
        """Route on the URL's path: the query string is ignored (Claude Code posts to
        ``/v1/messages?beta=true``), and ``self.path`` becomes the bare path (mlx-lm's
        handler routes on it). Errors under ``/v1/messages`` take Anthropic's shape."""
        path = self.path.partition("?")[0].partition("#")[0]
        if "://" in path:  # absolute-form (through a proxy): its path
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        self.path = path
        if path == "/v1/messages" or path.startswith("/v1/messages/"):
            self._api = anthropic_api
        elif path == "/v1/responses" or path.startswith("/v1/responses/"):
            self._api = responses_api
        return path

    def _not_found(self) -> None:
        self._error(RequestError(404, f"no such endpoint: {self.command} {self.path[:200]}",
                                 code="not_found"))
        self._linger()  # a body, if any, was not read

    def do_POST(self):
        path = self._route()
        if not self._authorized():
            return
        if path == PREFIX_PATH:
            return self._precompute()
        if path not in COMPLETION_PATHS + AGENT_PATHS:
            return self._not_found()
        path = "/v1/chat/completions" if self._api else self.path  # what is run
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
            if not self.response_generator.generation_available():
                raise RequestError(503, "the generation loop has stopped; the server must be "
                                   "restarted", code="generation_stopped")
            try:
                body = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise RequestError(400, f"request body is not valid UTF-8 ({e})") from None
            except json.JSONDecodeError as e:
                raise RequestError(400, f"request body is not valid JSON ({e})") from None
            except RecursionError:
                raise RequestError(400, "request body is nested too deeply (at most "
                                   f"{MAX_JSON_DEPTH} levels)") from None
            if self._api is not None:
                client_body, body = body, self._agent_body(body)
            if isinstance(body, dict):  # OpenAI's null is the default; mlx-lm's handler
                body = {k: v for k, v in body.items() if v is not None}  # refuses it
            chars = validate_request(path, body, model_id=self.model_id,
                                     max_context=self.max_context, vocab_size=self.vocab_size,
                                     images=self.vision_limits is not None)
            images = self._check_images(body, path)
            asked = body.get("max_completion_tokens") or body.get("max_tokens")
            if chars > MAX_CHARS_PER_TOKEN * self.max_context:
                raise RequestError(400, f"prompt of {chars} characters cannot fit the context "
                                   f"of {self.max_context} tokens", code="context_length_exceeded")
            try:
                n_prompt = self._prompt_tokens(body, path, images)
            except Exception as e:  # a template that cannot render these messages
                raise RequestError(400, f"messages cannot be rendered: {e}") from None
            if self.path == "/v1/messages/count_tokens":
                return self._json(200, {"input_tokens": n_prompt})
            if n_prompt < 1:  # mlx-lm's batch loop dies on an empty prompt (every rank)
                raise RequestError(400, "prompt is empty: it must have at least one token",
                                   "prompt")
            room = self.max_context - n_prompt
            if room < 1 or (asked is not None and asked > room):
                raise RequestError(400, f"prompt of {n_prompt} tokens plus max_tokens "
                                   f"{asked or 1} exceeds the context of {self.max_context} "
                                   "tokens", code="context_length_exceeded")
            if asked is None:  # unasked: the server default, capped to what fits
                body["max_tokens"] = min(self.response_generator.cli_args.max_tokens, room)
        except RequestError as e:
            return self._error(e)
        except relay.BadRequest as e:
            return self._error(RequestError(e.status, str(e), e.param))
        if not self.admission.enter():
            return self._error(
                RequestError(429, f"{self.admission.limit} requests are already in flight; "
                             "retry later", code="too_many_requests"),
                {"Retry-After": str(self.admission.retry_after())})
        # Valid and admitted: hand the (normalised) body to mlx-lm's handler.
        raw = json.dumps(body).encode()
        self.headers.replace_header("Content-Length", str(len(raw)))
        self.rfile = io.BytesIO(raw)
        t0 = time.monotonic()
        sink = self._relay(client_body, n_prompt) if self._api is not None else None
        try:
            return super().do_POST()
        finally:
            self.admission.leave(time.monotonic() - t0)
            if sink is not None:
                sink.end()

    def _precompute(self) -> None:
        """``POST /v1/k3dist/prefix`` with ``{"messages": [system messages], "tools": [...]}``:
        prefill that prefix (as the start of a chat whose first user turn is to come) into
        the prompt cache and, with ``prefix_cache_dir``, its on-disk store, so the first
        session's first turn is warm even after a restart. Runs as a one-token chat
        completion through the lockstep loop (mlx-lm keeps a chat's system segment as a
        ``system`` entry); answers the prefix's token count and whether it is stored."""
        try:
            length = int(self.headers.get("Content-Length", "-1"))
            if not 0 <= length <= MAX_BODY_BYTES:
                raise RequestError(400, f"a Content-Length of 0 to {MAX_BODY_BYTES} is required")
            body = json.loads(self.rfile.read(length).decode("utf-8"))
            msgs = body.get("messages") if isinstance(body, dict) else None
            if not (isinstance(msgs, list) and msgs and all(
                    isinstance(m, dict) and m.get("role") in ("system", "developer")
                    for m in msgs)):
                raise RequestError(400, "messages must be a non-empty list of system (or "
                                   "developer) messages: the prefix every session starts with",
                                   "messages")
            kw = body.get("chat_template_kwargs") or {}
            chat = {"model": self.model_id, "tools": body.get("tools"), "max_tokens": 1,
                    "temperature": 0, "chat_template_kwargs": kw,
                    "messages": [*msgs, {"role": "user", "content": "."}]}
            validate_request("/v1/chat/completions", chat, model_id=self.model_id,
                             max_context=self.max_context, vocab_size=self.vocab_size)
            tok = self.response_generator.model_provider.tokenizer
            ids = tok.apply_chat_template(chat["messages"], tools=chat["tools"],
                                          add_generation_prompt=True, tokenize=True, **kw)
            head = tok.apply_chat_template([*msgs, {"role": "user", "content": ""}],
                                           tools=chat["tools"], add_generation_prompt=False,
                                           tokenize=True, **kw)
            n = next((i for i, (a, b) in enumerate(zip(head, ids, strict=False))
                      if a != b), 0)
            if len(ids) + 1 > self.max_context:
                raise RequestError(400, f"prefix of {len(ids)} tokens exceeds the context of "
                                   f"{self.max_context}", code="context_length_exceeded")
        except (ValueError, TypeError, AttributeError) as e:  # JSON, UTF-8, template
            return self._error(e if isinstance(e, RequestError) else RequestError(400, str(e)))
        if not self.admission.enter():
            return self._error(RequestError(429, "too many requests in flight; retry later",
                                            code="too_many_requests"),
                               {"Retry-After": str(self.admission.retry_after())})
        raw = json.dumps(chat).encode()
        self.headers.replace_header("Content-Length", str(len(raw)))
        self.rfile, self.path = io.BytesIO(raw), "/v1/chat/completions"
        out, self.wfile = self.wfile, io.BytesIO()  # mlx-lm's answer is not the reply
        t0 = time.monotonic()
        try:
            super().do_POST()
        finally:
            self.admission.leave(time.monotonic() - t0)
            answered, self.wfile = self.wfile.getvalue(), out
        if b" 200 " not in answered.split(b"\r\n", 1)[0]:
            return self._error(RequestError(500, "the prefix run failed: " + answered.decode(
                "utf-8", "replace")[-300:]))
        store = getattr(self.response_generator.prompt_cache, "store", None)
        stored = bool(store is not None and n and store.has(ids[:n]))
        self._json(200, {"prefix_tokens": n, "seconds": round(time.monotonic() - t0, 3),
                         "stored": stored, "key": store.key(ids[:n]) if stored else None,
                         "prefix_cache": store.report() if store is not None else None})

    def _agent_body(self, body: Any) -> dict:
        """The chat-completion body an agent API request runs as."""
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        if self._api is responses_api:
            chat, _ = responses_api.to_chat(body)
        else:
            chat = anthropic_api.to_chat(body, count_only=self.path.endswith("count_tokens"))
        return chat

    def _relay(self, client_body: dict, n_prompt: int) -> relay.Relay:
        """Run the chat completion streamed, and answer in the agent API's shape: the
        handler's wfile becomes a Relay (what it writes is translated), its generator a
        Tap (the raw text tells which stop sequence ended generation)."""
        tok = self.response_generator.model_provider.tokenizer
        body = json.loads(self.rfile.getvalue())
        t = (responses_api.ResponsesTranslator if self._api is responses_api
             else anthropic_api.MessagesTranslator)(
            model=self.model_id, stream=bool(client_body.get("stream")),
            prompt_tokens=n_prompt, stop_sequences=list(body.get("stop") or []),
            eos_token_ids=tuple(tok.eos_token_ids))
        if self._api is responses_api:
            t.request = responses_api.to_chat(client_body)[1]
        body.update(stream=True, stream_options={"include_usage": True})
        raw = json.dumps(body).encode()
        self.headers.replace_header("Content-Length", str(len(raw)))
        self.rfile = io.BytesIO(raw)
        self.path = "/v1/chat/completions"
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
        if not self._authorized():
            return
        if self.path.startswith("/v1/models"):
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps({"object": "list", "data": [
                {"id": self.model_id, "object": "model", "created": self.created,
                 "owned_by": "k3dist"}]}).encode())
        elif self.path == "/v1/k3dist":
            self._set_completion_headers(200)
            self.end_headers()
            if self._is_local():
                model = self.response_generator.model_provider.model
                loaded = warmup.jit_kernels_loaded()
                warmed = set(self.info.get("warmup_kernels") or ())
                info = dict(self.info, jit_kernels=warmup.jit_kernel_count(),
                            jit_kernels_loaded=None if loaded is None else len(loaded),
                            jit_kernels_after_warmup=None if loaded is None
                            else sorted(set(loaded) - warmed),
                            shapes_seen=sorted(getattr(model, "shapes_seen", set()).copy()))
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


class K3HTTPServer(ThreadingHTTPServer):
    """mlx-lm's ThreadingHTTPServer with a deep listen backlog (the default of 5 reset
    bursts of clients) and at most ``max_connections`` handler threads: past that,
    connections wait in the backlog until a thread is free."""

    request_queue_size = 1024
    daemon_threads = True

    def __init__(self, address, handler, *, max_connections: int):
        _raise_open_files(max_connections + 256)
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        self.slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _raise_open_files(needed: int) -> None:
    """One socket per connection: lift the soft open-files limit (macOS shells start at
    256) towards ``needed``, as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            logging.warning("open-files limit stays %d (< %d wanted): %s", soft, want, e)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def fingerprint() -> str:
    """``system_fingerprint``: what serves, not the host's kernel (mlx-lm's has it)."""
    return f"k3dist-{k3dist_version}-mlx-{mx.__version__}"


def cli_args(*, model_id: str, max_tokens: int, temp: float, top_p: float,
             prefill_step_size: int, cors_origins: list[str] | None = None,
             max_batch: int = 1) -> argparse.Namespace:
    """The settings mlx_lm.server reads, with its defaults where we have no say.
    ``max_batch`` requests decode together; prompts are prefilled one at a time
    (``prompt_concurrency`` 1: prefill shapes stay batch 1, the warmed chunks)."""
    return argparse.Namespace(
        model=model_id, adapter_path=None, draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, chat_template="", use_default_chat_template=False,
        chat_template_args={}, allowed_origins=list(cors_origins or []), temp=temp,
        top_p=top_p, top_k=0, min_p=0.0, max_tokens=max_tokens, decode_concurrency=max_batch,
        prompt_concurrency=1, prefill_step_size=prefill_step_size, prompt_cache_size=8,
        prompt_cache_bytes=None, kv_bits=None, kv_group_size=64, quantized_kv_start=5000,
        pipeline=False)


def serve(host: str, port: int, provider: K3ModelProvider, *, max_context: int, info: dict,
          vocab_size: int, max_queued_requests: int = 64, max_connections: int = 2048,
          token_log: Path | None = None, vision_limits=None, api_key: str | None = None,
          prompt_cache_tokens: int | None = None, prefix_store=None, idle_gate=None) -> None:
    """mlx_lm.server.run with our generator, handler and HTTP server; rank 0 serves.
    ``prefix_store``: prefix caches on disk (k3dist.serve.prefix_store) or None;
    ``idle_gate``: the watchdog (multi-rank): idle ranks wait on it, not in a collective."""
    group = mx.distributed.init()
    prompt_cache = K3PromptCache(provider.cli_args.prompt_cache_size,
                                 lambda: make_prompt_cache(provider.model),
                                 prompt_cache_tokens or 4 * max_context, prefix_store)
    generator = K3ResponseGenerator(provider, prompt_cache, token_log, idle_gate)
    if group.rank() != 0:
        generator.join()
        return
    handler = type("Handler", (K3APIHandler,), {
        "model_id": provider.served_id, "max_context": max_context, "info": info,
        "vocab_size": vocab_size, "admission": Admission(max_queued_requests),
        "vision_limits": vision_limits, "api_key": api_key})
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    server_class = type("Server", (K3HTTPServer,), {"address_family": family})
    fp = fingerprint()
    httpd = server_class(address, lambda *a, **k: handler(generator, *a, system_fingerprint=fp,
                                                          **k),
                         max_connections=max_connections)
    logging.info("serving %s on http://%s:%d", provider.served_id, host, port)
    if api_key is None and not _loopback(host):
        print(f"k3dist: WARNING: serving on {host} with no API key: anyone who can reach "
              "this port can use it (set api_key_file)", flush=True)
    print(f"k3dist: serving {provider.served_id} on http://{host}:{port} (at most "
          f"{max_queued_requests} requests in flight, {max_connections} connections; CORS "
          f"{provider.cli_args.allowed_origins or 'off'}; API key "
          f"{'required' if api_key else 'off'})", flush=True)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        generator.stop_and_join()
