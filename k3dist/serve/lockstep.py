"""The lockstep core: one request queue and one generation loop on every rank.

mlx_lm.server already runs generation in lockstep on every rank (rank 0 shares
each request with an ``all_sum``; all ranks run the same steps). What expert
parallelism and a two-box deployment add:

- ``K3ModelProvider``: the model is this rank's EP model, loaded before serving;
  a request naming another model is refused (mlx-lm would try to load that path).
- ``K3ResponseGenerator``: concurrent requests are decoded together, up to
  ``max_batch`` (mlx-lm's BatchGenerator, in lockstep on every rank; prefill one
  request at a time; the warm-up covers every batch size up to ``max_batch``), the
  rest wait; each rank can log the tokens it generated, so ranks can be compared.
  A request that rank 0's handler has tokenized already (``Prompt``) carries its
  tokens to every rank: no rank renders or tokenizes it again.

Stops: anything that ends a request early must end it on every rank at the same
token. mlx-lm stops a request whose client went away on rank 0 alone
(``ctx.stop()``); here that only marks the request, and the ranks agree to stop every
``STOP_CHECK_EVERY`` tokens and after every prefill chunk (one scalar ``all_sum``,
read one check later so it never stalls decoding). Rank 0 also looks at the
client's socket at each check (a closed connection reads as EOF), so a client that
hangs up during a long prefill, or while a non-streamed answer is generated, stops
its request too.

Abandoned prefill is kept: a request stopped during its prefill leaves the whole chunks
it processed in the prompt cache (``K3PromptCache.keep_abandoned``), on every rank at the
same request and chunk, so its client's retry (or a longer prompt sharing it) resumes
there. On the batch path the request's rows are extracted from mlx-lm's prompt batch as
it is removed (``_KeepingBatchGenerator``); on the single path its own cache list, which
``stream_generate`` filled up to the chunk where every rank stopped.

Segments: mlx-lm's batch path keeps a chat's system prompt and tools as a cache entry (its
cache segments, ``segment_system`` for a chat that ends with a system message); its single
path (``max_batch`` 1) keeps none, so there ``_serve_single`` prefills the ``system`` segment
first and keeps a copy (``K3PromptCache.keep_system``) before mlx-lm's prefill goes on.

Progress: rank 0 logs a prefill's progress at most every ``PROGRESS_LOG_S`` (and where it
resumed from), and ``K3ResponseGenerator.in_flight`` reports each request's progress for
``/v1/k3dist``. The handler waiting on a request is called back (``SUBMITTER.idle``)
whenever nothing came for ``IDLE_POLL_S``: its keep-alives are timed, not per chunk.

Idle: a rank other than 0 waiting for the next request blocks on the watchdog's
side channel (``IdleGate``) and enters the collective only when rank 0 says a
request is coming; the ring backend's collectives spin while they wait.
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from queue import Empty as QueueEmpty
from queue import Queue
from types import MethodType, SimpleNamespace

from k3dist.model import compat
from k3dist.serve.prompt_cache import ABANDONED, segment_system

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import make_prompt_cache

# Tokens between the ranks' checks whether a request's client went away.
STOP_CHECK_EVERY = 8
# Idle: how long a rank waits (blocked) for a request before it looks at its stop flag.
IDLE_WAIT_S = 0.5
# Rank 0: at most one prefill progress line a request this often (and one at its end).
PROGRESS_LOG_S = 10.0
# A handler waiting for its request's next event is called back (SUBMITTER.idle) this often.
IDLE_POLL_S = 0.25


@dataclass
class Prompt(mlx_server.CompletionRequest):
    """mlx-lm's request with its prompt already tokenized on rank 0: ``tokenized`` is
    what mlx-lm's ``ResponseGenerator._tokenize`` returns (tokens, cache segments,
    initial state, vision), pickled to the other ranks with the request."""

    tokenized: tuple | None = None

    @property
    def tokens(self) -> list[int]:
        return self.tokenized[0]


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


def _say(line: str) -> None:
    """A line of rank 0's server log (the deployment's own lines, as the prefix store's:
    the logging module's INFO is not shown)."""
    print(f"k3dist: {line}", file=sys.stderr, flush=True)


