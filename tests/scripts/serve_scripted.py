"""launch/serve.py with scripted token choice (tests only): the 2-rank server runs the
real model on every rank, in lockstep, but a logits processor forces each token, so
the mini (random weights) answers as an agent's model would: a short answer that ends
its message, or, when the user's turn says CALL_TOOL, a K3 tool call from
``--tool-calls FILE`` (JSON: tool name -> K3's call text; the first tool the request
declares), then a short answer once the tool's result is in the prompt. Every rank
forces the same tokens (chosen from the request's prompt only), so the ranks stay in
lockstep as with sampled tokens. With ``--prompt-log FILE``, rank 0 appends each request's
prompt text there (the tests read what reached the model). Every other argument is
launch/serve.py's.

    mlx.launch -n 2 tests/scripts/serve_scripted.py --tool-calls calls.json \
        --rank-dir 'runs/mini-ranks/rank{rank}' --no-warmup
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import sys
from pathlib import Path

import k3dist  # noqa: F401  (OpenBLAS preload before mlx)

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.utils import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
ANSWER = "Hi."
THOUGHT = "Ok."
END = "<|close|>response<|sep|><|close|>message<|sep|>"
THINK_OPEN = "<|open|>think<|sep|>"


def _rank_dir() -> str:
    pattern = sys.argv[sys.argv.index("--rank-dir") + 1]
    return pattern.format(rank=int(os.environ.get("MLX_RANK", "0")))


# The latest request's GenerationContext (its whole prompt: the tokens a logits processor
# sees leave out what the prompt cache held). With --max-batch 1 a request's processors
# are made right after its context, on every rank.
LAST: list = [None]


@dataclasses.dataclass
class _Context(mlx_server.GenerationContext):
    def __post_init__(self):
        LAST[0] = self


class Script:
    """Forces one request's tokens, chosen from its prompt's text."""

    def __init__(self, tok, calls: dict[str, str], log: Path | None):
        self.tok, self.calls, self.log, self.step = tok, calls, log, 0
        self.ids = self._choose(LAST[0].prompt)

    def _choose(self, tokens) -> list[int]:
        text = self.tok.decode(list(tokens))
        if self.log and os.environ.get("MLX_RANK", "0") == "0":
            with open(self.log, "a") as f:
                f.write(text + "\n<|end of prompt|>\n")
        head = (
            f"{THOUGHT}<|close|>think<|sep|><|open|>response<|sep|>"
            if text.endswith(THINK_OPEN)
            else ""
        )
        call = next((c for name, c in self.calls.items() if f'"{name}"' in text), None)
        if call and "CALL_TOOL" in text and 'role="tool"' not in text:
            body = (
                "<|close|>response<|sep|><|open|>tools<|sep|>"
                + call
                + "<|close|>tools<|sep|><|close|>message<|sep|>"
            )
        else:
            body = ANSWER + END
        return self.tok.encode(head + body, add_special_tokens=False) + [
            min(self.tok.eos_token_ids)
        ]

    def __call__(self, tokens, logits):
        t = self.ids[min(self.step, len(self.ids) - 1)]
        self.step += 1
        keep = mx.arange(logits.shape[-1]) == t
        return mx.where(keep, mx.zeros_like(logits), mx.full(logits.shape, -1e9, logits.dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--tool-calls", type=Path, help="JSON file: tool name -> K3's call text")
    ap.add_argument("--prompt-log", type=Path, help="rank 0 appends each prompt's text here")
    mine, rest = ap.parse_known_args()
    calls = json.loads(mine.tool_calls.read_text()) if mine.tool_calls else {}
    sys.argv[1:] = rest  # launch/serve.py parses the rest
    tok = load_tokenizer(Path(_rank_dir()))
    made = mlx_server._make_logits_processors
    mlx_server.GenerationContext = _Context
    script = (tok, calls, mine.prompt_log)
    mlx_server._make_logits_processors = lambda args: [*made(args), Script(*script)]
    sys.argv[0] = str(REPO / "launch/serve.py")
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
