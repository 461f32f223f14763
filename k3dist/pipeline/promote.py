"""MXFP4 build (``python -m k3dist.pipeline.convert``) + promotion list -> graded build.

For every MoE layer the routed-expert stack ``mlp.switch_mlp`` (MXFP4) becomes two:

- hi bank ``mlp.switch_hi``: the promoted experts, their MXFP4 weight and scale bytes
  copied byte range by byte range (bit-exact; never decoded);
- lo bank ``mlp.switch_mlp``: every other expert (every expert with ``lo_fallback``),
  dequantized from MXFP4 and quantized affine low-bit with ``mx.quantize`` (scales and
  biases in bf16, the build's dtype), one expert at a time.

Every other tensor is copied byte for byte. ``config.json`` gains the ``graded`` block
(``k3dist.format.graded.GradedMap``) and per-path ``quantization`` entries for both banks.

Streamed one output file (a decoder layer) at a time; within a layer one expert matrix
is decoded at a time. Held per layer: the lo bank's scales and biases of one projection
(they follow its codes in the file; 2-bit g64: 1/5 of the lo bytes of one projection,
~0.6 GB for a real K3 layer). Resumable like the converter: a journal records finished
files, files appear under their final names only when complete, ``k3dist.json`` last.

    python -m k3dist.pipeline.promote --build BUILD --out GRADED --scores SCORES --plan PLAN.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from k3dist import __version__
from k3dist.format import layout
from k3dist.format.folder import CONFIG_NAME, INDEX_NAME, load_config
from k3dist.format.graded import GRADED_KEY, HI, LO, GradedMap, bank_of
from k3dist.format.journal import JournaledFolder, write_json_atomic
from k3dist.format.manifest import MANIFEST
from k3dist.format.placement import read_counts
from k3dist.format.qformat import MXFP4, QFormat
from k3dist.format.sfile import (
    CHUNK_BYTES,
    CheckpointError,
    Header,
    StreamWriter,
    TensorInfo,
    mx_to_bytes,
    read_header,
    sha256_file,
)
from k3dist.pipeline.view import as_build

import mlx.core as mx
import numpy as np
from tqdm import tqdm


def identity(build_manifest: dict, gmap: GradedMap, lo: QFormat) -> dict:
    return {
        "kind": "graded",
        "from_build": build_manifest["build_hash"],
        "lo": lo.qconfig(),
        "graded_sha256": hashlib.sha256(
            json.dumps(gmap.to_json(), sort_keys=True).encode()
        ).hexdigest(),
    }


def requantize(wq: mx.array, sq: mx.array, lo: QFormat) -> tuple[mx.array, mx.array, mx.array]:
    """MXFP4 expert codes and scales ``[n, rows, *]`` -> the lo bank's affine (codes,
    scales, biases): decoded to bf16 and quantized with ``mx.quantize``, each group
    alone (so any run of experts gives the same bytes)."""
    dense = mx.dequantize(wq, sq, mode="mxfp4", group_size=32, bits=4, dtype=mx.bfloat16)
    return mx.quantize(dense, group_size=lo.group_size, bits=lo.bits, mode="affine")


def graded_config(config: dict, gmap: GradedMap, lo: QFormat) -> dict:
    """config.json of the graded build of an MXFP4 build's ``config``."""
    cfg = json.loads(json.dumps(config))
    tc = layout.text_config(cfg)
    quant = cfg["quantization"]
    moe = [i for i in range(tc["num_hidden_layers"]) if layout.is_moe_layer(tc, i)]
    for layer in moe:
        for proj in layout.MLP_PROJS:
            quant[f"language_model.model.layers.{layer}.mlp.{LO}.{proj}"] = lo.qconfig()
            if gmap.hi_ids(layer):
                quant[f"language_model.model.layers.{layer}.mlp.{HI}.{proj}"] = MXFP4.qconfig()
    cfg[GRADED_KEY] = gmap.to_json()
    return cfg


