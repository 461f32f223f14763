"""Peak RSS of the streamed teacher and of calibration against the whole model in
memory, on the ``bench`` preset (routed experts ~85% of ~500 MB, as in the real model).

    python benchmarks/memory/stream_memory.py --windows 16 --seq 256 --out results.json

Each measurement is a child process (Linux VmHWM minus the RSS after imports): the
streamed teacher (``k3dist.pipeline.teacher``), calibration (``k3dist.pipeline.calibrate``,
forward + streamed backward) and, for comparison, mlx-lm's whole model loaded and run
on the same windows. The bound each streamed run promises: a fixed overhead + the token
set's states (``k3dist.pipeline.stream.state_bytes``; x2 for calibration: cotangents) + the
largest layer's weights as held (float32) and as read (x2 for calibration: student and
teacher layer) +
one batch's logits and KDA-layer prefill (one recurrent state per token), and for
calibration one batch's KDA-layer backward. Prints JSON
with its command; also states the bound for real K3 (hidden 7168, 8 AttnRes blocks).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from k3dist.bench import membound, record
from k3dist.factory import synth
from k3dist.format import layout
from k3dist.format.folder import load_config
from k3dist.format.sfile import DTYPE_BYTES
from k3dist.pipeline import convert, promote, stream

import numpy as np

_CHILD = """
import json, sys
import numpy as np
from k3dist.pipeline.rss import peak_rss, rss
from k3dist.pipeline import calibrate, stream, teacher
import mlx.core as mx
from mlx_lm.utils import load_model
from pathlib import Path
what, build, student, tokens, out, batch = sys.argv[1:7]
batch = int(batch)
tokens = np.load(tokens)
base = rss()
if what == "teacher":
    teacher.run(build, tokens, out, batch=batch, progress=False)
elif what == "calibrate":
    calibrate.calibrate(student, build, out + "-teacher", tokens, out, batch=batch,
                        progress=False)
else:
    model = stream.load_lazy(build)
    mx.eval(model.parameters())
    for r in stream.batches(len(tokens), batch):
        mx.eval(model(mx.array(tokens[r])))
print(json.dumps({"baseline_rss": base, "peak_rss": peak_rss()}))
"""


def child(*args: str) -> dict:
    return membound.child_peak(_CHILD, *args)


# The process's own growth beyond MLX's arrays while streaming (allocator and Python heap
# not handed back to the OS, safetensors headers): ~40 MB measured on ``bench``.
FIXED_OVERHEAD = 64 * 1024 * 1024


def largest_layer_f32(config: dict) -> int:
    """The largest decoder layer as the stream holds it (quantized tensors as stored,
    floating tensors in float32) plus, while it loads, its floating tensors as stored
    (read, then cast)."""
    tc = layout.text_config(config)
    best = 0
    for i in range(tc["num_hidden_layers"]):
        n = 0
        for s in layout.layer_specs(tc, i):
            f32 = s.nbytes // DTYPE_BYTES[s.dtype] * 4
            n += s.nbytes if s.family == "experts" else f32 + s.nbytes
        best = max(best, n)
    return best


def kda_forward(tc: dict, tokens: int) -> int:
    """One KDA layer's prefill for ``tokens``: the graph holds one recurrent state per
    token (heads x head_dim^2 x 4 B) until it is evaluated."""
    la = tc["linear_attn_config"]
    return tokens * la["num_heads"] * la["head_dim"] ** 2 * 4


def kda_backward(tc: dict, tokens: int) -> int:
    """One KDA layer's backward for ``tokens``: 5 recurrent states per token (heads x
    head_dim^2 x 4 B; 4.4 measured on ``bench``, k3dist.pipeline.calibrate)."""
    la = tc["linear_attn_config"]
    return 5 * tokens * la["num_heads"] * la["head_dim"] ** 2 * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench", choices=sorted(synth.PRESETS))
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="windows per forward/backward call")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = synth.synthesize(tmp / "src", a.preset, progress=False)
        build = convert.convert(src, tmp / "build", progress=False)
        config = load_config(build)
        tc = layout.text_config(config)
        moe = layout.moe_layers(tc)
        student = promote.grade(
            build, tmp / "2bit", {i: [] for i in moe}, 1, "2bit-g64", progress=False
        )
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, tc["vocab_size"], size=(a.windows, a.seq)).astype(np.int32)
        np.save(tmp / "tokens.npy", tokens)
        args = (str(build), str(student), str(tmp / "tokens.npy"))
        whole = child("whole", *args, str(tmp / "w"), str(a.batch))
        t = child("teacher", *args, str(tmp / "c-teacher"), str(a.batch))
        c = child("calibrate", *args, str(tmp / "c"), str(a.batch))
        model_bytes = sum(f.stat().st_size for f in build.glob("*.safetensors"))
    states = stream.state_bytes(tc, tokens.size)
    layer = largest_layer_f32(config)
    batch_tokens = a.batch * a.seq
    logits = batch_tokens * tc["vocab_size"] * 4 * 2  # one batch's logits + log-probs
    backward = kda_backward(tc, batch_tokens)
    fwd = kda_forward(tc, batch_tokens)
    real = synth.real_config()
    rtc = layout.text_config(real)
    report = {
        "command": record.command_line(),
        "preset": a.preset,
        "tokens": int(tokens.size),
        "model_bytes": model_bytes,
        "largest_layer_bytes_f32": layer,
        "state_bytes": states,
        "whole_model": whole,
        "fixed_overhead": FIXED_OVERHEAD,
        "teacher": {
            **t,
            "bound": FIXED_OVERHEAD + states + layer + logits + fwd,
            "kda_forward_bytes": fwd,
            "within_bound": t["over_baseline"] <= FIXED_OVERHEAD + states + layer + logits + fwd,
        },
        "calibrate": {
            **c,
            "bound": FIXED_OVERHEAD + 2 * states + 2 * layer + logits + backward,
            "kda_backward_bytes": backward,
            "within_bound": c["over_baseline"]
            <= FIXED_OVERHEAD + 2 * states + 2 * layer + logits + backward,
        },
        "real_k3": {
            "state_bytes_per_token": stream.state_bytes(rtc, 1),
            "states_4096_tokens": stream.state_bytes(rtc, 4096),
            "largest_layer_bytes_f32": largest_layer_f32(real),
            "kda_forward_bytes_per_token": kda_forward(rtc, 1),
            "kda_backward_bytes_per_token": kda_backward(rtc, 1),
        },
    }
    record.emit(report, a.out)


if __name__ == "__main__":
    main()
