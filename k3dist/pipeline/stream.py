"""A build run over a token set one decoder layer at a time, in bounded memory.

The streamed teacher (``k3dist.pipeline.teacher``), calibration (``k3dist.pipeline.calibrate``)
and evaluation run every model through this: the model is loaded lazily (mlx-lm's
``load_model(lazy=True)``, or a view's model with unevaluated stand-ins: nothing is read
until used), each layer's weights are read when the whole token set first reaches it and
released (swapped for NaN stand-ins, read again at a next use) once it has passed, so a
real K3 layer (~17 GB of MXFP4 experts) is the weight working set, never the model.

Between layers the token set is described completely by a :class:`State`: the hidden
state ``h`` and K3's Attention Residuals block stack (``raw``, one entry per finished
block, with its inverse RMS): running layer by layer from a state equals the full
forward (``tests/pipeline/test_stream.py``: bitwise on CPU, float32).

Memory bound: the states of the whole token set, ``tokens x hidden x (blocks + 1) x 4``
bytes at the deepest layer (float32; enforced: :func:`check_cap` refuses a token set over
``--cap``), plus one layer's weights (as read, and floating tensors cast to float32) and
one batch's activations, of which a KDA layer's prefill is the largest: one recurrent
state per token until evaluated (heads x head_dim^2 x 4 B). Real K3 (hidden 7168, 8
AttnRes blocks, 96 KDA heads of 128): states 258 KB per token (1.06 GB for 4,096 tokens),
the largest layer ~19.5 GB, KDA prefill 6.3 MB per token (1.6 GB for a 256-token window):
~23 GB for 16 windows at ``--window-batch 1``, where the whole model is 1.56 TB.
``benchmarks/memory/stream_memory.py`` measures it on the ``bench`` preset.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from k3dist.config.deployment import add_renamed_flag
from k3dist.format import layout
from k3dist.format.folder import INDEX_NAME
from k3dist.format.kvmemory import GiB
from k3dist.model import compat
from k3dist.pipeline.view import BuildFolder, load_lazy  # noqa: F401 (load_lazy: users)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import kimi_k3
from mlx_lm.models.base import create_attention_mask, create_ssm_mask


class StreamError(ValueError):
    pass


_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def add_window_batch(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    """``--window-batch N``: calibration windows a call (a step) takes together (the
    requests a server decodes together are ``--max-batch``); ``--batch`` still read."""
    add_renamed_flag(
        parser, "--batch", "--window-batch", dest="batch", type=int, default=default, help=help
    )


def parse_bytes(s: str) -> int:
    """``2GiB``, ``500MB``, ``1.5e9`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]i?)?b?\s*", s.lower())
    if not m:
        raise StreamError(f"{s!r}: not a size; write e.g. 2GiB, 500MB or 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@dataclass
class State:
    """Everything a decoder layer needs about a batch of windows (float32)."""

    h: mx.array  # [B, L, D]
    raw: mx.array | None = None  # [blocks, B, L, D]: AttnRes block stack
    inv_rms: mx.array | None = None  # [blocks, B, L]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.h, self.raw, self.inv_rms) if a is not None)

    def arrays(self) -> dict[str, mx.array]:
        out = {"h": self.h}
        if self.raw is not None:
            out |= {"raw": self.raw, "inv_rms": self.inv_rms}
        return out

    @classmethod
    def from_arrays(cls, d: dict[str, mx.array]) -> State:
        return cls(d["h"], d.get("raw"), d.get("inv_rms"))


def blocks_before(tc: dict, layer: int) -> int:
    """AttnRes block-stack depth at the input of ``layer`` (0-based)."""
    size = tc.get("attn_res_block_size")
    return 0 if not size else math.ceil(layer / size)


def state_bytes(tc: dict, tokens: int) -> int:
    """Bytes of the states of ``tokens`` at the deepest point (float32): hidden state +
    block stack + its inverse RMS."""
    depth = blocks_before(tc, tc["num_hidden_layers"])
    return tokens * (tc["hidden_size"] * 4 * (depth + 1) + 4 * depth)


def inv_rms(raw: mx.array | None, eps: float) -> mx.array | None:
    """The block stack's inverse RMS (what kimi_k3's ResidualBlocks keeps beside it),
    recomputed from the stack: differentiable through ``raw``."""
    if raw is None:
        return None
    x = raw.astype(mx.float32)
    return mx.rsqrt((x * x).mean(axis=-1) + eps)


def check_cap(tc: dict, tokens: int, cap: int, copies: int = 1, what: str = "states") -> int:
    """The bound for ``tokens`` (``copies`` state sets: 2 when cotangents are held
    too); raises with the numbers and the fix when over ``cap``."""
    need = copies * state_bytes(tc, tokens)
    if need > cap:
        per = copies * state_bytes(tc, 1)
        raise StreamError(
            f"{tokens:,} tokens need {need / GiB:.2f} GiB of {what} "
            f"({per:,} bytes per token x {copies}) over the cap of {cap / GiB:.2f} GiB; "
            f"use at most {cap // per:,} tokens or raise --cap"
        )
    return need


class LayerStream:
    """One build, loaded lazily, run a layer at a time (module doc)."""

    def __init__(self, build, dtype: str = "float32"):
        """``build``: a build folder, or a view of one (``k3dist.pipeline.view``: the
        source read as its MXFP4 base build, a uniform lo-bank student in memory)."""
        if isinstance(build, (str, Path)):
            index = Path(build) / INDEX_NAME
            if not index.exists():
                raise StreamError(
                    f"{index}: missing; stream a k3dist build (k3dist.pipeline.convert)"
                )
            build = BuildFolder(build)
        self.build = build
        self.path = build.path
        self.config = build.config
        self.tc = layout.text_config(self.config)
        self.weight_map: dict[str, str] = build.index
        # weights are read when a module is first used (``_load``), not here: a view
        # makes its arrays a unit at a time (~0.2 s a K3 layer), once per use
        self.model = build.model(dtype, weights=False)
        self.text = self.model.language_model.model
        self.args: kimi_k3.TextArgs = self.text.args
        self.num_layers = len(self.text.layers)
        self._loaded: set[str] = set()
        # NaN from the start, as after a release: a use that skipped _load shows
        for i in range(self.num_layers):
            self.release_layer(i)
        self.release(self.text.embed_tokens, "language_model.model.embed_tokens.")
        self.release_head()

    # -- weights ------------------------------------------------------------------
    def _load(self, module: nn.Module, prefix: str) -> nn.Module:
        """``module`` with the build's weights (a view reads them now, a folder lazily)."""
        self._load_all([(module, prefix)])
        return module

    def _load_all(self, pairs: list[tuple[nn.Module, str]]) -> None:
        """Each (module, prefix) not yet loaded, from one ``arrays`` call: the head's
        modules share a unit, which a view would otherwise read once a module."""
        todo = [(m, p) for m, p in pairs if p not in self._loaded]
        if not todo:
            return
        arrays = self.build.arrays(tuple(p for _, p in todo))
        for module, prefix in todo:
            current = dict(_flatten(module.parameters()))
            fresh = []
            for n, a in arrays.items():
                key = n[len(prefix) :]
                if n.startswith(prefix) and key in current:
                    fresh.append((key, a.astype(current[key].dtype)))
            module.load_weights(fresh, strict=False)
            self._loaded.add(prefix)

    def layer(self, i: int) -> nn.Module:
        """Decoder layer ``i``, its weights the build's."""
        return self._load(self.text.layers[i], f"language_model.model.layers.{i}.")

    def release(self, module: nn.Module, prefix: str) -> None:
        """Swap ``module``'s (evaluated) weights for stand-ins: the memory goes back,
        and the next use reads them again. Floating stand-ins are NaN, so a use that
        skipped ``_load`` cannot pass for a right answer; nothing is read or allocated
        until that next use."""
        stand_in = [
            (
                k,
                mx.full(a.shape, math.nan, a.dtype)
                if mx.issubdtype(a.dtype, mx.floating)
                else mx.zeros(a.shape, a.dtype),
            )
            for k, a in _flatten(module.parameters())
        ]
        module.load_weights(stand_in, strict=False)
        self._loaded.discard(prefix)

    def release_layer(self, i: int) -> None:
        self.release(self.text.layers[i], f"language_model.model.layers.{i}.")

    def _head_modules(self) -> Iterator[tuple[nn.Module, str]]:
        """What ``head`` uses: the embedding only when it is the output projection."""
        tied = self.model.language_model.lm_head is None
        for name in ("embed_tokens", "norm", "output_attn_res_norm", "output_attn_res_proj"):
            m = getattr(self.text, name, None)
            if m is not None and (name != "embed_tokens" or tied):
                yield m, f"language_model.model.{name}."
        if not tied:
            yield self.model.language_model.lm_head, "language_model.lm_head."

    # -- running ------------------------------------------------------------------
    def embed(self, tokens: mx.array) -> State:
        emb = self._load(self.text.embed_tokens, "language_model.model.embed_tokens.")
        return State(emb(tokens).astype(mx.float32))

    def run_layer(self, i: int, s: State) -> State:
        layer = self.layer(i)
        blocks = None
        if self.text.use_attn_res:
            blocks = kimi_k3.ResidualBlocks(self.args.rms_norm_eps)
            blocks.raw, blocks.inv_rms = s.raw, s.inv_rms
        if layer.is_linear:
            mask = create_ssm_mask(s.h, None)
        else:
            mask = create_attention_mask(s.h, None, return_array=True)
        h, blocks = layer(s.h, mask=mask, cache=None, blocks=blocks)
        if blocks is None:
            return State(h)
        return State(h, blocks.raw, blocks.inv_rms)

    def head(self, s: State) -> mx.array:
        """Logits [B, L, V] from the state after the last layer."""
        self._load_all(list(self._head_modules()))
        t = self.text
        h = s.h
        if t.use_attn_res:
            w = t.output_attn_res_norm.weight.astype(mx.float32) * (
                t.output_attn_res_proj.weight.reshape(-1)
            )
            blocks = kimi_k3.ResidualBlocks(self.args.rms_norm_eps)
            blocks.raw, blocks.inv_rms = s.raw, s.inv_rms
            h = compat.attn_res_mix(blocks, h, w, self.args.rms_norm_eps)
        h = t.norm(h)
        lm = self.model.language_model
        return t.embed_tokens.as_linear(h) if lm.lm_head is None else lm.lm_head(h)

    def release_head(self) -> None:
        for m, prefix in self._head_modules():
            self.release(m, prefix)


def _flatten(tree, prefix: str = "") -> Iterator[tuple[str, mx.array]]:
    if isinstance(tree, mx.array):
        yield prefix[:-1], tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for k, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{k}.")


def batches(n: int, batch: int) -> list[slice]:
    return [slice(i, min(n, i + batch)) for i in range(0, n, batch)]


def forward(
    stream: LayerStream,
    tokens: np.ndarray,
    *,
    batch: int = 4,
    cap: int = 2 * GiB,
    start: tuple[int, list[State]] | None = None,
    on_state: Callable[[int, list[State]], None] | None = None,
    on_layer: Callable[[int, int, State], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Iterator[tuple[slice, mx.array]]:
    """Logits of ``tokens`` [N, L], one batch of windows at a time (``(rows, logits)``),
    after every window has gone through every layer. ``start`` resumes from saved
    states at a layer's input; ``on_state(i, states)`` sees the states at each layer's
    input (the teacher saves block boundaries there); ``on_layer(i, b, out)`` sees each
    batch's output of layer ``i`` (weights still loaded)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise StreamError(f"tokens must be [windows, seq], not {list(tokens.shape)}")
    check_cap(stream.tc, tokens.size, cap)
    rows = batches(tokens.shape[0], batch)
    if start is None:
        first = 0
        states = []
        for r in rows:
            s = stream.embed(mx.array(tokens[r]))
            mx.eval(s.arrays())
            states.append(s)
        stream.release(stream.text.embed_tokens, "language_model.model.embed_tokens.")
    else:
        first, states = start
    for i in range(first, stream.num_layers):
        if on_state is not None:
            on_state(i, states)
        for b, s in enumerate(states):
            out = stream.run_layer(i, s)
            mx.eval(out.arrays())
            if on_layer is not None:
                on_layer(i, b, out)
            states[b] = out
        stream.release_layer(i)
        mx.clear_cache()
        if progress is not None:
            progress(f"layer {i + 1}/{stream.num_layers}")
    if on_state is not None:
        on_state(stream.num_layers, states)
    for b, (r, s) in enumerate(zip(rows, states, strict=True)):
        logits = stream.head(s)
        mx.eval(logits)
        states[b] = None  # the state is done with: keep only this batch's logits
        yield r, logits
    stream.release_head()
    mx.clear_cache()