def expert_runs(ids: list[int], most: int) -> list[tuple[int, int]]:
    """(first id, count) of runs of consecutive ``ids`` (in order), each at most ``most``."""
    runs: list[tuple[int, int]] = []
    for e in ids:
        if runs and runs[-1][0] + runs[-1][1] == e and runs[-1][1] < most:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs


class GradedBuilder:
    def __init__(
        self,
        build: str | Path,
        out: str | Path,
        gmap: GradedMap,
        lo: QFormat,
        plan: dict | None = None,
    ):
        self.src = as_build(build)
        self.build, self.out, self.gmap, self.lo = self.src.path, Path(out), gmap, lo
        self.plan = plan
        if self.src.manifest is None:
            raise CheckpointError(
                f"{self.build}: no {MANIFEST}; grade a finished MXFP4 "
                "build (python -m k3dist.pipeline.convert)"
            )
        self.manifest = self.src.manifest
        self.config = self.src.config
        if GRADED_KEY in self.config:
            raise CheckpointError(
                f"{self.build}: already a graded build; grade the MXFP4 build it came from"
            )
        if not lo.quantized or lo.mode != "affine":
            raise ValueError(f"lo bank format must be affine low-bit, not {lo.name}")
        self.tc = layout.text_config(self.config)
        E = self.tc["num_experts"]
        if gmap.num_experts != E:
            raise ValueError(f"graded map is for {gmap.num_experts} experts, the build has {E}")
        moe = {i for i in range(self.tc["num_hidden_layers"]) if layout.is_moe_layer(self.tc, i)}
        bad = sorted(set(gmap.hi) - moe)
        if bad:
            raise ValueError(f"promoted experts for layers {bad}, which are not MoE layers")
        self.files = self.src.files()
        self.headers: dict[str, Header] = {f: self.src.header(f) for f in self.files}
        for h in self.headers.values():
            for n, t in h.tensors.items():
                b = bank_of(n)
                if b is None:
                    continue
                if b[1] == HI or t.shape[0] != E:
                    raise CheckpointError(
                        f"{h.path}: {n!r} is {list(t.shape)}, not a full "
                        f"{E}-expert stack; grade an MXFP4 build"
                    )
                q = self.config["quantization"].get(n.rsplit(".", 1)[0], {})
                if q.get("mode") != "mxfp4":
                    raise CheckpointError(
                        f"{h.path}: {n!r} is {q or 'unquantized'}, not mxfp4; grade an MXFP4 build"
                    )
                mats = t.shape[-1] * (8 if t.dtype == "U32" else 32)
                if n.endswith(".weight") and not lo.fits(mats):
                    raise ValueError(
                        f"{lo.name} cannot store {n!r} ({mats} columns); "
                        "choose another lo group size"
                    )
        self.ident = identity(self.manifest, gmap, lo)

    # -- one file ---------------------------------------------------------------
    def _entries(self, h: Header):
        """(name, dtype, shape, chunk factory) of the output file, in order."""
        out = []
        stacks: dict[tuple[int, str], dict[str, TensorInfo]] = {}
        for t in sorted(h.tensors.values(), key=lambda t: t.start):
            b = bank_of(t.name)
            if b is None:
                out.append((t.name, t.dtype, t.shape, lambda t=t: self.src.chunks(t)))
                continue
            proj = t.name.split(f".{LO}.")[1].split(".")[0]
            stacks.setdefault((b[0], proj), {})[t.name.rsplit(".", 1)[1]] = t
        for (layer, proj), parts in stacks.items():
            out += self._bank_entries(layer, proj, parts["weight"], parts["scales"])
        return out

    def _bank_entries(self, layer: int, proj: str, w: TensorInfo, s: TensorInfo):
        base = f"language_model.model.layers.{layer}.mlp"
        E, rows = w.shape[0], w.shape[1]
        cols = w.shape[2] * 8
        hi, lo = self.gmap.hi_ids(layer), self.gmap.lo_ids(layer)
        out = []
        if hi:
            for t, suffix in ((w, "weight"), (s, "scales")):
                per = t.nbytes // E

                def copy(t=t, per=per):  # byte ranges of the promoted rows
                    for e in hi:
                        yield self.src.read(t, e * per, per)

                out.append((f"{base}.{HI}.{proj}.{suffix}", t.dtype, (len(hi), *t.shape[1:]), copy))
        q = self.lo
        held: dict[str, list[bytes]] = {"scales": [], "biases": []}

        def codes():
            # Runs of consecutive lo experts, read and re-quantized a run at a time (up to
            # CHUNK_BYTES of codes): per-expert calls cost ~0.1 ms each, 25 s over the real
            # K3's 82,432 experts x 3 projections (measured on the k3counts preset).
            wper, sper = w.nbytes // E, s.nbytes // E
            for e, n in expert_runs(lo, max(1, CHUNK_BYTES // wper)):
                wq = mx.array(np.frombuffer(self.src.read(w, e * wper, n * wper), np.uint32))
                sq = mx.array(np.frombuffer(self.src.read(s, e * sper, n * sper), np.uint8))
                qw, qs, qb = requantize(wq.reshape(n, rows, -1), sq.reshape(n, rows, -1), q)
                held["scales"].append(mx_to_bytes(qs))
                held["biases"].append(mx_to_bytes(qb))
                yield mx_to_bytes(qw)

        def pop(key):
            yield from held[key]
            held[key].clear()

        n = len(lo)
        out.append((f"{base}.{LO}.{proj}.weight", "U32", (n, rows, cols * q.bits // 32), codes))
        out.append(
            (
                f"{base}.{LO}.{proj}.scales",
                "BF16",
                (n, rows, cols // q.group_size),
                lambda: pop("scales"),
            )
        )
        out.append(
            (
                f"{base}.{LO}.{proj}.biases",
                "BF16",
                (n, rows, cols // q.group_size),
                lambda: pop("biases"),
            )
        )
        return out

    def grade_file(self, fname: str, digests: bool = True) -> dict:
        """Write graded file ``fname``; ``digests`` False: scratch, read once and deleted
        (``k3dist.pipeline.direct``), so no SHA-256 (its ``sha256`` is None)."""
        h = self.headers[fname]
        entries = self._entries(h)
        with StreamWriter(
            self.out / fname,
            [(n, d, s) for n, d, s, _ in entries],
            h.metadata or None,
            digests=digests,
        ) as wr:
            for n, _, _, chunks in entries:
                wr.write(n, chunks())
        return {"file": fname, "bytes": wr.size, "sha256": wr.sha256, "tensors": len(entries)}

    # -- whole build ----------------------------------------------------------------
    @property
    def build_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.ident, sort_keys=True).encode()).hexdigest()[:16]

    def config_out(self) -> dict:
        return graded_config(self.config, self.gmap, self.lo)

    def run(self, progress: bool = True) -> Path:
        out = self.out
        folder = JournaledFolder(out, "build", self.ident)
        if folder.open():
            return out
        t0 = time.perf_counter()
        for f in tqdm(self.files, desc="grade", disable=not progress):
            if folder.unit(f, lambda f=f: self.grade_file(f)):
                mx.clear_cache()
        weight_map = {n: f for f in self.files for n in read_header(out / f).tensors}
        total = sum(folder.done[f]["bytes"] for f in self.files)
        write_json_atomic(
            out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
        write_json_atomic(out / CONFIG_NAME, self.config_out())
        small = self.src.write_small(out)
        files = {
            f: {"sha256": folder.done[f]["sha256"], "bytes": folder.done[f]["bytes"]}
            for f in self.files
        }
        for name in (*small, INDEX_NAME, CONFIG_NAME):
            files[name] = {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size}
        folder.finish(
            {
                "tool": f"k3dist {__version__}",
                "kind": "build",
                "identity": self.ident,
                "build_hash": self.build_hash,
                "from_build": self.src.describe,
                "profile": {
                    "experts": f"graded: hi mxfp4 (source bytes), lo {self.lo.name}",
                    "lo_fallback": self.gmap.lo_fallback,
                    "promoted": {str(k): len(v) for k, v in sorted(self.gmap.hi.items())},
                },
                "plan": self.plan,
                "files": files,
                "seconds": round(time.perf_counter() - t0, 2),
            }
        )
        return out


def grade(
    build: str | Path,
    out: str | Path,
    promoted: dict[int, list[int]],
    k_hi: dict[int, int] | int,
    lo: str | QFormat = "2bit-g64",
    lo_fallback: bool = False,
    progress: bool = True,
    plan: dict | None = None,
) -> Path:
    """Write a graded build of an MXFP4 ``build``: ``promoted`` global expert ids per MoE
    layer keep their MXFP4 bytes (hi bank), the rest become ``lo``; resumable. ``plan``
    (k3dist.pipeline.byte_budget) is stored in the build manifest."""
    return builder(build, out, promoted, k_hi, lo, lo_fallback, plan).run(progress)


def builder(
    build,
    out: str | Path,
    promoted: dict[int, list[int]],
    k_hi: dict[int, int] | int,
    lo: str | QFormat = "2bit-g64",
    lo_fallback: bool = False,
    plan: dict | None = None,
) -> GradedBuilder:
    """The :class:`GradedBuilder` :func:`grade` runs (``k3dist.pipeline.direct`` writes its
    files into rank folders instead)."""
    E = layout.text_config(as_build(build).config)["num_experts"]
    if isinstance(k_hi, int):
        k_hi = {layer: k_hi for layer in promoted}
    gmap = GradedMap(
        E,
        {int(k): tuple(sorted(int(e) for e in v)) for k, v in promoted.items() if len(v)},
        {int(k): int(v) for k, v in k_hi.items()},
        lo_fallback,
        QFormat.parse(lo).name if isinstance(lo, str) else lo.name,
    )
    lo = QFormat.parse(lo) if isinstance(lo, str) else lo
    return GradedBuilder(build, out, gmap, lo, plan)


def promote_top(scores: dict[int, np.ndarray], counts: dict[int, int]) -> dict[int, list[int]]:
    """The ``counts[layer]`` highest-scoring experts of each layer (scores: routing
    counts for the frequency baseline, or a sensitivity score from calibration)."""
    out = {}
    for layer, n in counts.items():
        if layer not in scores:
            raise ValueError(f"no scores for MoE layer {layer}; score every MoE layer")
        s = np.asarray(scores[layer], dtype=np.float64)
        out[layer] = sorted(int(e) for e in np.argsort(-s, kind="stable")[:n])
    return out


def promote_global(
    scores: dict[int, np.ndarray], total: int, multiple: int = 1
) -> dict[int, list[int]]:
    """About ``total`` promotions chosen over all layers at once (a global budget: layers
    whose experts matter more get more of it). Each layer's experts are taken in groups of
    ``multiple`` (its best ``multiple``, then the next ...; a group scores its sum), so every
    layer's count is a multiple of ``multiple`` (the ranks: hi bytes balance across them);
    every lo bank keeps at least one expert. Scores must be comparable across layers (a
    sensitivity, not routing counts)."""
    groups = []  # (score, layer, ids)
    for layer, v in scores.items():
        v = np.asarray(v, dtype=np.float64)
        order = np.argsort(-v, kind="stable")
        for g in range((len(v) - 1) // multiple):
            ids = order[g * multiple : (g + 1) * multiple]
            groups.append((float(v[ids].sum()), layer, g, [int(e) for e in ids]))
    # within a layer group sums never increase, and ties go by position: the global
    # order takes each layer's groups best first
    groups.sort(key=lambda t: (-t[0], t[1], t[2]))
    out: dict[int, list[int]] = {layer: [] for layer in scores}
    for _, layer, _, ids in groups[: total // multiple]:
        out[layer] += ids
    return {layer: sorted(v) for layer, v in out.items()}


def k_hi_calibrated(
    routes: str | Path, promoted: dict[int, list[int]], build: str | Path, target: float = 0.0
) -> dict[int, int]:
    """k_hi per layer from calibration routes (``k3dist.pipeline.calibrate``)."""
    from k3dist.pipeline.calibrate import k_hi_from_routes

    cfg = build.config if hasattr(build, "config") else load_config(build)
    top_k = layout.text_config(cfg)["num_experts_per_token"]
    r = read_counts(routes)
    missing = sorted(set(promoted) - set(r))
    if missing:
        raise ValueError(f"{routes}: no routes for MoE layers {missing}; calibrate every layer")
    return {
        layer: max(1, k_hi_from_routes(r[layer], ids, top_k, target))
        for layer, ids in promoted.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Graded build from an MXFP4 build: promoted "
        "experts keep their MXFP4 bytes, the rest affine low-bit."
    )
    ap.add_argument(
        "--build", required=True, help="MXFP4 build (python -m k3dist.pipeline.convert)"
    )
    ap.add_argument("--out", required=True, help="output folder (resumes if partial)")
    ap.add_argument(
        "--scores",
        required=True,
        help="per-expert scores per MoE layer (.npz layer_L arrays or JSON "
        '{"layers": {"L": [...]}}, as routing counts): highest promoted',
    )
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--plan",
        help="plan JSON (python -m k3dist.pipeline.plan --json): its lo format, "
        "promoted count and k_hi per layer",
    )
    g.add_argument("--per-layer", type=int, help="promoted experts per MoE layer")
    ap.add_argument("--lo", help="lo-bank format (default: the plan's, else 2bit-g64)")
    ap.add_argument("--k-hi", type=int, help="hi routes per token (default: the plan's)")
    ap.add_argument(
        "--routes",
        help="calibration routes (python -m k3dist.pipeline.calibrate: routes.npz): k_hi "
        "per layer = the fewest hi slots that overflow on at most --k-hi-target of the "
        "calibration tokens (0: the observed maximum)",
    )
    ap.add_argument("--k-hi-target", type=float, default=0.0)
    ap.add_argument("--lo-fallback", action="store_true")
    ap.add_argument(
        "--global",
        dest="global_budget",
        action="store_true",
        help="choose the same total number of promotions over all layers at once "
        "(scores must be comparable across layers: a sensitivity, not counts)",
    )
    ap.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="with --global: each layer promotes a multiple of this (hi bytes balanced)",
    )
    args = ap.parse_args()
    scores = read_counts(args.scores)
    p = None
    if args.plan:
        p = json.loads(Path(args.plan).read_text())
        counts = {int(k): int(v) for k, v in p["promoted_per_layer"].items()}
        k_hi = {int(k): int(v) for k, v in p["k_hi_uniform"].items()}
        lo = args.lo or p["lo"]["format"]
    else:
        counts = {layer: args.per_layer for layer in scores}
        k_hi = {}
        lo = args.lo or "2bit-g64"
    if args.k_hi is not None and args.routes:
        ap.error("give --k-hi or --routes, not both")
    if args.k_hi is not None:
        k_hi = dict.fromkeys(counts, args.k_hi)
    if not k_hi and not args.routes:
        ap.error("give --k-hi, --routes (calibration) or a --plan that has k_hi")
    try:
        if args.global_budget:
            promoted = promote_global(scores, sum(counts.values()), args.ranks)
        else:
            promoted = promote_top(scores, counts)
        if args.routes:
            k_hi = k_hi_calibrated(args.routes, promoted, args.build, args.k_hi_target)
        path = grade(args.build, args.out, promoted, k_hi, lo, args.lo_fallback, plan=p)
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
