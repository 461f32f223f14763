"""Issue 14: batched decode through the 2-rank server on the trained mini-K3."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model, load_tokenizer
from serving import (
    Server,
    get_json,
    rank_folders,
    stream_socket,
    token_log,
    wait_logs,
)

BATCH_PROMPTS = [
    "class Queue:\n    def __init__(self, maxsize=0):\n        ",
    "def f(x):",
    "import os\nimport sys\n\ndef read_file(path):\n",
    "for i in range(10):",
    "The river ran",
    "def main():\n    for arg in sys.argv[1:]:\n",
    "x = [1, 2, 3]\n",
    "Once upon a time, in a small town by the sea, there",
]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The 2-rank server on the trained mini-K3 (k3dist/data/mini-k3), batching up to 8."""
    from k3dist import MINI_K3
    from k3dist.pipeline import convert

    tmp = tmp_path_factory.mktemp("shipped-serve")
    build = convert.convert(MINI_K3, tmp / "build", progress=False)
    s = Server(rank_folders(build, tmp / "ranks"), tmp, ("--max-batch", "8"))
    s.build = build
    yield s
    s.stop()


def test_batch_of_8_gives_each_request_its_greedy_tokens_alone(shipped):
    """Issue 14: eight concurrent requests decode together (every rank, in lockstep);
    each gets the greedy tokens single-process mlx-lm gives its prompt alone, and the
    same prompt served alone gets them too. A client that hangs up mid-batch ends its
    own request on both ranks at the same token; the others go on. Every shape the
    batch took was warmed up before serving (no new kernel compiled)."""
    from concurrent.futures import ThreadPoolExecutor

    from k3dist.bench import greedy

    n_tok = 24
    model, _ = load_model(shipped.build)
    model.set_dtype(mx.float32)
    tok = load_tokenizer(shipped.build, {"trust_remote_code": False})
    eos = set(tok.eos_token_ids)
    ref = []
    for p in BATCH_PROMPTS:
        toks, _ = greedy.greedy(model, tok.encode(p), n_tok)
        cut = next((i + 1 for i, t in enumerate(toks) if t in eos), n_tok)
        ref.append(toks[:cut])
    del model
    _, info = get_json(shipped.url + "/v1/k3dist")
    assert info["max_batch"] == 8 and info["warmup"]["decode"] == list(range(1, 9))
    c = shipped.client()

    def ask(p):
        return (
            c.completions.create(model="kimi-k3", prompt=p, max_tokens=n_tok, temperature=0.0)
            .choices[0]
            .text
        )

    seen = len(token_log(shipped, 0))
    # a streamed request that will hang up while the batch runs
    s = stream_socket(
        shipped.port, {"prompt": "def g(y):", "max_tokens": 400, "temperature": 0.0}, 2
    )
    with ThreadPoolExecutor(len(BATCH_PROMPTS)) as ex:
        futures = [ex.submit(ask, p) for p in BATCH_PROMPTS]
        time.sleep(0.5)
        s.close()
        together = [f.result(timeout=120) for f in futures]
    logs = wait_logs(shipped, seen, len(BATCH_PROMPTS) + 1)
    assert logs[0] == logs[1], logs  # both ranks: the same tokens, the same stops
    cut = [e for e in logs[0] if e["error"] is not None]
    assert len(cut) == 1 and 2 <= len(cut[0]["tokens"]) < 400, cut
    done = sorted(e["tokens"] for e in logs[0] if e["error"] is None)
    assert done == sorted(ref), (done, ref)
    assert all(together)
    assert ask(BATCH_PROMPTS[0]) == together[0]  # served alone, after the batch

    _, after = get_json(shipped.url + "/v1/k3dist")
    batches = sorted({b for b, t in after["shapes_seen"] if t == 1})
    print(
        f"\ndecode batch sizes served: {batches}; shapes warmed "
        f"{len(info['warmup']['shapes'])}, JIT kernels {info['jit_kernels']} -> "
        f"{after['jit_kernels']}"
    )
    assert max(batches) >= 4  # the requests were decoded together
    assert {tuple(x) for x in after["shapes_seen"]} <= {tuple(x) for x in info["warmup"]["shapes"]}
    assert after["jit_kernels"] == info["jit_kernels"]
    assert set(shipped.rank_pids()) == {0, 1}
    assert get_json(shipped.url + "/health")[0] == 200
