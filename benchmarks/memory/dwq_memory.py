"""Peak RSS of block-aligned DWQ on the ``bench`` preset (128 experts a layer, 2-bit g64
lo bank): the expert gradient in chunks vs one plain ``mx.grad`` over the stack, and the
whole model in memory for scale; plus the bound for real K3.

    python benchmarks/memory/dwq_memory.py --out results.json

Each run is a child process (Linux VmHWM minus the RSS after imports): the streamed
teacher on ``--windows`` random windows, then ``k3dist.pipeline.dwq`` for ``--steps`` steps
a block with ``--chunk`` 0 (plain) and 16. Prints JSON with its command.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from k3dist.bench import membound, record
from k3dist.factory import synth
from k3dist.format import layout
from k3dist.format.folder import load_config
from k3dist.format.qformat import QFormat
from k3dist.pipeline import convert, promote, stream, teacher

import numpy as np

_CHILD = """
import json, sys
import numpy as np
from k3dist.pipeline.rss import peak_rss, rss
from k3dist.pipeline import dwq
build, student, t, tokens, out, chunk, steps = sys.argv[1:8]
tokens = np.load(tokens)
base = rss()
cfg = dwq.DWQConfig(steps=int(steps), batch=1, valid_windows=1, eval_every=int(steps),
                    chunk=int(chunk))
dwq.dwq(t, student, tokens, out, cfg, progress=False)
print(json.dumps({"baseline_rss": base, "peak_rss": peak_rss()}))
"""


def child(*args: str) -> dict:
    return membound.child_peak(_CHILD, *args)


def real_k3_bound(
    tokens_per_step: int = 256, chunk: int = 16, lo_format: str = "2bit-g64", state_bytes: int = 4
) -> dict:
    """The parts of a DWQ step's peak on real K3 (one 12-layer block, 2-bit g64 lo bank,
    non-expert weights in float32, float32 scales/biases with Adam m and v and a best copy,
    one chunk of expert gradients (benchmarks/memory/expert_grad_memory.py's fit: 8.42 x chunk x
    out x in x 4 B + the returned float32 scales/biases), the block backward's activations
    (KDA: 5 recurrent states per token and layer, k3dist.pipeline.calibrate), 3 state sets.
    ``lo_format``: the lo bank (g128 halves every scale/bias term); ``state_bytes``: bytes
    per element of Adam's m and v and the best copy (2: bf16, 4: float32)."""
    cfg = synth.real_config()
    tc = layout.text_config(cfg)
    lo = QFormat.parse(lo_format)
    E, D, F = tc["num_experts"], tc["routed_expert_hidden_size"], tc["moe_intermediate_size"]
    layer_params = 3 * E * D * F
    experts = int(layer_params * lo.bpw / 8)
    sb = layer_params // lo.group_size * 2 * 4  # float32 scales + biases
    dense = sum(s.nbytes for s in layout.layer_specs(tc, 12) if s.family != "experts") * 2
    la = tc["linear_attn_config"]
    kda = 5 * la["num_heads"] * la["head_dim"] ** 2 * 4
    block = tc["attn_res_block_size"]
    kda_layers = block * 3 // 4
    parts = {
        "student_block_weights": block * (experts - sb // 2 + sb + dense),
        "adam_and_best_copy": block * 3 * sb * state_bytes // 4,
        "expert_grad_chunk": int(8.42 * chunk * F * D * 4) + sb,
        "block_backward_activations": tokens_per_step * kda * kda_layers,
        "states_3_sets_4096_tokens": 3 * stream.state_bytes(tc, 4096),
    }
    return {
        "tokens_per_step": tokens_per_step,
        "chunk": chunk,
        "lo": lo.name,
        "state_bytes": state_bytes,
        "parts": parts,
        "total": sum(parts.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument(
        "--bound-only",
        action="store_true",
        help="only the real-K3 bounds (2-bit g64 / g128 lo, float32 / bf16 Adam "
        "state): arithmetic, no run",
    )
    a = ap.parse_args()
    bounds = {
        f"{lo}-{'bf16' if sb == 2 else 'f32'}-state": real_k3_bound(lo_format=lo, state_bytes=sb)
        for lo in ("2bit-g64", "2bit-g128")
        for sb in (4, 2)
    }
    if a.bound_only:
        record.emit({"command": record.command_line(), "real_k3_bounds": bounds}, a.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = synth.synthesize(tmp / "src", "bench", progress=False)
        build = convert.convert(src, tmp / "build", progress=False)
        tc = layout.text_config(load_config(build))
        student = promote.grade(
            build,
            tmp / "2bit",
            {i: [] for i in layout.moe_layers(tc)},
            1,
            "2bit-g64",
            progress=False,
        )
        tokens = np.random.default_rng(0).integers(0, tc["vocab_size"], size=(a.windows, a.seq))
        np.save(tmp / "tokens.npy", tokens.astype(np.int32))
        t = teacher.run(build, tokens.astype(np.int32), tmp / "teacher", batch=1, progress=False)
        runs = {}
        for chunk in (0, 16):
            runs["plain" if chunk == 0 else f"chunk-{chunk}"] = child(
                str(build),
                str(student),
                str(t),
                str(tmp / "tokens.npy"),
                str(tmp / f"dwq-{chunk}"),
                str(chunk),
                str(a.steps),
            )
        model_bytes = sum(f.stat().st_size for f in build.glob("*.safetensors"))
    report = {
        "command": record.command_line(),
        "preset": "bench",
        "windows": a.windows,
        "seq": a.seq,
        "steps_per_block": a.steps,
        "model_bytes": model_bytes,
        "runs": runs,
        "real_k3_bound": real_k3_bound(),
        "real_k3_bounds": bounds,
    }
    record.emit(report, a.out)


if __name__ == "__main__":
    main()
