"""Train a mini-K3 on the committed corpus: K3's topology at small size, mlx-lm's own
``kimi_k3`` modules, float32 on CPU, then MXFP4-frozen experts, then the source format.

Topology (from K3's real config.json via ``synth.make_config``; only sizes change): MLA at
every 4th layer and the last, KDA elsewhere; AttnRes blocks; layer 0 dense; LatentMoE
(routed experts on a latent of the hidden size, ``routed_expert_norm``) with 64+ routed
experts, a small top-k and 2 shared experts; sigmoid router whose
``e_score_correction_bias`` is not trained by gradient but moved aux-loss-free after each
step, ``bias += u * sign(mean_load - load)`` per layer (DeepSeek-V3 §2.1.2); SiTU-GLU.

Phases (one run folder, resumable at every checkpoint):

1. ``pretrain``: AdamW (decay on matrices only), linear warm-up then cosine to 10%,
   fixed seed; the horizon is ``--steps`` or, with ``--max-minutes`` only, what the
   measured step time predicts for the budget (fixed once measured, saved).
2. ``freeze``: routed experts quantized with ``k3dist.format.mxfp4.encode`` (OCP rounding) into
   mlx-lm's ``QuantizedSwitchLinear`` (mxfp4, frozen), then a brief fine-tune of all
   the rest with a fresh optimizer — the way K3 ships QAT MXFP4 experts.
3. ``export``: the Moonshot source layout (``k3dist.factory.moonshot``, as ``synth``),
   the inverse of mlx-lm's ``sanitize``: per-expert ``weight_packed``/``weight_scale``,
   q/k/v and their convs split, ``A_log`` zero-padded, MLA ``kv_b_proj`` re-joined,
   BF16 except K3's F32 set.

Data parallel (optional): under ``mlx.launch -n N`` every rank takes an equal share of
the same global batch; gradients and loss are averaged and router loads summed across
ranks, so the step is the one-process step on the whole batch (float sums aside). Rank 0
logs, evaluates and saves; a run may resume with another number of ranks.

Run folder: ``config.json`` (source config), ``log.jsonl`` (one JSON line per step, and
``"event"`` lines), ``state/`` (``model.safetensors``, ``optimizer.safetensors``,
``state.json``: step, phase, horizon, peak LR), replaced atomically;
``pretrained.safetensors``: the float weights at the freeze (``k3dist.factory.quality``'s float
reference). Batches are a pure function of (seed, step), so a resumed run sees the
batches it would have seen.

    python -m k3dist.factory.train --out runs/train --max-minutes 50
    mlx.launch -n 2 --python .venv/bin/python train/train.py --out runs/train --max-minutes 50
    python -m k3dist.factory.train --out runs/train --freeze --minutes 10
    python -m k3dist.factory.train --out runs/train --export k3dist/data/mini-k3
    python -m k3dist.factory.train speed --size m --seq 256 --batch 8 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3dist import blas_status, set_blas_threads
from k3dist.factory import corpus
from k3dist.factory.curves import (
    plot_log,
)
from k3dist.factory.export import (
    export_source,
    round_to_source,
)
from k3dist.factory.minimodel import (
    PRETRAINED_FILE,
    SIZES,
    build_model,
    describe,
    expert_loads,
    freeze_experts_mxfp4,
    init_from_source,
    model_config,
    reset_caches,
    update_router_bias,
)
from k3dist.format import tokens as tokenizer
from k3dist.format.folder import CONFIG_NAME
from k3dist.model.group import join

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

# ----------------------------------------------------------------------------- data


def token_stream(docs: list[corpus.Document], enc) -> np.ndarray:
    """[BOS] + tokens of each document, concatenated (int32)."""
    bos = enc.n_vocab - tokenizer.NUM_CONTROL_TOKENS  # base + 0: "[BOS]"
    parts = []
    for d in docs:
        parts.append(np.array([bos] + enc.encode_ordinary(d.text), dtype=np.int32))
    return np.concatenate(parts)


def sample_batch(
    stream: np.ndarray, seed: int, step: int, batch: int, seq: int, rank: int = 0, size: int = 1
) -> tuple[mx.array, mx.array]:
    """``batch`` random windows of ``seq + 1`` tokens, a pure function of (seed, step),
    so a resumed run draws the batches it would have drawn; with ``size`` data-parallel
    ranks, this rank's equal share of that same global batch."""
    if batch % size:
        raise ValueError(f"batch {batch} must split evenly over {size} ranks")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    share = batch // size
    starts = starts[rank * share : (rank + 1) * share]
    w = np.stack([stream[s : s + seq + 1] for s in starts])
    return mx.array(w[:, :-1]), mx.array(w[:, 1:])


