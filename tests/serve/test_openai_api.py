"""The OpenAI API module (k3dist.serve.openai_api) against mlx-lm's own handler, and one
chat request through the real handler and lockstep core: its body parsed once, its
prompt rendered and tokenized once."""

from __future__ import annotations

import http.client
import io
import json
import threading
from types import SimpleNamespace

from k3dist.config.deployment import Deployment
from k3dist.serve import lockstep, openai_api, server
from k3dist.serve.openai_api import RequestError
from k3dist.serve.prompt_cache import K3PromptCache

import pytest
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
LIMITS = {"model_id": "kimi-k3", "max_context": 512, "vocab_size": 1000}
DEP = Deployment(
    max_context=512,
    max_tokens=64,
    temperature=0.6,
    top_p=0.95,
    prefill_chunk=32,
    max_queued_requests=4,
)
ARGS = server.cli_args(DEP)
USER = [{"role": "user", "content": "Hello there"}]
FULL = {
    "model": "kimi-k3",
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 7,
    "temperature": 0.3,
    "top_p": 0.5,
    "top_k": 4,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "repetition_context_size": 9,
    "presence_penalty": 0.5,
    "presence_context_size": 8,
    "frequency_penalty": -0.5,
    "frequency_context_size": 7,
    "xtc_probability": 0.2,
    "xtc_threshold": 0.3,
    "logit_bias": {"12": 3.0},
    "logprobs": True,
    "top_logprobs": 3,
    "seed": 5,
    "stop": ["\n\n", "END"],
}


class _MlxHandler(mlx_server.APIHandler):
    """mlx-lm's own handler reading a body, without a socket; what it would run is kept."""

    def __init__(self, path: str, raw: bytes):
        self.path, self.rfile, self.wfile = path, io.BytesIO(raw), io.BytesIO()
        self.headers = {"Content-Length": str(len(raw))}
        self.response_generator = SimpleNamespace(cli_args=ARGS)
        self.ran = None

    def handle_completion(self, request, stop_words):
        self.ran = (request, stop_words)


@pytest.mark.parametrize(
    "path,body",
    [
        (CHAT, {"messages": USER}),
        (CHAT, {"messages": USER, **FULL, "chat_template_kwargs": {"thinking": False}}),
        (TEXT, {"prompt": "def f(x):"}),
        (TEXT, {"prompt": "def f(x):", **FULL, "max_completion_tokens": 3, "stop": "\n"}),
    ],
)
def test_handler_fields_are_what_mlx_lms_do_post_sets(path, body):
    """``handler_fields`` (set instead of mlx-lm's parse of the body) are mlx-lm 0.32.2's
    own values for the same request, its defaults included; and the request it runs."""
    mlx = _MlxHandler(path, json.dumps(body).encode())
    mlx.do_POST()
    assert mlx.ran is not None, mlx.wfile.getvalue()
    req = openai_api.validate(path, body, **LIMITS)
    fields = openai_api.handler_fields(req, ARGS)
    assert {k: getattr(mlx, k) for k in fields} == fields
    assert req.stop_words() == mlx.ran[1]
    ours = SimpleNamespace(body=req.body(), stream=fields["stream"])
    make = (
        mlx_server.APIHandler.handle_chat_completions
        if path == CHAT
        else mlx_server.APIHandler.handle_text_completions
    )
    assert make(ours) == mlx.ran[0]


def test_explicit_nulls_are_defaults_and_bounds_name_their_field():
    nulls = {k: None for k in FULL} | {"chat_template_kwargs": None, "tools": None}
    req = openai_api.validate(CHAT, {"messages": USER, **nulls}, **LIMITS)
    assert openai_api.handler_fields(req, ARGS) == openai_api.handler_fields(
        openai_api.validate(CHAT, {"messages": USER}, **LIMITS), ARGS
    )
    for body, param, words in (
        ({"top_p": 1e-31}, "top_p", "at least 1e-30"),
        ({"logit_bias": {"1000": 1}}, "logit_bias", "[0, 1000)"),
        ({"top_k": 1000}, "top_k", "[0, 999]"),
        ({"max_tokens": 513}, "max_tokens", "[1, 512]"),
        ({"temperature": float("nan")}, "temperature", "temperature"),
        ({"seed": True}, "seed", "seed"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "text only",
        ),
    ):
        with pytest.raises(RequestError) as e:
            openai_api.validate(CHAT, {"messages": USER, **body}, **LIMITS)
        assert (e.value.status, e.value.param) == (400, param) and words in str(e.value)
        assert e.value.body()["error"]["type"] == "invalid_request_error"
    with pytest.raises(RequestError) as e:
        openai_api.validate(CHAT, {"messages": USER, "model": "/etc"}, **LIMITS)
    assert (e.value.status, e.value.code) == (404, "model_not_found")


@pytest.fixture(scope="module")
def served(mini_build):
    """The real handler, HTTP server and lockstep core over the mini build, in this
    process (one rank)."""
    model, _ = load_model(mini_build)
    tok = load_tokenizer(mini_build)
    provider = lockstep.K3ModelProvider(ARGS, model, tok, "kimi-k3")
    cache = K3PromptCache(8, lambda: make_prompt_cache(model), 4096, None)
    gen = lockstep.K3ResponseGenerator(provider, cache)
    handler = server.handler_class(DEP, tok.vocab_size)
    httpd = server.K3HTTPServer(
        ("127.0.0.1", 0),
        lambda *a, **k: handler(gen, *a, system_fingerprint="test", **k),
        max_connections=8,
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield SimpleNamespace(port=httpd.server_address[1], tok=tok)
    httpd.shutdown()
    gen.stop_and_join()


def _post(port: int, path: str, raw: bytes) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, raw, {"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.read()
    c.close()
    return r.status, out


@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/v1/responses"])
def test_one_request_parses_its_body_once_and_tokenizes_its_prompt_once(served, monkeypatch, path):
    """Counted on the tokenizer and on json.loads, for a chat completion and each agent
    API (both translate to one): the full prompt is rendered once (mlx-lm's generation
    takes those tokens), and the body is parsed once."""
    body = {
        "model": "kimi-k3",
        "max_tokens": 3,
        "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    if path == "/v1/responses":
        body = {
            "model": "kimi-k3",
            "max_output_tokens": 3,
            "temperature": 0,
            "instructions": "Be brief.",
            "input": "Hi",
        }
    elif path == "/v1/messages":
        body = dict(body, system="Be brief.", messages=body["messages"][1:])
    raw = json.dumps(body)
    hf = served.tok._tokenizer
    renders, parses = [], []
    real_render, real_loads = hf.apply_chat_template, json.loads

    def render(messages, *a, **kw):
        if kw.get("add_generation_prompt"):  # the prompt (not mlx-lm's system-prefix probe)
            renders.append(len(messages))
        return real_render(messages, *a, **kw)

    def loads(s, *a, **kw):
        if s == raw:
            parses.append(1)
        return real_loads(s, *a, **kw)

    monkeypatch.setattr(hf, "apply_chat_template", render)
    monkeypatch.setattr(json, "loads", loads)
    status, out = _post(served.port, path, raw.encode())
    monkeypatch.undo()
    assert status == 200, out[:300]
    assert renders == [2] and parses == [1], (renders, parses)
    if path == CHAT:  # the usage counts the tokens mlx-lm generated from
        ids = served.tok.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True
        )
        assert json.loads(out)["usage"]["prompt_tokens"] == len(ids)
