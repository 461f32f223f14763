"""HTTP serving of an expert-parallel K3 on mlx-lm's server: the handler, routing and
the HTTP server; rank 0 serves.

The APIs are thin modules over one lockstep core (``k3dist.serve.lockstep``): OpenAI
chat/completions and completions (``openai_api``), Anthropic Messages
(``anthropic_api``) and OpenAI Responses (``responses_api``), the last two retold
through ``relay``. Per request, the handler parses the body once; the API module
validates it (and translates it into a chat completion) once; the prompt is rendered
and tokenized once (``K3ResponseGenerator.tokenize``), its length checked on those
tokens, which every rank then generates from; mlx-lm's ``handle_completion`` streams
the answer.

- ``K3APIHandler``: every request is validated before it reaches the generation
  loop (4xx errors in each API's shape), prompts longer than the context are refused
  at once, ``/v1/models`` lists the served model without scanning a Hugging Face
  cache, and ``/v1/k3dist`` reports the deployment (in full to loopback callers
  only); CORS is off unless origins are configured.
- Streams show life at once: a streamed request's head and opening event
  (chat/completions: a first chunk with the assistant role; Anthropic:
  ``message_start``; Responses: ``response.created``) are sent before the request
  reaches the generation loop, and while nothing else is sent (a long prefill, a wait
  for the loop) a keep-alive every ``keepalive_s`` in the API's own form (an SSE
  comment ``: keep-alive``, Anthropic ``ping``, Responses ``response.in_progress``),
  so a client's idle time-out does not fire while the server works (docs/agents.md).
- ``K3HTTPServer``: a deep listen backlog and a bounded number of handler threads,
  so a burst of clients is queued, never reset; past ``max_queued_requests``
  completions in flight a request gets 429 with ``Retry-After``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import resource
import socket
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from k3dist import __version__ as k3dist_version
from k3dist.config.deployment import Deployment
from k3dist.format.kvmemory import PROMPT_CACHE_ENTRIES, prompt_cache_bound
from k3dist.serve import (
    metrics,
)
from k3dist.serve.admission import Admission
from k3dist.serve.handler import K3APIHandler
from k3dist.serve.lockstep import K3ModelProvider, K3ResponseGenerator
from k3dist.serve.prompt_cache import K3PromptCache

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


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


def cli_args(dep: Deployment) -> argparse.Namespace:
    """The settings mlx_lm.server reads: the deployment's, with mlx-lm's defaults where
    we have no say. ``max_batch`` requests decode together; prompts are prefilled one at
    a time (``prompt_concurrency`` 1: prefill shapes stay batch 1, the warmed chunks)."""
    return argparse.Namespace(
        model=dep.model_id,
        adapter_path=None,
        draft_model=None,
        num_draft_tokens=3,
        trust_remote_code=False,
        chat_template="",
        use_default_chat_template=False,
        chat_template_args={},
        allowed_origins=list(dep.cors_origins),
        temp=dep.temperature,
        top_p=dep.top_p,
        top_k=0,
        min_p=0.0,
        max_tokens=dep.max_tokens,
        decode_concurrency=dep.max_batch,
        prompt_concurrency=1,
        prefill_step_size=dep.prefill_chunk,
        prompt_cache_size=PROMPT_CACHE_ENTRIES,
        prompt_cache_bytes=None,
        kv_bits=None,
        kv_group_size=64,
        quantized_kv_start=5000,
        pipeline=False,
    )


def handler_class(
    dep: Deployment,
    vocab_size: int,
    info: dict | None = None,
    *,
    vision_limits=None,
    api_key: str | None = None,
    serve_metrics: metrics.ServeMetrics | None = None,
) -> type[K3APIHandler]:
    """The handler of one deployment: its limits are the deployment's (``info``: what
    ``/v1/k3dist`` reports; ``vision_limits``: None serves text only; ``serve_metrics``:
    None serves no /metrics)."""
    return type(
        "Handler",
        (K3APIHandler,),
        {
            "deployment": dep,
            "model_id": dep.model_id,
            "max_context": dep.max_context,
            "info": dict(info or {}),
            "vocab_size": vocab_size,
            "admission": Admission(dep.max_queued_requests),
            "vision_limits": vision_limits,
            "api_key": api_key,
            "metrics": serve_metrics,
            "keepalive_s": dep.keepalive_s,
        },
    )


def serve(
    dep: Deployment,
    provider: K3ModelProvider,
    info: dict,
    *,
    vocab_size: int,
    token_log: Path | None = None,
    vision_limits=None,
    api_key: str | None = None,
    prefix_store=None,
    idle_gate=None,
    serve_metrics: metrics.ServeMetrics | None = None,
) -> None:
    """mlx_lm.server.run with our generator, handler and HTTP server, for the deployment
    ``dep``; rank 0 serves. ``prefix_store``: prefix caches on disk
    (k3dist.serve.prefix_store) or None; its most recently used entries, up to
    ``prefix_cache_preload_gb`` a rank, go into memory before the first request (every
    rank, here, before the generation loop starts); ``idle_gate``: the watchdog
    (multi-rank): idle ranks wait on it, not in a collective; ``serve_metrics``: what
    every rank counts (rank 0 serves it at ``/metrics``)."""
    group = mx.distributed.init()
    prompt_cache = K3PromptCache(
        provider.cli_args.prompt_cache_size,
        lambda: make_prompt_cache(provider.model),
        prompt_cache_bound(dep.prompt_cache_tokens, dep.max_context),
        prefix_store,
    )
    preload_bytes = int(dep.prefix_cache_preload_gb * 1e9)
    if prefix_store is not None and preload_bytes > 0:
        prompt_cache.preload(provider.model_key, preload_bytes)
    generator = K3ResponseGenerator(provider, prompt_cache, token_log, idle_gate)
    generator.metrics = serve_metrics
    if group.rank() != 0:
        generator.join()
        if prefix_store is not None:
            prefix_store.close()  # queued entries reach the disk on a clean stop
        return
    handler = handler_class(
        dep,
        vocab_size,
        info,
        vision_limits=vision_limits,
        api_key=api_key,
        serve_metrics=serve_metrics,
    )
    if serve_metrics is not None:
        serve_metrics.admission, serve_metrics.prompt_cache = handler.admission, prompt_cache
    host, port = dep.host, dep.port
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    server_class = type("Server", (K3HTTPServer,), {"address_family": family})
    fp = fingerprint()
    httpd = server_class(
        address,
        lambda *a, **k: handler(generator, *a, system_fingerprint=fp, **k),
        max_connections=dep.max_connections,
    )
    logging.info("serving %s on http://%s:%d", provider.served_id, host, port)
    if api_key is None and not _loopback(host):
        print(
            f"k3dist: WARNING: serving on {host} with no API key: anyone who can reach "
            "this port can use it (set api_key_file)",
            flush=True,
        )
    print(
        f"k3dist: serving {provider.served_id} on http://{host}:{port} (at most "
        f"{dep.max_queued_requests} requests in flight, {dep.max_connections} connections; "
        f"CORS {provider.cli_args.allowed_origins or 'off'}; API key "
        f"{'required' if api_key else 'off'})",
        flush=True,
    )
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        generator.stop_and_join()
        if prefix_store is not None:
            prefix_store.close()