def fixed_windows(stream: np.ndarray, seq: int, n: int) -> tuple[mx.array, mx.array]:
    """The first n non-overlapping windows (deterministic evaluation batches)."""
    n = min(n, (len(stream) - 1) // seq)
    w = np.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)])
    return mx.array(w[:, :-1]), mx.array(w[:, 1:])


def mean_nll(model: nn.Module, x: mx.array, y: mx.array, batch: int = 8) -> float:
    """Mean next-token NLL (nats) over windows, eval mode, float32."""
    was_training = model.training
    model.eval()
    reset_caches(model)
    total, count = 0.0, 0
    for i in range(0, x.shape[0], batch):
        logits = model(x[i : i + batch])
        nll = nn.losses.cross_entropy(logits, y[i : i + batch], reduction="sum")
        total += nll.item()
        count += y[i : i + batch].size
    reset_caches(model)
    model.train(was_training)
    return total / count


# ----------------------------------------------------------------------------- training


@dataclass
class TrainArgs:
    size: str = "m"
    seq: int = 256
    batch: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    freeze_warmup: int = 8  # the fine-tune after the MXFP4 freeze is short
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_rate: float = 1e-3  # DeepSeek-V3's gamma
    seed: int = 0
    init: str | None = None  # warm start: an exported source folder (init_from_source)
    steps: int | None = None  # horizon; None: from the time budget
    probe_steps: int = 5  # steps timed to set the horizon from the budget
    eval_every: int = 50
    eval_windows: int = 8
    save_every_s: float = 300.0


@dataclass
class State:
    phase: str = "pretrain"
    step: int = 0  # global optimizer steps
    phase_start: int = 0  # global step where this phase began
    horizon: int | None = None  # steps in this phase (schedule length)
    tokens: int = 0
    elapsed_s: float = 0.0
    peak_lr: float = 2e-3  # this phase's
    args: dict = field(default_factory=dict)