class ClientGone(Exception):
    """The request was stopped on every rank because its client went away."""


# The handler submitting a request (rank 0): its socket is probed for a hang-up.
SUBMITTER = threading.local()


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
        item[0].client_socket = getattr(SUBMITTER, "socket", None)
        item[0].submitted = time.perf_counter()  # time to first token counts from here
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

    def __init__(
        self,
        inner: Queue | None,
        rank: int,
        size: int,
        log: Path | None,
        request_no: int,
        on_progress=None,
        *,
        batched: bool = True,
        client_socket: socket.socket | None = None,
        budget: _CuttableBudget | None = None,
        timer=None,
        prompt_cache=None,
        in_flight: dict | None = None,
    ):
        super().__init__()
        self.inner, self.rank, self.size = inner, rank, size
        self.on_progress = on_progress  # the prompt cache's prefill snapshot
        # the prompt cache (K3PromptCache): where the prompt resumed from, and (single
        # path) the abandoned prefill it keeps
        self.prompt_cache = prompt_cache
        self.in_flight = in_flight  # rank 0: the generator's requests in flight, by number
        if in_flight is not None:
            in_flight[request_no] = self
        self.resumed: tuple[int, str] | None = None  # (cached tokens, where from)
        self.started = self.last_log = time.monotonic()
        self.progress_logged = False
        self.log, self.no = log, request_no
        # mlx-lm's batch loop (stops a request it finds marked) or its single path
        # (stream_generate: only an exception ends a prefill)
        self.batched = batched
        self.client_socket = client_socket  # rank 0: the client's connection
        self.budget = budget  # the batch loop's pass, ended at once by a stop
        self.timer = timer  # k3dist.serve.metrics.RequestTimer, or None
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
        if self.timer is not None:
            self.timer.end()
        compat.stop_generation(self.ctx)
        where = (
            f"after {len(self.tokens)} generated tokens"
            if self.tokens
            else f"at prompt token {self.prefilled()} of {self.prompt_tokens()}"
            if self.progress
            else "before its prefill"
        )
        (logging.warning if self.rank == 0 else logging.debug)(
            "request %d: the client went away; stopped on every rank %s%s",
            self.no,
            where,
            "" if self.tokens or not self.progress else "; its prefill is kept for a retry",
        )
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
            if (
                self.inner is not None
                and not self.batched
                and (item is None or isinstance(item, Exception))
            ):
                self.inner.put(ClientGone("the client went away"), block, timeout)
            return
        if isinstance(item, mlx_server.GenerationContext):
            self.ctx = item
            item.stop = self._client_gone  # shadows the method, for this request only
            if self.timer is not None:
                self.timer.start(len(item.prompt), item.prompt_cache_count)
            if self.batched:  # mlx-lm's batch loop fetched the prompt cache just now
                self._fetched()
        elif isinstance(item, tuple):
            if self.timer is not None:
                self.timer.chunk()
            if self.progress is None and not self.batched:
                self._fetched()  # the single path fetches after it sends the context
            if self.on_progress is not None:
                self.on_progress(*item)
            self.progress = item
            self._log_progress()
            if self.inner is not None:
                self.inner.put(item, block, timeout)
            if self._agree_on_stop() and not self.batched:
                if self.prompt_cache is not None and not self.tokens:
                    self.prompt_cache.prefill_abandoned(item[0])  # every rank, this chunk
                # stream_generate's prefill ends only by an exception; every rank
                # raises at this same chunk, and _serve_single reports it here
                raise ClientGone("the client went away")
            return
        elif isinstance(item, mlx_server.Response):
            self.tokens.append(int(item.token))
            if self.timer is not None:
                self.timer.token()
            if self.inner is not None:
                self.inner.put(item, block, timeout)
            if len(self.tokens) % STOP_CHECK_EVERY == 0 and item.finish_reason is None:
                self._agree_on_stop()
            return
        elif item is None or isinstance(item, Exception):
            if self.timer is not None:
                self.timer.end()
            self._write_log(None if item is None else (str(item) or type(item).__name__))
        if self.inner is not None:
            self.inner.put(item, block, timeout)

    def cached(self) -> int:
        return int(getattr(self.ctx, "prompt_cache_count", 0) or 0)

    def prompt_tokens(self) -> int:
        prompt = getattr(self.ctx, "prompt", None)
        return len(prompt) if prompt is not None else 0

    def prefilled(self) -> int:
        """Prompt tokens in this request's cache now: those it found cached and those
        its prefill processed (mlx-lm counts the prefill's progress from the cache hit)."""
        return self.cached() + (self.progress[0] if self.progress else 0)

    def report(self) -> dict:
        """This request as ``/v1/k3dist`` shows it (rank 0)."""
        total = self.prompt_tokens()
        return {
            "request": self.no,
            "prompt_tokens": total,
            "cached_tokens": self.cached(),
            "cached_from": self.resumed[1] if self.resumed and self.resumed[0] else None,
            "prefilled_tokens": min(self.prefilled(), total) if self.ctx else 0,
            "generated_tokens": len(self.tokens),
            "seconds": round(time.monotonic() - self.started, 1),
        }

    def _fetched(self) -> None:
        """Rank 0: where this prompt's cache came from (the fetch just made), said once."""
        fetch = getattr(self.prompt_cache, "last_fetch", None)
        if self.rank != 0 or fetch is None or self.resumed is not None:
            return
        n, source = fetch
        self.resumed = (n, source)
        if n:
            _say(
                f"request {self.no}: {n} of {self.prompt_tokens()} prompt tokens cached "
                f"({source})" + ("; resumes an abandoned prefill" if source == ABANDONED else "")
            )

    def _log_progress(self) -> None:
        """Rank 0: the prefill's progress, at most every PROGRESS_LOG_S, and its end."""
        if self.rank != 0 or self.ctx is None:
            return
        done, total = self.prefilled(), self.prompt_tokens()
        now = time.monotonic()
        if done < total and now - self.last_log < PROGRESS_LOG_S:
            return
        if done >= total and not self.progress_logged:
            return  # a prefill shorter than one interval: no line
        self.last_log, self.progress_logged = now, True
        _say(
            f"request {self.no}: prefill {min(done, total)} of {total} prompt tokens "
            f"({now - self.started:.0f} s)"
        )

    def _write_log(self, error: str | None) -> None:
        if self.in_flight is not None:
            self.in_flight.pop(self.no, None)
        if self.log is None or self.logged:
            return
        self.logged = True
        with open(self.log, "a") as f:
            f.write(
                json.dumps(
                    {
                        "request": self.no,
                        "tokens": self.tokens,
                        "cached": getattr(self.ctx, "prompt_cache_count", None),
                        "error": error,
                    }
                )
                + "\n"
            )


