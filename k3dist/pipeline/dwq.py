"""Block-aligned layerwise DWQ: distil a low-bit build's affine scales and biases against
the MXFP4 teacher, one AttnRes block at a time, in bounded memory.

K3's Attention Residuals make (hidden state, block stack) the complete input of a block,
so each block trains alone: its input is the student's own propagated state (``--input
student``, default: what the block sees at run time) or the teacher's (``teacher``),
its target the teacher's state at the block's output (both from the streamed teacher,
``k3dist.pipeline.teacher``, on the calibration token set). Loss: normalised MSE
``|h_s - h_t|^2 / |h_t|^2`` of the block's output hidden state (the next block pushes it
onto the AttnRes stack, so it is also the pushed residual); for the last block the KL of
the head's log-probabilities to the teacher's.

Trained: the float32 master copies of the ``scales`` and ``biases`` of the block's affine
tensors below 8 bits (mlx-lm's DWQ rule): the lo-bank experts (``mlp.switch_mlp``) and
any quantized non-expert tensors. Frozen byte for byte: MXFP4 hi-bank experts, routers,
norms, bf16 tensors. The lo bank's gradient is computed a chunk of experts at a time
(``k3dist.pipeline.expert_grad.bank_grads``: never a dense ``(E, out, in)`` gradient of the
stack) from ``g``, the loss gradient at the MoE layer's routed sum (a zero probe added
there). Adam; ``--valid-windows`` windows spread evenly over the token set are held out
and scored every ``--eval-every`` steps: a worse score restores the best parameters and
halves the learning rate. ``--state bf16`` keeps Adam's moments and the best copy in
bfloat16 (the update itself in float32; the build writes the trained tensors in bf16, so
the best copy loses nothing that the output keeps): a third of the trainable tensors'
float32 footprint instead of three times it.

Memory: one student block (weights in float32 where floating, the Adam moments and the
best-so-far copy of its trainable tensors), the token set's states three times (teacher
input and output, student input: ``stream.check_cap`` with 3 copies), one batch's block
backward and one chunk of expert gradients (``benchmarks/memory/dwq_memory.py`` measures it on
``bench`` and prints the real-K3 bound: a 12-layer block, 2-bit g64 lo bank).

Output: a normal build (the student's files, trained tensors rewritten in bf16), resumable
by block (a journal per block's files plus the propagated student state), its manifest
recording the run (token hash, steps, lr, per-block validation before/after).

Or, with ``ranks`` (the pipeline's ``--dwq``), no build: the student is the graded build
that went straight into those rank folders (``k3dist.pipeline.direct``), read as a
``student.GradedView`` of the source (``graded_view``: its graded map from the folders'
config), and each block's files are rewritten in every rank folder in place
(``slicing.BuildSlicer.reslice``: the trained tensors' parts from the new bytes, every
other tensor's part copied from the file as it is, one file of one rank at a time; the
other files kept), each rank folder's manifest becoming a journal of the DWQ build first
and the DWQ build's manifest last. ``out`` is then scratch: the journal of blocks, the
propagated state, and the DWQ build's small files the slicers read (``out/build``). The
rank folders are the ones slicing the written DWQ build gives (``tests/pipeline/test_dwq.py``:
every file's sha256), and resume like it. Disk: the rank folders, one rank file being
rewritten, the state.

    python -m k3dist.pipeline.dwq --teacher-build runs/mxfp4 --teacher runs/teacher \\
        --student runs/graded --tokens calib.npz --out runs/graded-dwq
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from k3dist import __version__
from k3dist.format.folder import INDEX_NAME, load_config
from k3dist.format.graded import GradedMap
from k3dist.format.journal import JournaledFolder, write_json_atomic
from k3dist.format.kvmemory import GiB
from k3dist.format.manifest import JOURNAL, MANIFEST
from k3dist.format.placement import Placement
from k3dist.format.sfile import (
    CheckpointError,
    StreamWriter,
    iter_chunks,
    mx_dtype,
    mx_to_bytes,
    read_header,
    sha256_file,
)
from k3dist.pipeline import stream
from k3dist.pipeline.adam import Adam
from k3dist.pipeline.calibrate import RoutedProbe, kl_sum
from k3dist.pipeline.rss import peak_rss
from k3dist.pipeline.teacher import TeacherOutput, read_tokens
from k3dist.pipeline.view import small_files

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm


@dataclass
class DWQConfig:
    steps: int = 60  # per block
    lr: float = 1e-3  # Adam, on float32 scales/biases
    batch: int = 2  # windows per step
    valid_windows: int = 2  # held out, spread evenly over the token set
    eval_every: int = 10
    input: str = "student"  # "student" | "teacher": the block's input state
    chunk: int = 64  # experts per gradient chunk (0: one mx.grad over the stack, reference)
    seed: int = 0
    state: str = "float32"  # "float32" | "bf16": Adam's m and v and the best-so-far copy


def trainable(module: nn.Module) -> dict[str, mx.array]:
    """Flattened ``scales``/``biases`` of every affine quantized tensor below 8 bits
    (mlx-lm's DWQ rule) in ``module``: name -> array."""
    out = {}
    for name, m in module.named_modules():
        if getattr(m, "mode", None) == "affine" and getattr(m, "bits", 8) < 8 and "scales" in m:
            prefix = f"{name}." if name else ""
            out[f"{prefix}scales"] = m["scales"]
            out[f"{prefix}biases"] = m["biases"]
    return out


def _cat(states: list[stream.State]) -> stream.State:
    h = mx.concatenate([s.h for s in states])
    if states[0].raw is None:
        return stream.State(h)
    return stream.State(
        h,
        mx.concatenate([s.raw for s in states], axis=1),
        mx.concatenate([s.inv_rms for s in states], axis=1),
    )


def _rows(s: stream.State, idx: np.ndarray) -> stream.State:
    i = mx.array(idx)
    if s.raw is None:
        return stream.State(s.h[i])
    return stream.State(s.h[i], s.raw[:, i], s.inv_rms[:, i])


class DWQ:
    def __init__(
        self,
        teacher: str | Path,
        student: str | Path,
        tokens: np.ndarray,
        out: str | Path,
        cfg: DWQConfig | None = None,
        *,
        cap: int = 2 * GiB,
        progress: bool = True,
        ranks: list[str | Path] | None = None,
        placement: Placement | None = None,
    ):
        """``student``: a low-bit build folder, or a view of one (``student.GradedView``);
        ``ranks``: rewrite these rank folders of the student instead of writing a build
        to ``out`` (module doc), placed as ``placement`` (the one they were sliced with:
        a plan's for boxes of different memory; None: ``placement_for``'s)."""
        self.cfg = cfg or DWQConfig()
        if self.cfg.input not in ("student", "teacher"):
            raise ValueError(f"--input {self.cfg.input!r}: student or teacher")
        if self.cfg.state not in STATE_DTYPES:
            raise ValueError(f"--state {self.cfg.state!r}: one of {sorted(STATE_DTYPES)}")
        self.t0 = time.perf_counter()
        self.progress = progress
        self.view = None if isinstance(student, (str, Path)) else student
        self.student = Path(student) if self.view is None else Path(str(self.view.path))
        self.ranks = None if ranks is None else [Path(r) for r in ranks]
        self.placement = placement
        if self.ranks is not None and self.view is None:
            raise ValueError("DWQ into rank folders reads its student as a view (graded_view)")
        self.out = Path(out)
        self.S = stream.LayerStream(student)
        if GradedMap.from_config(self.S.config) is None:
            raise CheckpointError(
                f"{student}: DWQ trains a low-bit build's affine scales; this is an MXFP4 "
                "build (make one: python -m k3dist.pipeline.convert --profile 2bit|graded)"
            )
        self.teacher = TeacherOutput(teacher)
        ident = self.teacher.manifest["identity"]
        if ident["shape"] != list(tokens.shape):
            raise CheckpointError(
                f"{teacher}: the teacher ran {ident['shape']} tokens, DWQ got "
                f"{list(tokens.shape)}; run both on the same token set"
            )
        self.tokens = tokens
        n = tokens.shape[0]
        if not 0 < self.cfg.valid_windows < n:
            raise ValueError(f"--valid-windows {self.cfg.valid_windows}: 1..{n - 1} of {n}")
        # held out: windows spread evenly over the set (token sets list domains in turn)
        self.valid_idx = np.unique(
            np.linspace(0, n - 1, self.cfg.valid_windows).round().astype(int)
        )
        self.train_idx = np.setdiff1d(np.arange(n), self.valid_idx)
        stream.check_cap(self.S.tc, tokens.size, cap, copies=3, what="teacher + student states")
        self.cap = cap
        size = self.S.tc.get("attn_res_block_size") or self.S.num_layers
        self.starts = list(range(0, self.S.num_layers, size))
        self.ends = [*self.starts[1:], self.S.num_layers]
        self.moe = [i for i, layer in enumerate(self.S.text.layers) if hasattr(layer.mlp, "_route")]
        self.hooks = {i: RoutedProbe(self.S.text.layers[i].mlp) for i in self.moe}
        self.eps = self.S.args.rms_norm_eps
        self.report: list[dict] = []

    def say(self, what: str) -> None:
        if self.progress:
            print(
                f"[{time.perf_counter() - self.t0:7.1f} s] dwq {what}", file=sys.stderr, flush=True
            )

    # -- data ----------------------------------------------------------------------
    def teacher_states(self, layer: int) -> stream.State:
        return _cat(self.teacher.states(layer))

    def teacher_logp(self) -> tuple[mx.array | None, mx.array]:
        parts = [self.teacher.logits(b) for b in range(len(self.teacher.manifest["batches"]))]
        ids = None if parts[0][0] is None else mx.concatenate([p[0] for p in parts])
        return ids, mx.concatenate([p[1] for p in parts])

    # -- one block -------------------------------------------------------------------
    def _run(self, a: int, c: int, s: stream.State) -> stream.State:
        s = stream.State(s.h, s.raw, stream.inv_rms(s.raw, self.eps))
        for i in range(a, c):
            s = self.S.run_layer(i, s)
        return s

    def _loss(self, a: int, c: int, s_in: stream.State, target) -> mx.array:
        out = self._run(a, c, s_in)
        if c == self.S.num_layers:
            ids, logp = target
            return kl_sum(ids, logp, self.S.head(out)) / out.h.shape[0] / out.h.shape[1]
        d = out.h - target.h
        return (d * d).sum() / (target.h * target.h).sum()

    def _target(self, c: int, t_out, idx: np.ndarray):
        if c == self.S.num_layers:
            ids, logp = t_out
            i = mx.array(idx)
            return (None if ids is None else ids[i], logp[i])
        return _rows(t_out, idx)

    def _evaluate(self, a, c, s_in, t_out, idx) -> float:
        total = 0.0
        for j in range(0, len(idx), self.cfg.batch):
            part = idx[j : j + self.cfg.batch]
            loss = self._loss(a, c, _rows(s_in, part), self._target(c, t_out, part))
            total += loss.item() * len(part)
        return total / len(idx)

    def _step_grads(self, a, c, params, s_in, target) -> tuple[float, dict[str, mx.array]]:
        from k3dist.pipeline.expert_grad import bank_grads, plain_grads

        block = [self.S.layer(i) for i in range(a, c)]
        moe = [i for i in range(a, c) if i in self.hooks]
        latent = self.S.args.routed_expert_hidden_size or self.S.args.hidden_size
        probes = [mx.zeros((*s_in.h.shape[:-1], latent)) for _ in moe]
        dense_names = [n for n in params if ".switch_mlp." not in n]

        def f(dense, probes):
            _set(block, dense)
            for i, p in zip(moe, probes, strict=True):
                self.hooks[i].probe = p
            return self._loss(a, c, s_in, target)

        dense = {n: params[n] for n in dense_names}
        loss, (g_dense, g_probes) = mx.value_and_grad(f, argnums=(0, 1))(dense, probes)
        mx.eval(loss, g_dense, g_probes)
        grads = dict(g_dense)
        for i, g in zip(moe, g_probes, strict=True):
            self.hooks[i].probe = None
            m = self.hooks[i].moe
            y, inds, w = self.hooks[i].seen
            _, _, taken, _ = m._select_hi(inds, w)
            lo = m._table[inds]
            ok = (lo >= 0) & ~taken
            weff = mx.where(ok, w, mx.zeros_like(w))
            args = (m.switch_mlp, y, mx.where(ok, lo, 0), weff, g)
            bg = bank_grads(*args, self.cfg.chunk) if self.cfg.chunk else plain_grads(*args)
            for k, v in bg.items():
                grads[f"{i - a}.mlp.switch_mlp.{k}"] = v
        return loss.item(), grads

    def train_block(self, a: int, c: int, s_in: stream.State, t_out) -> dict:
        block = [self.S.layer(i) for i in range(a, c)]
        params = {}
        for j, layer in enumerate(block):
            for n, v in trainable(layer).items():
                params[f"{j}.{n}"] = v
        mx.eval(params)
        entry = {"layers": [a, c - 1], "trainable": sum(v.size for v in params.values())}
        before = self._evaluate(a, c, s_in, t_out, self.valid_idx)
        entry["valid_before"] = round(before, 6)
        if not params:
            entry.update(valid_after=entry["valid_before"], steps=0, note="nothing to train")
            return entry
        keep = STATE_DTYPES[self.cfg.state]
        opt = Adam(dtype=keep)
        rng = np.random.default_rng([self.cfg.seed, a])  # per block: a resumed run redraws it
        best, best_params, lr = before, _copy(params, keep), self.cfg.lr
        losses = []
        for step in tqdm(
            range(self.cfg.steps),
            desc=f"dwq layers {a}..{c - 1}",
            disable=not self.progress,
            leave=False,
        ):
            part = rng.choice(
                self.train_idx, size=min(self.cfg.batch, len(self.train_idx)), replace=False
            )
            loss, grads = self._step_grads(
                a, c, params, _rows(s_in, part), self._target(c, t_out, part)
            )
            losses.append(loss)
            params = opt.update(params, grads, lr)
            _set(block, params)
            mx.eval(params)
            if (step + 1) % self.cfg.eval_every == 0 or step + 1 == self.cfg.steps:
                v = self._evaluate(a, c, s_in, t_out, self.valid_idx)
                if v < best:
                    best, best_params = v, _copy(params, keep)
                else:  # revert to the best and slow down
                    params, lr = _copy(best_params, mx.float32), lr / 2
                    _set(block, params)
        _set(block, _copy(best_params, mx.float32))
        entry.update(
            valid_after=round(best, 6),
            change=round(best / before - 1, 4) if before else None,
            steps=self.cfg.steps,
            train_loss_first=round(losses[0], 6),
            train_loss_last=round(losses[-1], 6),
            final_lr=lr,
        )
        return entry

    # -- whole build -------------------------------------------------------------------
    def _student_manifest(self) -> dict:
        if self.view is not None:
            return self.view.manifest
        return json.loads((self.student / MANIFEST).read_text())

    def _student_index(self) -> dict[str, str]:
        if self.view is not None:
            return self.view.index
        return json.loads((self.student / INDEX_NAME).read_text())["weight_map"]

    def run(self) -> Path:
        smf = self._student_manifest()
        ident = {
            "kind": "dwq",
            "from_build": smf.get("build_hash"),
            "teacher": self.teacher.manifest["identity"],
            "config": asdict(self.cfg),
        }
        folder = JournaledFolder(self.out, "build", ident)
        if folder.open():
            return self.out
        index = self._student_index()
        files = list(dict.fromkeys(index.values()))
        self.report = list(folder.journal.setdefault("blocks", []))
        write_json_atomic(self.out / JOURNAL, folder.journal)
        sink = None if self.ranks is None else _RankSink(self, ident)
        if sink is not None and sink.complete():
            return self.out  # every rank folder is this DWQ build's already
        s_in = None
        if self.cfg.input == "student" and self.report:
            last = self.ends[len(self.report) - 1]
            s_in = _cat(_load_states(self.out / f".dwq-states-L{last}.safetensors"))
        for b, (a, c) in enumerate(zip(self.starts, self.ends, strict=True)):
            block_files = sorted({index[n] for n in index if _layer_of(n) in range(a, c)})
            if b < len(self.report):
                continue  # done (its files and the propagated state are on disk)
            if s_in is None or self.cfg.input == "teacher":
                s_in = self.teacher_states(a)
            if c == self.S.num_layers:
                t_out = self.teacher_logp()
            else:
                t_out = self.teacher_states(c)
            entry = self.train_block(a, c, s_in, t_out)
            self.say(
                f"layers {a}..{c - 1}: valid {entry['valid_before']} -> {entry['valid_after']}"
            )
            for f in block_files:
                if sink is None:
                    folder.unit(f, lambda f=f, a=a, c=c: self._write_file(f, a, c))
                else:
                    sink.rewrite(f, self._trained_bytes(sink.header(f), a, c))
            if self.cfg.input == "student" and c < self.S.num_layers:
                s_in = self._propagate(a, c, s_in)
                mx.save_safetensors(
                    str(self.out / f".dwq-states-L{c}.safetensors"),
                    {f"{k}.0": v for k, v in s_in.arrays().items()},
                )
            for i in range(a, c):
                self.S.release_layer(i)
            mx.clear_cache()
            self.report.append(entry)
            folder.journal["blocks"] = self.report
            write_json_atomic(self.out / JOURNAL, folder.journal)
            if a > 0:  # a resume needs only the last block's output state
                (self.out / f".dwq-states-L{a}.safetensors").unlink(missing_ok=True)
        if sink is not None:
            sink.finish(files)
            return self._finish_scratch(folder, ident)
        for f in files:  # head, vision: copied
            folder.unit(f, lambda f=f: self._copy_file(f))
        write_json_atomic(
            self.out / INDEX_NAME, json.loads((self.student / INDEX_NAME).read_text())
        )
        small = small_files(self.student)
        for name in small:
            shutil.copyfile(self.student / name, self.out / name)
        for p in self.out.glob(".dwq-states-*"):
            p.unlink()
        out_files = {
            f: {"sha256": folder.done[f]["sha256"], "bytes": folder.done[f]["bytes"]} for f in files
        }
        for name in (*small, INDEX_NAME):
            out_files[name] = {
                "sha256": sha256_file(self.out / name),
                "bytes": (self.out / name).stat().st_size,
            }
        folder.finish(
            {
                "tool": f"k3dist {__version__}",
                "kind": "build",
                "identity": ident,
                "build_hash": _hash(ident),
                "from_build": str(self.student.resolve()),
                "profile": {**smf.get("profile", {}), "dwq": True},
                "plan": smf.get("plan"),
                "dwq": self._record(),
                "files": out_files,
                "seconds": round(time.perf_counter() - self.t0, 2),
            }
        )
        return self.out

    def _propagate(self, a: int, c: int, s_in: stream.State) -> stream.State:
        outs = []
        for j in range(0, s_in.h.shape[0], self.cfg.batch):
            o = self._run(a, c, _rows(s_in, np.arange(j, min(j + self.cfg.batch, s_in.h.shape[0]))))
            mx.eval(o.arrays())
            outs.append(o)
        return _cat(outs)

    def _trained(self, a: int, c: int) -> dict[str, mx.array]:
        """The block's trained tensors by their names in the build's files."""
        new = {}
        for i in range(a, c):
            for n, v in trainable(self.S.layer(i)).items():
                new[f"language_model.model.layers.{i}.{n}"] = v
        return new

    def _trained_bytes(self, h, a: int, c: int) -> dict[str, bytes]:
        """The trained tensors file ``h`` holds, as its bytes (in the file's dtype)."""
        return {
            n: mx_to_bytes(v.astype(mx_dtype(h.tensors[n].dtype)))
            for n, v in self._trained(a, c).items()
            if n in h.tensors
        }

    def _finish_scratch(self, folder: JournaledFolder, ident: dict) -> Path:
        """The scratch's manifest (``ranks``): the run's record; the state goes."""
        for p in self.out.glob(".dwq-states-*"):
            p.unlink()
        folder.finish(
            {
                "tool": f"k3dist {__version__}",
                "kind": "build",
                "identity": ident,
                "build_hash": _hash(ident),
                "ranks": [str(r.resolve()) for r in self.ranks],
                "dwq": self._record(),
                "files": {},
                "seconds": round(time.perf_counter() - self.t0, 2),
            }
        )
        return self.out

    def _record(self) -> dict:
        return {
            "tokens_sha256": self.teacher.manifest["identity"]["tokens_sha256"],
            "windows": {"train": len(self.train_idx), "valid": len(self.valid_idx)},
            "config": asdict(self.cfg),
            "blocks": self.report,
            "peak_rss": peak_rss(),
        }

    def _write_file(self, fname: str, a: int, c: int) -> dict:
        """The student's file with this block's trained tensors in the file's dtype."""
        h = read_header(self.student / fname)
        new = self._trained(a, c)
        entries = sorted(h.tensors.values(), key=lambda t: t.start)
        with StreamWriter(
            self.out / fname, [(t.name, t.dtype, t.shape) for t in entries], h.metadata or None
        ) as wr:
            for t in entries:
                if t.name in new:
                    wr.write(t.name, mx_to_bytes(new[t.name].astype(mx_dtype(t.dtype))))
                else:
                    wr.write(t.name, iter_chunks(t))
        return {"file": fname, "bytes": wr.size, "sha256": wr.sha256}

    def _copy_file(self, fname: str) -> dict:
        shutil.copyfile(self.student / fname, self.out / fname)
        p = self.out / fname
        return {"file": fname, "bytes": p.stat().st_size, "sha256": sha256_file(p)}


STATE_DTYPES = {"float32": mx.float32, "bf16": mx.bfloat16}


def _hash(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


class _RankSink:
    """Where DWQ's files go with ``ranks``: each rank folder of the student rewritten
    as the DWQ build (module doc). The DWQ build's small files (the student's, and a
    manifest naming the DWQ build) are written to ``out/build`` for the slicers."""

    def __init__(self, d: DWQ, ident: dict):
        from k3dist.pipeline import direct, promote, slicing

        view = d.view
        small = d.out / "build"
        gb = promote.GradedBuilder(view.base, small, view.gmap, view.lo)
        if gb.build_hash != view.manifest["build_hash"]:
            raise CheckpointError(f"{view}: not the graded build grade writes of its base")
        direct.write_small(gb)  # the student's small files, as its rank folders have them
        m = json.loads((small / MANIFEST).read_text())
        m |= {"identity": ident, "build_hash": _hash(ident), "from_build": gb.build_hash}
        m["direct"] = "DWQ: the student's rank folders rewritten in place"
        write_json_atomic(small / MANIFEST, m)
        self.files = direct.GradedFiles(gb)  # the build's headers (nothing is made)
        placement = d.placement or slicing.placement_for(small, len(d.ranks))
        self.slicers = [
            slicing.BuildSlicer(small, out, r, len(d.ranks), placement, tensors=self.files)
            for r, out in enumerate(d.ranks)
        ]
        self.student_hash = gb.build_hash
        self.todo = [s for s in self.slicers if not s.reopen(self.student_hash)]

    def complete(self) -> bool:
        return not self.todo

    def header(self, fname: str):
        return self.files.header(fname)

    def rewrite(self, fname: str, new: dict[str, bytes]) -> None:
        for s in self.todo:
            s.reslice(fname, new)

    def finish(self, files: list[str]) -> None:
        for s in self.todo:
            for f in files:
                if f in s.files:
                    s.keep(f)  # head, vision: unchanged
            s.finish()


def graded_view(base, ranks: list[str | Path]):
    """DWQ's student for ``ranks``: the graded build those rank folders were sliced from
    (``k3dist.pipeline.direct``), read from ``base`` (a ``view.SourceView``) with the graded
    map of their config (``student.GradedView``); refused when the folders are not a
    graded build of ``base``."""
    from k3dist.format.qformat import QFormat
    from k3dist.pipeline.student import GradedView

    config = load_config(ranks[0])
    gmap = GradedMap.from_config(config)
    if gmap is None:
        raise CheckpointError(
            f"{ranks[0]}: not a graded build's rank folder (no graded block in its config); "
            "DWQ trains a graded build's lo bank"
        )
    v = GradedView(base, gmap, QFormat.parse(gmap.lo))
    if v.config != config:
        raise CheckpointError(
            f"{ranks[0]}/config.json: not the graded build of {base} (its config differs "
            "from the one grading the base with its graded map gives); grade it again"
        )
    return v


def _copy(params: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    return {n: v.astype(dtype) for n, v in params.items()}


def _set(block: list[nn.Module], params: dict[str, mx.array]) -> None:
    """Put ``params`` (``"<layer offset>.<path>"``) into the block's layers."""
    per: dict[int, list] = {}
    for n, v in params.items():
        j, path = n.split(".", 1)
        per.setdefault(int(j), []).append((path, v))
    for j, items in per.items():
        block[j].load_weights(items, strict=False)


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return None


def _load_states(path: Path) -> list[stream.State]:
    d = mx.load(str(path))
    return [stream.State.from_arrays({k.split(".")[0]: v for k, v in d.items()})]


def dwq(teacher, student, tokens, out, cfg: DWQConfig | None = None, **kw) -> Path:
    """Distil ``student``'s low-bit scales/biases against the teacher's output (module
    doc); ``ranks=[...]``: into the student's rank folders."""
    return DWQ(teacher, student, tokens, out, cfg, **kw).run()


def main(argv: list[str] | None = None) -> None:
    d = DWQConfig()
    ap = argparse.ArgumentParser(
        description="Block-aligned DWQ of a low-bit build's "
        "scales and biases against the MXFP4 teacher."
    )
    # the teacher's output names its build: --teacher-build was never read
    ap.add_argument("--teacher-build", help=argparse.SUPPRESS)
    ap.add_argument("--teacher", required=True, help="python -m k3dist.pipeline.teacher output")
    ap.add_argument("--student", required=True, help="a low-bit build (2bit, mixed2, graded)")
    ap.add_argument("--tokens", required=True, help="the teacher's token set")
    ap.add_argument("--out", required=True, help="output build (resumes by block)")
    ap.add_argument("--steps", type=int, default=d.steps, help="per block")
    ap.add_argument("--lr", type=float, default=d.lr)
    stream.add_window_batch(ap, d.batch, "windows per step")
    ap.add_argument("--valid-windows", type=int, default=d.valid_windows)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--input", choices=("student", "teacher"), default=d.input)
    ap.add_argument("--chunk", type=int, default=d.chunk, help="experts per gradient chunk")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--state",
        choices=sorted(STATE_DTYPES),
        default=d.state,
        help="dtype of Adam's m, v and the best copy (bf16: a third the memory)",
    )
    ap.add_argument("--cap", default="2GiB", help="memory cap for the states")
    a = ap.parse_args(argv)
    if a.teacher_build is not None:
        print(
            "k3dist-dwq: --teacher-build is deprecated and ignored (the teacher's output "
            "names its build); drop it",
            file=sys.stderr,
        )
    cfg = DWQConfig(
        a.steps, a.lr, a.batch, a.valid_windows, a.eval_every, a.input, a.chunk, a.seed, a.state
    )
    try:
        path = dwq(
            a.teacher,
            a.student,
            read_tokens(a.tokens),
            a.out,
            cfg,
            cap=stream.parse_bytes(a.cap),
        )
    except (CheckpointError, stream.StreamError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    m = json.loads((path / MANIFEST).read_text())
    for b in m["dwq"]["blocks"]:
        print(
            f"layers {b['layers'][0]}..{b['layers'][1]}: valid {b['valid_before']} -> "
            f"{b['valid_after']}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