def lr_at(i: int, horizon: int | None, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps (``lr * (i + 1) / warmup``), then cosine to
    ``min_ratio * lr`` at ``horizon``: mlx.optimizers' schedules, joined. Needs the
    horizon only after warm-up."""
    if i >= warmup and horizon is None:
        raise ValueError(f"step {i} is past warm-up ({warmup}) but no horizon is set")
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(lr / warmup, lr, max(1, warmup - 1)),
            optim.cosine_decay(lr, max(1, (horizon or warmup) - warmup), min_ratio * lr),
        ],
        [warmup],
    )
    return schedule(i).item()


def make_optimizer(a: TrainArgs) -> optim.Optimizer:
    """AdamW; weight decay on matrices only (norm weights and A_log/dt_bias keep theirs)."""
    return optim.MultiOptimizer(
        [
            optim.AdamW(
                learning_rate=a.lr, betas=[0.9, 0.95], eps=1e-8, weight_decay=a.weight_decay
            ),
            optim.AdamW(learning_rate=a.lr, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0),
        ],
        [lambda path, w: w.ndim >= 2],
    )


def _loss(model: nn.Module, x: mx.array, y: mx.array):
    logits = model(x)
    loss = nn.losses.cross_entropy(logits, y, reduction="mean")
    return loss, expert_loads(model)


def train_step(
    model: nn.Module,
    optimizer: optim.Optimizer,
    grad_fn,
    x: mx.array,
    y: mx.array,
    lr: float,
    a: TrainArgs,
    group: mx.distributed.Group | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """One AdamW step at ``lr`` (gradients clipped), then the router-bias update from
    this batch's load. ``grad_fn = nn.value_and_grad(model, _loss)``. Returns
    (loss, loads [moe_layers, experts], grad norm), evaluated. Data-parallel (``group``
    of N > 1, equal shares of the batch): gradients and loss averaged, loads summed,
    so every rank takes the same step as one process on the whole batch."""
    for o in getattr(optimizer, "optimizers", [optimizer]):
        o.learning_rate = lr
    (loss, loads), grads = grad_fn(model, x, y)
    if group is not None and group.size() > 1:
        grads = nn.average_gradients(grads, group=group)
        loss = mx.distributed.all_sum(loss, group=group) / group.size()
        loads = mx.distributed.all_sum(loads, group=group)
    grads, gnorm = optim.clip_grad_norm(grads, a.grad_clip)
    optimizer.update(model, grads)
    update_router_bias(model, loads, a.bias_rate)
    mx.eval(loss, loads, gnorm, model.parameters(), optimizer.state)
    return loss, loads, gnorm


def load_imbalance(loads: mx.array) -> float:
    """Busiest expert's load over the mean, averaged over MoE layers (1.0: balanced)."""
    return (loads.max(axis=1) / loads.mean(axis=1)).mean().item()


class Trainer:
    """One run folder: model, optimizer, data RNG, log, checkpoints."""

    def __init__(
        self,
        out: Path,
        overrides: dict | None = None,
        corpus_dir: Path = corpus.CORPUS_DIR,
        tokenizer_dir: Path = corpus.TOKENIZER_DIR,
    ):
        """A new run takes ``TrainArgs(**overrides)``; a resumed one its saved args, and
        refuses overrides that differ from them."""
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        # Under mlx.launch: data-parallel ranks (rank 0 logs, evaluates and saves).
        self.group = join()
        self.rank, self.size = self.group.rank(), self.group.size()
        if self.size > 1:
            set_blas_threads(1)  # the ranks share the machine's cores
        self.tokenizer_dir = Path(tokenizer_dir)
        self.enc = tokenizer.load_encoding(self.tokenizer_dir)
        overrides = dict(overrides or {})
        self.state = self._read_state()
        if self.state is not None:
            saved = self.state.args
            clash = {k: (saved.get(k), v) for k, v in overrides.items() if saved.get(k) != v}
            if clash:
                raise ValueError(
                    f"{self.out} holds a run with other settings "
                    f"(name: (saved, asked)) {clash}; drop them to resume, "
                    "or use another --out"
                )
            self.args = TrainArgs(**saved)
        else:
            self.args = TrainArgs(**overrides)
        a = self.args
        self.config = model_config(a.size, self.enc.n_vocab)
        if self.rank == 0:
            (self.out / CONFIG_NAME).write_text(json.dumps(self.config, indent=2) + "\n")
        self.model = build_model(self.config, a.seed)
        self.train_stream = token_stream(corpus.load_split("train", path=corpus_dir), self.enc)
        # Held-out loss is logged for the curve only; it never steers training.
        self.eval_batches = {
            dom: fixed_windows(
                token_stream(corpus.load_split("eval", dom, corpus_dir), self.enc),
                a.seq,
                a.eval_windows,
            )
            for dom in corpus.DOMAINS
        }
        if self.state is None:
            if a.init is not None:
                init_from_source(self.model, self.config, a.init)
            self.state = State(args=asdict(a), peak_lr=a.lr, horizon=a.steps)
            self.optimizer = make_optimizer(a)
        else:
            self._load_state()

    # -- checkpoints

    def _read_state(self) -> State | None:
        path = self.out / "state" / "state.json"
        return State(**json.loads(path.read_text())) if path.exists() else None

    def _load_state(self) -> None:
        d = self.out / "state"
        if self.state.phase == "freeze":
            freeze_experts_mxfp4(self.model)
        self.model.load_weights(str(d / "model.safetensors"), strict=True)
        self.optimizer = make_optimizer(self.args)
        self.optimizer.init(self.model.trainable_parameters())
        saved = mx.load(str(d / "optimizer.safetensors"))
        if saved:
            self.optimizer.state = tree_unflatten(list(saved.items()))
        mx.eval(self.model.parameters(), self.optimizer.state)

    def save(self) -> None:
        """Replace state/ atomically: write state.tmp/, then swap directories (rank 0)."""
        if self.rank != 0:
            return
        tmp = self.out / "state.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        mx.save_safetensors(
            str(tmp / "model.safetensors"), dict(tree_flatten(self.model.parameters()))
        )
        mx.save_safetensors(
            str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state))
        )
        (tmp / "state.json").write_text(json.dumps(asdict(self.state), indent=2) + "\n")
        final, old = self.out / "state", self.out / "state.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)

    def log(self, record: dict) -> None:
        if self.rank != 0:
            return
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    # -- phases

    def evaluate(self) -> dict[str, float]:
        """Mean NLL per domain on the fixed held-out windows (rank 0; others: {})."""
        if self.rank != 0:
            return {}
        return {
            dom: round(mean_nll(self.model, x, y), 5) for dom, (x, y) in self.eval_batches.items()
        }

    def freeze(self, lr: float | None = None) -> dict:
        """pretrain -> freeze: experts to MXFP4 (frozen), a fresh optimizer, a new
        schedule at peak ``lr`` (default a quarter of the pretraining LR)."""
        if self.state.phase == "freeze":
            return {}
        before = self.evaluate()
        # The float model the MXFP4 teacher is measured against (k3dist.factory.quality).
        if self.rank == 0:
            mx.save_safetensors(
                str(self.out / PRETRAINED_FILE), dict(tree_flatten(self.model.parameters()))
            )
        errors = freeze_experts_mxfp4(self.model)
        after = self.evaluate()
        self.optimizer = make_optimizer(self.args)
        s = self.state
        s.phase, s.phase_start, s.horizon = "freeze", s.step, None
        s.peak_lr = lr if lr is not None else self.args.lr / 4
        event = {
            "event": "freeze",
            "step": s.step,
            "rel_rms_error": errors,
            "eval_before": before,
            "eval_after": after,
        }
        self.log(event)
        self.save()
        return event

    def run(
        self, max_minutes: float | None = None, max_steps: int | None = None, progress: bool = True
    ) -> State:
        """Train the current phase until its horizon, ``max_steps`` more steps or the
        time budget; checkpoint every ``save_every_s``, at the end and on Ctrl-C/SIGTERM.
        Without a horizon, one is set from the median of the first steps' times."""
        a, s = self.args, self.state
        if s.horizon is None and max_minutes is None:
            raise ValueError("no horizon: give --steps or a time budget (--max-minutes, --minutes)")
        budget = None if max_minutes is None else max_minutes * 60.0
        warmup = a.warmup if s.phase == "pretrain" else a.freeze_warmup
        if s.horizon is None and a.probe_steps + 1 > warmup:
            raise ValueError(
                f"warm-up ({warmup} steps) must outlast the {a.probe_steps} "
                "timed steps that set the horizon"
            )
        self.model.train()
        grad_fn = nn.value_and_grad(self.model, _loss)
        t_start = last_save = time.perf_counter()
        probe: list[float] = []
        done = 0
        progress = progress and self.rank == 0
        if progress:
            print(
                f"{s.phase} from step {s.step}: {describe(self.config)}; BLAS "
                f"{blas_status().get('loaded') or 'reference'}; {self.size} rank(s)",
                flush=True,
            )
        self._signalled = None
        previous = self._catch_signals()
        try:
            while True:
                i = s.step - s.phase_start
                if s.horizon is not None and i >= s.horizon:
                    break
                if max_steps is not None and done >= max_steps:
                    break
                over = budget is not None and time.perf_counter() - t_start >= budget
                if self._agree(over or self._signalled is not None):
                    break
                t0 = time.perf_counter()
                rate = lr_at(i, s.horizon, s.peak_lr, warmup, a.min_lr_ratio)
                x, y = sample_batch(
                    self.train_stream, a.seed, s.step, a.batch, a.seq, self.rank, self.size
                )
                loss, loads, gnorm = train_step(
                    self.model, self.optimizer, grad_fn, x, y, rate, a, self.group
                )
                dt = time.perf_counter() - t0
                s.step += 1
                s.tokens += x.size * self.size
                s.elapsed_s += dt
                done += 1
                rec = {
                    "step": s.step,
                    "phase": s.phase,
                    "loss": round(loss.item(), 5),
                    "lr": rate,
                    "grad_norm": round(gnorm.item(), 4),
                    "tokens": s.tokens,
                    "step_s": round(dt, 3),
                    "tok_s": round(x.size * self.size / dt, 1),
                    "load_max_over_mean": round(load_imbalance(loads), 3),
                }
                if done > 1 and len(probe) < a.probe_steps:
                    probe.append(dt)  # a process's first step pays for setup: not timed
                if s.horizon is None and len(probe) == a.probe_steps:
                    self._set_horizon(i, probe, budget - (time.perf_counter() - t_start), warmup)
                if a.eval_every and s.step % a.eval_every == 0:
                    rec["eval"] = self.evaluate()
                    self.model.train()
                self.log(rec)
                if progress:
                    print(
                        f"step {s.step} loss {rec['loss']:.4f} lr {rate:.2e} "
                        f"{rec['tok_s']:.0f} tok/s",
                        flush=True,
                    )
                if time.perf_counter() - last_save >= a.save_every_s:
                    self.save()
                    last_save = time.perf_counter()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._signalled is not None and self.rank == 0:
            print(
                f"stopped by {signal.Signals(self._signalled).name} at step {s.step}: saving",
                flush=True,
            )
        self.save()
        return s

    def _set_horizon(self, i: int, probe: list[float], left_s: float, warmup: int) -> None:
        """The phase's horizon from the median timed step and the time left (rank 0's
        for all: every rank must run the same steps)."""
        s = self.state
        per = sorted(probe)[len(probe) // 2]
        mine = max(warmup + 1, i + 1 + int(0.97 * left_s / per))
        s.horizon = self._from_rank0(mine)
        self.log(
            {
                "event": "horizon",
                "step": s.step,
                "phase": s.phase,
                "horizon": s.horizon,
                "step_s": per,
            }
        )

    def _catch_signals(self) -> dict:
        """Ctrl-C / SIGTERM finish the current step, then save (checked between steps)."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def stop(signum, _frame):
            self._signalled = signum

        return {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _agree(self, flag: bool) -> bool:
        """True on every rank if it is true on any (one decision for all ranks)."""
        if self.size == 1:
            return flag
        return mx.distributed.all_sum(mx.array(int(flag)), group=self.group).item() > 0

    def _from_rank0(self, value: int) -> int:
        if self.size == 1:
            return value
        v = mx.array(value if self.rank == 0 else 0)
        return int(mx.distributed.all_sum(v, group=self.group).item())


# ----------------------------------------------------------------------------- speed


def measure_speed(
    size: str,
    seq: int,
    batch: int,
    steps: int = 6,
    seed: int = 0,
    corpus_dir: Path = corpus.CORPUS_DIR,
    tokenizer_dir: Path = corpus.TOKENIZER_DIR,
) -> dict:
    """Training tokens/s of a size: ``steps`` full optimizer steps after one warm-up
    step (the first pays for setup), median step time."""
    enc = tokenizer.load_encoding(tokenizer_dir)
    config = model_config(size, enc.n_vocab)
    model = build_model(config, seed)
    model.train()
    stream = token_stream(corpus.load_split("train", "code", corpus_dir)[:20], enc)
    a = TrainArgs(size=size, seq=seq, batch=batch)
    opt = make_optimizer(a)
    grad_fn = nn.value_and_grad(model, _loss)
    times, losses = [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        x, y = sample_batch(stream, seed, i, batch, seq)
        loss, _, _ = train_step(model, opt, grad_fn, x, y, a.lr, a)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    med = sorted(times[1:])[len(times[1:]) // 2]
    return {
        "size": size,
        "seq": seq,
        "batch": batch,
        **describe(config),
        "first_step_s": round(times[0], 2),
        "median_step_s": round(med, 3),
        "tok_s": round(batch * seq / med, 1),
        "losses": [round(v, 3) for v in losses],
        "blas": blas_status().get("loaded") or "reference",
    }


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["speed"]:
        ap = argparse.ArgumentParser(description="Measure training tokens/s of a size.")
        ap.add_argument("--size", default="m", choices=sorted(SIZES))
        ap.add_argument("--seq", type=int, default=256)
        ap.add_argument("--batch", type=int, default=8)
        ap.add_argument("--steps", type=int, default=6)
        a = ap.parse_args(argv[1:])
        print(json.dumps(measure_speed(a.size, a.seq, a.batch, a.steps)))
        return

    ap = argparse.ArgumentParser(description="Train, freeze and export a mini-K3.")
    ap.add_argument("--out", type=Path, required=True, help="run folder (resumed if present)")
    ap.add_argument("--max-minutes", type=float, default=None, help="pretrain time budget")
    ap.add_argument("--steps", type=int, default=None, help="pretrain horizon (steps)")
    ap.add_argument("--freeze", action="store_true", help="MXFP4-freeze experts, fine-tune")
    ap.add_argument("--minutes", type=float, default=10.0, help="fine-tune time budget")
    ap.add_argument(
        "--freeze-lr",
        type=float,
        default=None,
        help="fine-tune peak LR (default: a quarter of --lr)",
    )
    ap.add_argument("--export", type=Path, default=None, help="write the source checkpoint")
    ap.add_argument("--plot", type=Path, default=None, help="write the training curve PNG")
    ap.add_argument("--size", default=None, choices=sorted(SIZES), help="default m")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 256)")
    ap.add_argument("--batch", type=int, default=None, help="default 8")
    ap.add_argument("--lr", type=float, default=None, help="peak LR (default 2e-3)")
    ap.add_argument("--seed", type=int, default=None, help="default 0")
    ap.add_argument(
        "--init",
        default=None,
        help="a new run starts from this exported "
        "source folder (experts decoded from MXFP4 to float), not at random",
    )
    ap.add_argument("--corpus", type=Path, default=corpus.CORPUS_DIR)
    ap.add_argument("--tokenizer", type=Path, default=corpus.TOKENIZER_DIR)
    a = ap.parse_args(argv)

    if a.plot is not None:
        print(f"wrote {plot_log(a.out / 'log.jsonl', a.plot)}")
        return
    given = {
        k: getattr(a, k)
        for k in ("size", "seq", "batch", "lr", "seed", "steps", "init")
        if getattr(a, k) is not None
    }
    tr = Trainer(a.out, given, a.corpus, a.tokenizer)
    if a.export is not None:
        if tr.state.phase != "freeze":
            print("note: experts were never fine-tuned frozen (--freeze); encoding now")
        tr.model.eval()
        round_to_source(tr.model, tr.config)
        path = export_source(
            tr.model,
            tr.config,
            a.export,
            a.tokenizer,
            tr.args.seed,
            provenance={"run": str(a.out), **asdict(tr.state)},
        )
        print(f"wrote {path}: {describe(tr.config)}")
        return
    if a.freeze:
        event = tr.freeze(a.freeze_lr)
        if event:
            print(f"froze experts: held-out NLL {event['eval_before']} -> {event['eval_after']}")
        tr.run(max_minutes=a.minutes)
        return
    tr.run(max_minutes=a.max_minutes)


if __name__ == "__main__":
    main()