class _TimedEval:
    """``mlx.core`` for mlx-lm's ``GenerationBatch._step``, its ``eval`` timed: that call
    is where the generation thread waits for the step's tokens, whose graph holds every
    all_sum of the step (the collective-bearing eval). Everything else is mlx.core's."""

    def __init__(self, on_wait: Callable[[float], None]):
        self.on_wait = on_wait

    def __getattr__(self, name: str):
        return getattr(mx, name)

    def eval(self, *args) -> None:
        t0 = time.perf_counter()
        mx.eval(*args)
        self.on_wait(time.perf_counter() - t0)


class _KeepingBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator, but a request removed during its prefill (its client
    went away: the ranks agreed, so this runs at the same step on every rank) first hands
    its cache so far, and the tokens it holds, to ``keep``; while its owner counts
    (``metrics``), each decode step's wait for its tokens is timed (``_TimedEval``)."""

    keep: Callable[[list[int], list], None] | None = None
    # the generation thread's owner: its ``metrics`` (set once the server is built)
    owner: K3ResponseGenerator | None = None

    def _next(self):
        gb = self._generation_batch
        m = None if self.owner is None else self.owner.metrics
        if m is not None and "_step" not in vars(gb):
            # this batch object's own step: mlx-lm's code, its mx.eval timed
            step = compat.with_names(GenerationBatch._step, mx=_TimedEval(m.step_wait))
            gb._step = MethodType(step, gb)
        return super()._next()

    def remove(self, uids, return_prompt_caches=False):
        if self.keep is not None:
            prefilling = [u for u, (stage, _) in self._find_uids(uids).items() if stage == 1]
            for cache, tokens in self.extract_cache(prefilling).values():
                self.keep(list(tokens), cache)
        return super().remove(uids, return_prompt_caches)


