"""The 2-rank server under mlx.launch on loopback, through the real openai client.

Malformed requests tried (each must get a 4xx with an OpenAI-style error body,
and the server must keep serving): see MALFORMED below — bad JSON, a non-object
body, invalid UTF-8, missing/empty/ill-typed messages, an unknown role, content
as a number or an object, a non-text content part, negative / zero / huge /
string max_tokens, temperature out of range or a string, top_p > 1, stop as an
object or a list of numbers, n = 0 and n = 2, an unknown model, stream as a
string, seed as a string, tools as a string, a text completion without a prompt
or with a numeric prompt, and a prompt longer than the context (in tokens, and
6 million tokens' worth of characters).

Issue 10 (hardening): every request field mlx-lm's server reads, out of range
(OUT_OF_RANGE) and at its bounds; the request that crashed both ranks; 16 MB of stop
strings; JSON nested 100k deep; bursts of 32 and 128 clients (none reset, identical
greedy tokens, 429 + Retry-After when the queue is full); a client that hangs up
mid-stream (both ranks stop at the same token); /v1/k3dist detail; 50 MB bodies, huge
headers, 1,000 idle and slowloris connections. All on one server, shared with
test_agent_api (serving.SHARED: --max-context 2048); the tests that
need a server of their own (lost ranks, SIGTERM, CORS and queue settings) are in
test_server_faults.py, batched decode on the trained mini-K3 in test_server_batch.py.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3dist.serve import warmup

import mlx.core as mx
import pytest
from serving import (
    CHAT,
    COMPL,
    HI,
    MESSAGES,
    TEXT_CONTEXT,
    burst,
    check_alive,
    check_burst,
    get_json,
    post_conn,
    post_raw,
    reference_tokens,
    stream_socket,
    text_of,
    token_log,
    wait_logs,
)


@pytest.fixture(scope="module")
def srv(shared):
    s = shared.get("text", __name__)  # read also by test_agent_api (serving.SHARED)
    yield s
    check_alive(s, f"after {__name__}")


def test_chat_streamed_and_not_equal_single_process(srv, mini_build):
    c = srv.client()
    seen = len(token_log(srv, 0))
    r = c.chat.completions.create(
        model="kimi-k3", messages=MESSAGES, max_tokens=24, temperature=0.0, seed=3
    )
    text = text_of(r.choices[0].message)
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    chunks = c.chat.completions.create(
        model="kimi-k3", messages=MESSAGES, max_tokens=24, temperature=0.0, seed=3, stream=True
    )
    streamed = "".join(text_of(ch.choices[0].delta) for ch in chunks if ch.choices)
    assert streamed == text and text
    sampled = c.chat.completions.create(
        model="kimi-k3", messages=MESSAGES, max_tokens=24, temperature=0.7, seed=11
    )

    logs = wait_logs(srv, seen, 3)
    assert len(logs[0]) == 3 and logs[0] == logs[1]  # both ranks generated the same tokens
    greedy, streamed_toks, sampled_toks = (e["tokens"] for e in logs[0])
    assert len(greedy) == r.usage.completion_tokens
    assert greedy == streamed_toks == reference_tokens(mini_build, MESSAGES, 24, 0.0, 3)
    assert sampled_toks == reference_tokens(mini_build, MESSAGES, 24, 0.7, 11)
    assert sampled_toks != greedy and sampled.usage.completion_tokens == len(sampled_toks)


def test_readme_completion_request_as_written(srv):
    """README's curl block, run with bash as printed but for the server's address
    (http://127.0.0.1:8080 -> this server's): a completion comes back."""
    import subprocess

    import doc_blocks

    [block] = doc_blocks.blocks_run_by(
        doc_blocks.README, "tests/serve/test_server.py::test_readme_completion_request_as_written"
    )
    assert "http://127.0.0.1:8080" in block.body
    r = subprocess.run(
        ["bash", "-ec", block.body.replace("http://127.0.0.1:8080", srv.url)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["object"] == "text_completion" and got["usage"]["completion_tokens"] > 0, got


def test_models_without_hf_cache_and_deployment_info(srv):
    status, body = get_json(srv.url + "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["kimi-k3"]
    assert [m.id for m in srv.client().models.list().data] == ["kimi-k3"]
    _, info = get_json(srv.url + "/v1/k3dist")
    assert info["ranks"] == 2 and info["prefill_chunks"][0] == 32
    assert info["attention"] == {"mode": "split", "split_layers": list(range(6))}  # default


def kernels_mapped(pid: int) -> set[str]:
    """The compiled-kernel libraries process ``pid`` has loaded (its /proc maps)."""
    d = str(warmup.jit_cache_dir())
    return {
        Path(x.rsplit(None, 1)[-1]).name
        for x in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if x.rstrip().endswith(".so") and x.rsplit(None, 1)[-1].startswith(d)
    }


def test_warm_up_leaves_nothing_to_compile(srv):
    """No graph compiles after warm-up, on either rank, with requests served alone and 8
    concurrent clients (batched decode, prompts joining mid-decode, streamed and not,
    greedy and sampled). Counted per rank process (the kernels it has loaded): the
    shared kernel directory also counts other processes' compiles (the suite's other
    worker), which is how this test once failed under load with 39 == 42."""
    _, before = get_json(srv.url + "/v1/k3dist")
    pids = srv.rank_pids()
    mapped = {r: kernels_mapped(pid) for r, pid in pids.items()}
    assert before["warmup"]["jit_kernels_loaded"] == len(mapped[0]) > 0
    assert mapped[1] and before["jit_kernels_after_warmup"] == []
    c = srv.client()
    for n in (3, 37, 70):  # prompt lengths whose chunks are all warmed-up sizes
        c.completions.create(model="kimi-k3", prompt="x " * n, max_tokens=5, temperature=0)
    gate = threading.Barrier(8)

    def client(i: int) -> None:
        gate.wait()  # all 8 at once: they decode together, later ones join mid-decode
        kw = dict(
            model="kimi-k3",
            prompt="x " * (1, 3, 9, 17, 33, 50, 70, 120)[i],
            max_tokens=6 + i,
            temperature=(0.0, 0.7)[i % 2],
        )
        if i % 3 == 0:
            assert "".join(
                ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices
            )
        else:
            assert c.completions.create(**kw).choices[0].text is not None

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(client, range(8)))
    _, after = get_json(srv.url + "/v1/k3dist")
    new = {r: sorted(kernels_mapped(pid) - mapped[r]) for r, pid in pids.items()}
    batches = sorted({b for b, t in after["shapes_seen"] if t == 1})
    print(
        f"\nkernels loaded by warm-up {before['warmup']['jit_kernels_loaded']}, new after "
        f"requests per rank {new}; decode batch sizes served {batches}"
    )
    assert max(batches) >= 2  # the clients were decoded together
    assert after["jit_kernels_after_warmup"] == [] and new == {0: [], 1: []}


OK = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MALFORMED = {
    "bad JSON": (CHAT, b'{"model": "kimi-k3", "messages": [', 400),
    "body not an object": (CHAT, b"[1, 2, 3]", 400),
    "invalid UTF-8": (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    "missing messages": (CHAT, {"model": "kimi-k3"}, 400),
    "empty messages": (CHAT, {**OK, "messages": []}, 400),
    "messages not a list": (CHAT, {**OK, "messages": "hi"}, 400),
    "message not an object": (CHAT, {**OK, "messages": ["hi"]}, 400),
    "unknown role": (CHAT, {**OK, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    "content a number": (CHAT, {**OK, "messages": [{"role": "user", "content": 42}]}, 400),
    "content an object": (CHAT, {**OK, "messages": [{"role": "user", "content": {}}]}, 400),
    "image part": (
        CHAT,
        {
            **OK,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
    ),
    "negative max_tokens": (CHAT, {**OK, "max_tokens": -5}, 400),
    "zero max_tokens": (CHAT, {**OK, "max_tokens": 0}, 400),
    "huge max_tokens": (CHAT, {**OK, "max_tokens": 10**9}, 400),
    "max_tokens a string": (CHAT, {**OK, "max_tokens": "10"}, 400),
    "negative temperature": (CHAT, {**OK, "temperature": -1}, 400),
    "temperature a string": (CHAT, {**OK, "temperature": "hot"}, 400),
    "top_p above 1": (CHAT, {**OK, "top_p": 1.5}, 400),
    "stop an object": (CHAT, {**OK, "stop": {"a": 1}}, 400),
    "stop numbers": (CHAT, {**OK, "stop": [1, 2]}, 400),
    "n = 0": (CHAT, {**OK, "n": 0}, 400),
    "n = 2": (CHAT, {**OK, "n": 2}, 400),
    "unknown model": (CHAT, {**OK, "model": "gpt-5"}, 404),
    "stream a string": (CHAT, {**OK, "stream": "yes"}, 400),
    "seed a string": (CHAT, {**OK, "seed": "1"}, 400),
    "tools a string": (CHAT, {**OK, "tools": "calc"}, 400),
    "completion without prompt": ("/v1/completions", {"model": "kimi-k3"}, 400),
    "numeric prompt": ("/v1/completions", {"prompt": 7}, 400),
    "prompt over the context": ("/v1/completions", {"prompt": "word " * TEXT_CONTEXT}, 400),
    "chat over the context": (
        CHAT,
        {"messages": [{"role": "user", "content": "word " * TEXT_CONTEXT}]},
        400,
    ),
    "max_tokens past the context": (CHAT, {**OK, "max_tokens": TEXT_CONTEXT}, 400),
}


def test_malformed_requests_get_4xx_and_server_keeps_serving(srv):
    for name, (path, body, status) in MALFORMED.items():
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, raw = post_raw(srv.url + path, data)
        assert got == status, (name, got, raw[:300])
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["type"] == "invalid_request_error", name
    got, raw = post_raw(srv.url + CHAT, json.dumps(OK).encode())
    assert got == 200, raw[:300]
    # no max_tokens: the server default (512) is capped to what fits the context (2048)
    long = {"messages": [{"role": "user", "content": "word " * 770}]}  # ~1,950 tokens
    got, raw = post_raw(srv.url + CHAT, json.dumps(long).encode(), 180)
    assert got == 200, raw[:300]
    usage = json.loads(raw)["usage"]
    assert usage["prompt_tokens"] + 512 > TEXT_CONTEXT, usage  # the cap is what applies
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= TEXT_CONTEXT


def test_six_million_token_prompt_refused_at_once(srv):
    t = time.perf_counter()
    got, raw = post_raw(
        srv.url + "/v1/completions",
        json.dumps({"prompt": "a " * 6_000_000, "max_tokens": 4}).encode(),
    )
    took = time.perf_counter() - t
    assert got in (400, 413), raw[:200]
    assert "context" in raw.decode() or "exceeds" in raw.decode()
    assert took < 10


def test_requests_arriving_together_are_served_intact(srv):
    """Concurrent requests are decoded together (see k3dist.serve.server) and each
    gets exactly what it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    c = srv.client()
    prompts = ["def f(x):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]

    def ask(p):
        return (
            c.completions.create(model="kimi-k3", prompt=p, max_tokens=8, temperature=0.0)
            .choices[0]
            .text
        )

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(ask, prompts))
    assert together == alone


# ---------------------------------------------------------------- issue 10: hardening

# Every field mlx-lm 0.32.2's server reads from a request (mlx_lm/server.py do_POST,
# handle_*_completions), out of range: each must get a 400 naming the field before it
# reaches the lockstep loop.
OUT_OF_RANGE = {
    "logit_bias id = vocab": (COMPL, lambda v: {**HI, "logit_bias": {str(v): 5}}, "logit_bias"),
    "logit_bias id 99999999": (COMPL, {**HI, "logit_bias": {"99999999": 5}}, "logit_bias"),
    "logit_bias id -1": (COMPL, {**HI, "logit_bias": {"-1": 5}}, "logit_bias"),
    "logit_bias id not a number": (COMPL, {**HI, "logit_bias": {"abc": 5}}, "logit_bias"),
    "logit_bias id ' 12'": (COMPL, {**HI, "logit_bias": {" 12": 5}}, "logit_bias"),
    "logit_bias value 1e9": (COMPL, {**HI, "logit_bias": {"12": 1e9}}, "logit_bias"),
    "logit_bias value NaN": (COMPL, {**HI, "logit_bias": {"12": float("nan")}}, "logit_bias"),
    "logit_bias value a string": (COMPL, {**HI, "logit_bias": {"12": "5"}}, "logit_bias"),
    "logit_bias 301 entries": (
        COMPL,
        {**HI, "logit_bias": {str(i): 1 for i in range(301)}},
        "logit_bias",
    ),
    "logit_bias a list": (COMPL, {**HI, "logit_bias": [1, 2]}, "logit_bias"),
    "seed -1": (COMPL, {**HI, "seed": -1}, "seed"),
    "seed 10**30": (COMPL, {**HI, "seed": 10**30}, "seed"),
    "seed 2**64": (COMPL, {**HI, "seed": 2**64}, "seed"),
    "seed 1.5": (COMPL, {**HI, "seed": 1.5}, "seed"),
    "top_logprobs -1": (COMPL, {**HI, "top_logprobs": -1}, "top_logprobs"),
    "top_logprobs 12": (COMPL, {**HI, "top_logprobs": 12}, "top_logprobs"),
    "top_k -1": (COMPL, {**HI, "top_k": -1}, "top_k"),
    "top_k = vocab": (COMPL, lambda v: {**HI, "top_k": v}, "top_k"),
    "top_k 2.5": (COMPL, {**HI, "top_k": 2.5}, "top_k"),
    "min_p -0.1": (COMPL, {**HI, "min_p": -0.1}, "min_p"),
    "min_p 1.5": (COMPL, {**HI, "min_p": 1.5}, "min_p"),
    "top_p -0.1": (COMPL, {**HI, "top_p": -0.1}, "top_p"),
    "top_p 1e-200": (COMPL, {**HI, "top_p": 1e-200}, "top_p"),  # 0 in float32: see below
    "temperature 2.5": (COMPL, {**HI, "temperature": 2.5}, "temperature"),
    "temperature Infinity": (COMPL, {**HI, "temperature": float("inf")}, "temperature"),
    "temperature NaN": (COMPL, {**HI, "temperature": float("nan")}, "temperature"),
    "temperature true": (COMPL, {**HI, "temperature": True}, "temperature"),
    "presence_penalty 3": (COMPL, {**HI, "presence_penalty": 3}, "presence_penalty"),
    "frequency_penalty -3": (COMPL, {**HI, "frequency_penalty": -3}, "frequency_penalty"),
    "repetition_penalty -1": (COMPL, {**HI, "repetition_penalty": -1}, "repetition_penalty"),
    "repetition_penalty 11": (COMPL, {**HI, "repetition_penalty": 11}, "repetition_penalty"),
    "repetition_context_size -1": (
        COMPL,
        {**HI, "repetition_context_size": -1},
        "repetition_context_size",
    ),
    "repetition_context_size 10**9": (
        COMPL,
        {**HI, "repetition_context_size": 10**9},
        "repetition_context_size",
    ),
    "presence_context_size -1": (
        COMPL,
        {**HI, "presence_context_size": -1},
        "presence_context_size",
    ),
    "frequency_context_size 10**9": (
        COMPL,
        {**HI, "frequency_context_size": 10**9},
        "frequency_context_size",
    ),
    "xtc_probability 1.5": (COMPL, {**HI, "xtc_probability": 1.5}, "xtc_probability"),
    "xtc_threshold 0.9": (COMPL, {**HI, "xtc_threshold": 0.9}, "xtc_threshold"),
    "max_tokens true": (COMPL, {**HI, "max_tokens": True}, "max_tokens"),
    "max_completion_tokens 0": (COMPL, {**HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    "max_completion_tokens 10**9": (
        COMPL,
        {**HI, "max_completion_tokens": 10**9},
        "max_completion_tokens",
    ),
    "n 2": (COMPL, {**HI, "n": 2}, "n"),
    "stop 5 sequences": (COMPL, {**HI, "stop": list("abcde")}, "stop"),
    "stop 1 MB": (COMPL, {**HI, "stop": "x" * 2**20}, "stop"),
    "stop empty": (COMPL, {**HI, "stop": ""}, "stop"),
    "stream_options include_usage a string": (
        COMPL,
        {**HI, "stream": True, "stream_options": {"include_usage": "y"}},
        "stream_options",
    ),
    "logprobs a string": (COMPL, {**HI, "logprobs": "yes"}, "logprobs"),
    "draft_model": (COMPL, {**HI, "draft_model": "x"}, "draft_model"),
    "num_draft_tokens": (COMPL, {**HI, "num_draft_tokens": 10**6}, "num_draft_tokens"),
    "adapters": (COMPL, {**HI, "adapters": "/etc"}, "adapters"),
    "messages on /v1/completions": (COMPL, {**HI, "messages": []}, "messages"),
    "chat_template_kwargs tokenize": (
        CHAT,
        {**OK, "chat_template_kwargs": {"tokenize": False}},
        "chat_template_kwargs",
    ),
    "chat_template_kwargs tools": (
        CHAT,
        {**OK, "chat_template_kwargs": {"tools": []}},
        "chat_template_kwargs",
    ),
    "chat_template_kwargs 17 keys": (
        CHAT,
        {**OK, "chat_template_kwargs": {f"k{i}": 1 for i in range(17)}},
        "chat_template_kwargs",
    ),
    "chat_template_kwargs object value": (
        CHAT,
        {**OK, "chat_template_kwargs": {"a": {"b": 1}}},
        "chat_template_kwargs",
    ),
    "chat_template_kwargs 1 KB string": (
        CHAT,
        {**OK, "chat_template_kwargs": {"a": "x" * 1024}},
        "chat_template_kwargs",
    ),
    "tools 129": (
        CHAT,
        {**OK, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
        "tools",
    ),
    "tools 1 MB": (
        CHAT,
        {
            **OK,
            "tools": [{"type": "function", "function": {"name": "f", "description": "x" * 2**20}}],
        },
        None,
    ),  # over the context
    "role_mapping": (CHAT, {**OK, "role_mapping": {"user": "x" * 100}}, "role_mapping"),
}


@pytest.mark.parametrize("name", list(OUT_OF_RANGE))
def test_out_of_range_field_gets_400_naming_it(srv, name):
    path, body, param = OUT_OF_RANGE[name]
    if callable(body):  # depends on the served vocabulary
        body = body(get_json(srv.url + "/v1/k3dist")[1]["vocab_size"])
    t = time.perf_counter()
    got, raw = post_raw(srv.url + path, json.dumps(body).encode())
    took = time.perf_counter() - t
    assert got == 400, (name, got, raw[:300])
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if param is not None:
        assert param in err["message"], err
    assert took < 5, took  # refused before tokenizing or queueing anything costly


def test_smallest_top_p_samples_the_same_token_on_both_ranks(srv):
    """top_p at its floor keeps only the top token, on both ranks. Below it, top_p times
    the float32 mass is 0 and mlx-lm's top-p filter read one past the vocabulary: the
    fuzzer saw the ranks sample different first tokens (benchmarks/faults/fuzz_requests.py)."""
    seen = len(token_log(srv, 0))
    for t in (0.7, 1.5):
        got, _, raw = post_conn(srv.port, {**HI, "max_tokens": 3, "temperature": t, "top_p": 1e-30})
        assert got == 200, raw[:300]
    logs = wait_logs(srv, seen, 2)
    assert len(logs[0]) == 2 and logs[0] == logs[1]
    greedy = post_conn(srv.port, {**HI, "max_tokens": 3, "temperature": 0})
    assert greedy[0] == 200
    logs = wait_logs(srv, seen, 3)
    # only the top token is kept: the sampled answers are the greedy one
    assert logs[0][0]["tokens"] == logs[0][1]["tokens"] == logs[0][2]["tokens"]


def test_null_fields_are_the_defaults(srv):
    """null is "not given" in OpenAI's API: served, not refused in mlx-lm's own error
    shape (found by the fuzzer: stream and temperature null were a bare {"error": str})."""
    for path, base in ((COMPL, HI), (CHAT, OK)):
        got, _, raw = post_conn(
            srv.port,
            {
                **base,
                "stream": None,
                "temperature": None,
                "top_p": None,
                "stop": None,
                "seed": None,
            },
            path,
        )
        assert got == 200, (path, raw[:300])
        assert json.loads(raw)["choices"], raw[:300]


def test_edge_values_are_served(srv):
    """The bounds themselves: each served (200) by both ranks, which keep running."""
    v = get_json(srv.url + "/v1/k3dist")[1]["vocab_size"]
    edges = [
        {"top_k": v - 1, "temperature": 2, "seed": 2**64 - 1},
        {"logprobs": True, "top_logprobs": 11, "min_p": 1, "top_p": 0},
        {"logit_bias": {str(i): (-100 if i % 2 else 100) for i in range(v - 300, v)}},
        {
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "repetition_penalty": 10,
            "repetition_context_size": TEXT_CONTEXT,
            "presence_context_size": 0,
            "frequency_context_size": TEXT_CONTEXT,
        },
        {"xtc_probability": 1, "xtc_threshold": 0.5, "temperature": 1, "seed": 0},
        {"stop": ["x" * 256] * 4, "stream": True, "stream_options": {}},
    ]
    for extra in edges:
        got, _, raw = post_conn(srv.port, {**HI, **extra})
        assert got == 200, (extra, raw[:300])
        assert b"error" not in raw, raw[:300]
    got, _, raw = post_conn(srv.port, {**OK, "chat_template_kwargs": {"thinking": False}}, CHAT)
    assert got == 200, raw[:300]
    assert set(srv.rank_pids()) == {0, 1}


def test_crash_request_is_refused_and_both_ranks_keep_serving(srv):
    """Issue 10's request that killed both ranks (a logit_bias id = the vocabulary size:
    "double free or corruption"), the seeds that closed the connection with no status
    (streamed: an empty stream that ended as if normal), then the last valid id."""
    vocab = get_json(srv.url + "/v1/k3dist")[1]["vocab_size"]  # 4352 for k3dist/data/mini-k3
    crash = b'{"prompt":"hi","max_tokens":4,"logit_bias":{"4352":5}}'
    for body in (crash, {"prompt": "hi", "max_tokens": 4, "logit_bias": {str(vocab): 5}}):
        got, _, raw = post_conn(srv.port, body)
        assert got == 400 and b"logit_bias" in raw, raw
    for seed in (-1, 10**30):
        for stream in (False, True):
            got, _, raw = post_conn(srv.port, {**HI, "seed": seed, "stream": stream})
            assert got == 400 and json.loads(raw)["error"]["param"] == "seed", raw
    seen = len(token_log(srv, 0))
    r = srv.client().completions.create(
        model="kimi-k3",
        prompt="hi",
        max_tokens=3,
        temperature=0.0,
        logit_bias={str(vocab - 1): 100},
    )
    assert r.usage.completion_tokens >= 1
    logs = wait_logs(srv, seen, 1)
    assert logs[0] == logs[1] and logs[0][0]["tokens"][0] == vocab - 1  # the bias took effect
    assert set(srv.rank_pids()) == {0, 1}


def test_huge_stop_strings_and_deep_json_refused_at_once(srv):
    """16 distinct 1 MB stop strings held the one-at-a-time server ~25 s; JSON nested
    100k deep dropped the connection without a status."""
    t = time.perf_counter()
    got, _, raw = post_conn(srv.port, {**HI, "stop": [chr(65 + i) * 2**20 for i in range(16)]})
    took = time.perf_counter() - t
    assert got == 400 and json.loads(raw)["error"]["param"] == "stop", raw[:300]
    assert took < 5, took
    got, _, raw = post_conn(srv.port, b"[" * 100_000 + b"]" * 100_000)
    assert got == 400 and b"nested" in raw, raw[:300]
    deep = json.loads("[" * 900 + "]" * 900)  # parses, but would be pickled to rank 1
    got, _, raw = post_conn(srv.port, {**HI, "tools_extra": deep})
    assert got == 400 and b"nested" in raw, raw[:300]
    # four stop sequences of the longest allowed length are served
    got, _, raw = post_conn(srv.port, {**HI, "stop": [chr(65 + i) * 256 for i in range(4)]})
    assert got == 200, raw[:300]


@pytest.mark.parametrize("n", [32, 128])
def test_burst_is_served_or_refused_never_reset(srv, n):
    """The listen backlog was 5: bursts of 32 got ConnectionResetError. Now all are
    accepted; past 64 in flight (the default bound) a request gets 429."""
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0.0}
    seen = len(token_log(srv, 0))
    t = time.perf_counter()
    served, refused = check_burst(burst(srv.port, n, body))
    print(
        f"\nburst of {n}: {served} served, {refused} refused (429) in "
        f"{time.perf_counter() - t:.1f}s"
    )
    if n <= 64:
        assert served == n
    logs = wait_logs(srv, seen, served)
    assert logs[0] == logs[1] and len(logs[0]) == served
    assert len({tuple(e["tokens"]) for e in logs[0]}) == 1  # identical greedy tokens


def test_client_disconnect_mid_stream_keeps_ranks_in_lockstep(srv):
    """mlx-lm abandons a request whose client went away on rank 0 alone (its
    NotImplementedError path), while rank 1 goes on generating: the next request then
    meets rank 1 mid-generation. Here both ranks stop at the same token."""
    seen = len(token_log(srv, 0))
    s = stream_socket(srv.port, {"prompt": "def f(x):", "max_tokens": 200, "temperature": 0.0}, 3)
    s.close()
    t = time.perf_counter()
    r = srv.client().completions.create(
        model="kimi-k3", prompt="import os", max_tokens=6, temperature=0.0
    )
    print(f"\nnext request answered {time.perf_counter() - t:.2f}s after the disconnect")
    assert r.usage.completion_tokens == 6
    logs = wait_logs(srv, seen, 2)
    assert logs[0] == logs[1], logs  # the same tokens on both ranks, for both requests
    cut, nxt = logs[0]
    assert cut["error"] is not None and 3 <= len(cut["tokens"]) < 200, cut
    assert nxt["error"] is None and len(nxt["tokens"]) == 6
    assert set(srv.rank_pids()) == {0, 1}


def test_cors_off_and_detail_for_loopback_only(srv):
    for method, body in (("OPTIONS", b""), ("POST", HI)):
        status, headers, _ = post_conn(
            srv.port, body, headers={"Origin": "http://evil.example"}, method=method
        )
        assert status in (200, 204)
        assert not any(k.lower().startswith("access-control") for k in headers), headers
    status, body = get_json(srv.url + "/v1/k3dist")
    assert status == 200 and "preflight" in body and "blas" in body  # loopback: everything
    fp = (
        srv.client()
        .completions.create(model="kimi-k3", prompt="hi", max_tokens=1)
        .system_fingerprint
    )
    assert fp == f"k3dist-0.1.0-mlx-{mx.__version__}", fp
    assert os.uname().release not in fp


def test_oversized_body_and_headers_get_4xx(srv):
    """A 50 MB body is refused from its Content-Length (413) before it is read; a
    100 KB header line or 200 headers get http.server's 431."""
    import http.client

    body = b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}'
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    t = time.perf_counter()
    try:
        conn.request("POST", COMPL, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        status, raw = r.status, r.read()
    except OSError as e:  # the server answered and closed while the body was still going
        status, raw = type(e).__name__, b""
    finally:
        conn.close()
    print(f"\n50 MB body: {status} in {time.perf_counter() - t:.2f}s")
    assert status == 413 and b"exceeds" in raw, (status, raw[:200])
    status, _, _ = post_conn(srv.port, HI, headers={"X-Big": "a" * 100_000})
    assert status == 431
    status, _, _ = post_conn(srv.port, HI, headers={f"X-H{i}": "1" for i in range(200)})
    assert status == 431


def test_idle_and_slow_connections_do_not_block_service(srv):
    """1,000 connections that send nothing and 20 that send a header byte a second
    (slowloris) hold handler threads (at most max_connections, 2048 by default; idle
    ones are dropped after 30 s); a real client is still served at once."""
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(1000)]
    slow = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
    try:
        for s in slow:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        times = []
        for _ in range(3):
            for s in slow:
                s.sendall(b"X")
            t = time.perf_counter()
            got, _, raw = post_conn(srv.port, HI)
            times.append(time.perf_counter() - t)
            assert got == 200, raw[:200]
            time.sleep(1)
        print(
            f"\nwith 1000 idle + 20 slowloris connections: served in "
            f"{', '.join(f'{x:.2f}' for x in times)} s"
        )
        assert max(times) < 10
    finally:
        for s in idle + slow:
            s.close()