class K3ResponseGenerator(mlx_server.ResponseGenerator):
    def __init__(self, model_provider, prompt_cache, token_log: Path | None = None, idle_gate=None):
        self.token_log = token_log
        self._request_no = 0
        self.idle_gate = idle_gate  # k3dist.serve.watchdog.IdleGate (multi-rank)
        self.metrics = None  # k3dist.serve.metrics.ServeMetrics, when counted
        self.in_flight: dict[int, _RequestQueue] = {}  # rank 0: by request number
        super().__init__(model_provider, prompt_cache)
        self.requests = _Requests()
        self._time_budget = _CuttableBudget()

    def _generate(self):
        """mlx-lm's generation loop, building its batch with ``_KeepingBatchGenerator``
        (the one name it is read by is swapped for this loop only)."""
        cache = self.prompt_cache
        key = self.model_provider.model_key

        def keep(tokens: list[int], prompt_cache: list) -> None:
            if hasattr(cache, "keep_abandoned"):
                cache.keep_abandoned(key, tokens, prompt_cache)

        batch_class = type(
            "BatchGenerator", (_KeepingBatchGenerator,), {"keep": staticmethod(keep), "owner": self}
        )
        compat.with_names(mlx_server.ResponseGenerator._generate, BatchGenerator=batch_class)(self)

    def _serve_single(self, request, stream):
        """mlx-lm's single path, its prefill cut where its batch path cuts it: the chat's
        ``system`` segment (system prompt and tools; a system-last chat's too,
        ``segment_system``) is prefilled first and kept, so a later chat that shares it
        (Claude Code's recovery, which changes the first user message) resumes there."""
        tokenized = getattr(request[1], "tokenized", None)
        if tokenized is None or not tokenized[2] or tokenized[2][0] != "system":
            return super()._serve_single(request, stream)
        system = list(tokenized[1][0])
        run = compat.with_names(
            mlx_server.ResponseGenerator._serve_single,
            stream_generate=lambda **kw: self._system_first(system, len(tokenized[0]), **kw),
        )
        return run(self, request, stream)

    def _system_first(self, system: list[int], total: int, **kw):
        """``stream_generate`` for a prompt whose first ``len(system)`` tokens are its
        system segment: the part of it past the cache hit is prefilled in
        ``prefill_step_size`` chunks (progress reported, so a client's hang-up stops it
        as any chunk), kept (``K3PromptCache.keep_system``), then mlx-lm's prefill and
        generation go on from there; progress counts over the whole rest of the prompt."""
        from mlx_lm.generate import maybe_quantize_kv_cache, stream_generate

        rest, cache = kw["prompt"], kw["prompt_cache"]
        head = len(system) - (total - len(rest))  # system tokens the cache does not hold
        keep = getattr(self.prompt_cache, "keep_system", None)
        plain = kw.get("input_embeddings") is not None or kw.get("draft_model") is not None
        if keep is None or plain or not 0 < head < len(rest) - 1:
            return stream_generate(**kw)
        progress, step = kw["prompt_progress_callback"], kw["prefill_step_size"]
        model = kw["model"]
        with mx.stream(kw["stream"]):
            progress(0, len(rest))
            for done in range(0, head, step):
                n = min(step, head - done)
                model(mx.array(rest[done : done + n])[None], cache=cache)
                maybe_quantize_kv_cache(
                    cache, kw["quantized_kv_start"], kw["kv_group_size"], kw["kv_bits"]
                )
                mx.eval([c.state for c in cache])
                progress(done + n, len(rest))
                mx.clear_cache()
        keep(self.model_provider.model_key, system, cache)
        kw.update(
            prompt=rest[head:],
            prompt_progress_callback=lambda p, t: progress(p + head, t + head),
        )
        return stream_generate(**kw)

    def generate(self, request, generation_args, progress_callback=None):
        """mlx-lm's, without the handler's progress callback: it logged every prefill
        chunk and wrote a keep-alive per chunk; rank 0 logs progress at a bounded rate
        (``_RequestQueue``) and the handler's keep-alives are timed (``SUBMITTER.idle``)."""
        return super().generate(request, generation_args, None)

    def _await_response(self, response_queue):
        """mlx-lm's wait for the request's next event (the handler's thread), calling the
        handler's ``SUBMITTER.idle`` every IDLE_POLL_S that nothing comes."""
        idle = getattr(SUBMITTER, "idle", None)
        while True:
            try:
                return response_queue.get(timeout=IDLE_POLL_S)
            except QueueEmpty:
                if not self.generation_available():
                    raise RuntimeError("generation thread died") from None
                if idle is not None:
                    idle()

    def progress(self) -> list[dict]:
        """Rank 0: the requests in flight, each with its prefill's progress."""
        return [rq.report() for rq in sorted(list(self.in_flight.values()), key=lambda r: r.no)]

    def tokenize(
        self, request: mlx_server.CompletionRequest, chat_template_kwargs: dict | None
    ) -> Prompt:
        """Rank 0's handler: ``request`` rendered and tokenized once, by mlx-lm's own
        ``_tokenize`` (the template, the cache segments; a chat ending in a system message
        cut as well, ``segment_system``), ahead of the queue; the
        prompt's length is checked on these tokens and every rank generates from them."""
        args = SimpleNamespace(chat_template_kwargs=chat_template_kwargs)  # all it reads
        tokenized = self._tokenize(self.model_provider.tokenizer, request, args)
        return Prompt(**vars(request), tokenized=tokenized)

    def _tokenize(self, tokenizer, request, args):
        if isinstance(request, Prompt) and request.tokenized is not None:
            return request.tokenized
        tokenized = super()._tokenize(tokenizer, request, args)
        if request.request_type != "chat" or not tokenizer.has_chat_template:
            return tokenized
        # a chat ending in a system message (Claude Code's) keeps its system prompt too
        kwargs = {**self.model_provider.cli_args.chat_template_args}
        kwargs.update(args.chat_template_kwargs or {})
        return segment_system(
            tokenizer, request.messages, {"tools": request.tools, **kwargs}, tokenized
        )

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
        return (
            _RequestQueue(
                rq,
                group.rank(),
                group.size(),
                self.token_log,
                self._request_no,
                # the prompt cache's prefill copy: the single path only. On the batch
                # path mlx-lm's BatchGenerator prefills a merged copy of the request's
                # cache (the request's own list never follows it), and mlx-lm already
                # keeps that point itself: insert_segments splits the prompt's last
                # token off as its own segment and the segment before it is extracted
                # from the batch and inserted ("user" for a chat ending in a user turn)
                None if batched else getattr(self.prompt_cache, "prefill_progress", None),
                batched=batched,
                client_socket=getattr(rq, "client_socket", None),
                budget=self._time_budget,
                timer=None
                if self.metrics is None
                else self.metrics.timer(getattr(rq, "submitted", None)),
                prompt_cache=self.prompt_cache,
                in_flight=self.in_flight if group.rank() == 0 else None,
            ),
            *shared[1:],
        )
