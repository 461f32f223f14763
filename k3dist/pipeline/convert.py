"""Moonshot-format K3 checkpoint -> MLX build that mlx-lm's ``kimi_k3`` loads.

Streamed one conversion unit at a time (a decoder layer, the head, the vision
tower), each into its own safetensors file:

- routed experts are stacked per layer in MLX ``mxfp4`` by copying the source
  bytes expert by expert into the output file (``weight_packed`` viewed as uint32,
  ``weight_scale`` unchanged), so they are bit-exact and never all in memory;
- every other tensor goes through mlx-lm's own ``Model.sanitize`` (renames, q/k/v
  fusion, the MLA ``kv_b_proj`` split) after our ``A_log`` padding check, and is
  kept in its source dtype (``--nonexpert-bits 16``) or quantized affine 8/4-bit
  with mlx-lm's modules and ``quant_predicate``, or per class with ``--nonexpert
  attention=6bit-g64,shared=8bit-g64,...`` (classes of ``k3dist.format.classes``; a
  class's group size drops to the largest that divides a matrix's columns, e.g. g32
  for 96 columns; config.json records every module's format);
- the vision tower is carried through as-is.

A journal (``.k3dist-progress.json``) records each finished file with its sha256;
a re-run skips finished units and redoes the first incomplete one. Files appear
under their final names only when complete. ``k3dist.json`` is written last.

With an expert subset (``experts``: layer -> global ids to keep, in local order) the
same units hold only those experts: ``k3dist.pipeline.slicing`` uses it to write a rank
folder straight from the source; ``run`` itself refuses it (that is not a build).

Profiles made from this build (low-bit, graded): ``k3dist.pipeline.profiles``.

    python -m k3dist.pipeline.convert --src SRC --out BUILD [--nonexpert-bits 16|8|4]
        [--nonexpert attention=6bit-g64,shared=6bit-g64,latent=8bit-g64,...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3dist import __version__
from k3dist.format import layout
from k3dist.format import tokens as tokenizer
from k3dist.format.classes import CLASSES, module_class
from k3dist.format.folder import CONFIG_NAME, INDEX_NAME
from k3dist.format.journal import JournaledFolder, write_json_atomic
from k3dist.format.manifest import BUILD_FORMAT_VERSION
from k3dist.format.qformat import MXFP4, SOURCE, QFormat
from k3dist.format.sfile import (
    CheckpointError,
    StreamWriter,
    TensorInfo,
    iter_chunks,
    mx_dtype,
    mx_dtype_name,
    mx_to_bytes,
    read_header,
    sha256_file,
)
from k3dist.format.source import Source, check_a_log_tail, quantization_format

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3
from tqdm import tqdm

FORMAT_VERSION = BUILD_FORMAT_VERSION
TOKENIZER_FILES = (
    "tiktoken.model",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def output_file(group: str) -> str:
    if group.startswith("layer."):
        return f"model-layer-{int(group.split('.')[1]):03d}.safetensors"
    return f"model-{group}.safetensors"


@dataclass(frozen=True)
class ExpertStack:
    """One stacked expert tensor of a unit: the bytes of ``parts`` (one source tensor
    per expert) in order, stored as ``dtype`` ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts)

    def chunks(self) -> Iterator[bytes]:
        for t in self.parts:
            yield from iter_chunks(t)


Reader = Callable[[TensorInfo], mx.array]


class ShardReader:
    """Source tensors as lazy arrays (read when evaluated), each shard opened once:
    ``mx.load`` parses a shard's whole header, ~0.08 s at K3's 5,404 tensors a shard."""

    def __init__(self):
        self.files: dict[Path, dict[str, mx.array]] = {}

    def __call__(self, t: TensorInfo) -> mx.array:
        if t.path not in self.files:
            self.files[t.path] = mx.load(str(t.path))
        return self.files[t.path][t.name]


def shape_only(t: TensorInfo) -> mx.array:
    """A stand-in of ``t``'s shape and dtype, never evaluated: what a unit's layout
    (names, shapes, dtypes, sizes) needs without opening its shards."""
    return mx.zeros(t.shape, mx_dtype(t.dtype))


def identity(
    src: Source, nonexpert_bits: int, group_size: int, nonexpert: dict[str, QFormat] | None = None
) -> dict:
    """What makes two builds the same build: the source and the profile."""
    cfg_bytes = (src.path / CONFIG_NAME).read_bytes()
    ident = {
        "format_version": FORMAT_VERSION,
        "source_index_sha256": src.index_sha256,
        "source_config_sha256": hashlib.sha256(cfg_bytes).hexdigest(),
        "nonexpert_bits": nonexpert_bits,
        "nonexpert_group_size": group_size if nonexpert_bits < 16 else None,
        "experts": "mxfp4",
    }
    if nonexpert is not None:  # per class (classes.CLASSES); a uniform build has no key
        ident["nonexpert_bits"] = ident["nonexpert_group_size"] = None
        ident["nonexpert"] = {c: nonexpert.get(c, SOURCE).name for c in CLASSES}
    return ident


def parse_nonexpert(spec: str | dict | None) -> dict[str, QFormat] | None:
    """``attention=6bit-g64,shared=8bit-g64,...`` (or a dict) -> {class: QFormat}.
    Classes are ``k3dist.format.classes.CLASSES``; ``*=FORMAT`` sets every class not named;
    a class not named keeps its source dtype (``bf16``)."""
    if spec is None:
        return None
    items = (
        spec.items()
        if isinstance(spec, dict)
        else (kv.partition("=")[::2] for kv in spec.split(",") if kv.strip())
    )
    out: dict[str, QFormat] = {}
    rest = None
    for c, f in items:
        c = c.strip()
        fmt = f if isinstance(f, QFormat) else QFormat.parse(str(f))
        if fmt.quantized and fmt.mode != "affine":
            raise ValueError(
                f"--nonexpert {c}={fmt.name}: non-expert classes take affine "
                "formats (<bits>bit-g<group>) or bf16"
            )
        if c == "*":
            rest = fmt
        elif c in CLASSES:
            out[c] = fmt
        else:
            raise ValueError(
                f"--nonexpert: unknown class {c!r}; one of {', '.join(CLASSES)} "
                "or * (e.g. attention=6bit-g64,shared=8bit-g64)"
            )
    return {c: out.get(c, rest or SOURCE) for c in CLASSES}


def build_hash(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _quantize(
    module: nn.Module,
    prefix: str,
    loaded: set[str],
    bits: int,
    group_size: int,
    predicate,
    nonexpert: dict[str, QFormat] | None = None,
) -> dict:
    """mlx-lm's module-level quantization, restricted to modules we loaded weights
    into; returns the per-path parameters for the config's quantization block.
    ``nonexpert`` (class -> format) replaces the uniform ``bits``/``group_size``: each
    module gets its class's format (``classes.module_class``), at a smaller group size
    where its columns need one (``QFormat.for_cols``); mlx-lm's predicate still
    decides what is never quantized (AttnRes projections)."""
    recorded: dict = {}
    default = {"group_size": group_size, "bits": bits, "mode": "affine"}

    def pred(path: str, m: nn.Module):
        full = prefix + path
        if not hasattr(m, "to_quantized") or f"{full}.weight" not in loaded:
            return False
        r = predicate(full, m)
        if r is False:
            return False
        if nonexpert is not None:
            fmt = nonexpert.get(module_class(full), SOURCE)
            fmt = fmt.for_cols(m.weight.shape[-1]) if fmt.quantized else None
            if fmt is None:
                return False
            params = fmt.qconfig()
        else:
            if m.weight.shape[-1] % group_size != 0:
                return False
            params = dict(default, **r) if isinstance(r, dict) else dict(default)
        recorded[full] = params
        return params

    nn.quantize(module, group_size, bits, class_predicate=pred)
    return recorded


class Converter:
    def __init__(
        self,
        src: Source,
        out: Path,
        nonexpert_bits: int = 16,
        group_size: int = 64,
        experts: Callable[[int], Sequence[int]] | None = None,
        nonexpert: str | dict | None = None,
    ):
        if nonexpert_bits not in (16, 8, 4):
            raise ValueError(f"--nonexpert-bits must be 16, 8 or 4, not {nonexpert_bits}")
        self.nonexpert = parse_nonexpert(nonexpert)
        if self.nonexpert is not None and nonexpert_bits != 16:
            raise ValueError("give --nonexpert-bits or per-class --nonexpert, not both")
        quantization_format(src.config)
        self.src, self.out = src, out
        self.bits, self.group_size = nonexpert_bits, group_size
        self.tc = src.text_config
        # mlx-lm's classes: sanitize/predicates from a model whose weights stay lazy
        # (never evaluated), fresh modules per unit for quantization.
        self.args = kimi_k3.ModelArgs.from_dict(src.config)
        self.model = kimi_k3.Model(self.args)
        self.specs: dict[str, list[layout.TensorSpec]] = {}
        for s in layout.source_specs(src.config):
            self.specs.setdefault(s.group, []).append(s)
        self.ident = identity(src, nonexpert_bits, group_size, self.nonexpert)
        self.experts = experts
        self._entries: dict[int, list[ExpertStack]] = {}
        self._checked: dict[str, TensorInfo] = {}  # what preflight found, by name

    def expert_ids(self, layer: int) -> list[int]:
        """Global ids of the experts this conversion stacks for ``layer``, in order."""
        E = self.tc["num_experts"]
        if self.experts is None:
            return list(range(E))
        ids = [int(e) for e in self.experts(layer)]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= e < E for e in ids):
            raise ValueError(
                f"layer {layer}: expert subset {ids[:8]} must be one or more "
                f"distinct ids in 0..{E - 1}"
            )
        return ids

    # -- one unit ---------------------------------------------------------------
    def _dense(self, group: str, read: Reader) -> tuple[list[tuple[str, mx.array]], dict]:
        """Non-expert tensors of a unit in mlx-lm naming (sanitized, maybe quantized),
        their source tensors as ``read`` gives them."""
        specs = [s for s in self.specs[group] if s.family != "experts"]
        weights = {}
        for s in specs:  # A_log tails were checked in preflight
            weights[s.name] = read(self._info(s))  # checked against the config
        weights = self.model.sanitize(weights)
        qconfig: dict = {}
        quantize = self.bits < 16 or (
            self.nonexpert is not None and any(f.quantized for f in self.nonexpert.values())
        )
        if quantize:
            if group.startswith("layer."):
                layer = int(group.split(".")[1])
                module = kimi_k3.KimiK3DecoderLayer(self.args.text_config, layer)
                prefix = f"language_model.model.layers.{layer}."
            else:
                module, prefix = kimi_k3.Model(self.args), ""
            local = {k[len(prefix) :]: v for k, v in weights.items()}
            module.load_weights(list(local.items()), strict=False)
            qconfig = _quantize(
                module,
                prefix,
                set(weights),
                self.bits,
                self.group_size,
                self.model.quant_predicate,
                self.nonexpert,
            )
            params = dict(tree_flatten(module.parameters()))
            keep = {
                k
                for k in params
                if (prefix + k) in weights or (prefix + k.rsplit(".", 1)[0] + ".weight") in weights
            }
            weights = {prefix + k: params[k] for k in sorted(keep)}
        return sorted(weights.items()), qconfig

    def _expert_entries(self, layer: int) -> list[ExpertStack]:
        """The stacked experts of ``layer``: name, dtype, shape and the source tensors
        (one per expert, in order) whose bytes they are. Looked up once a process: at
        K3's counts a layer's 5,376 lookups and checks cost ~0.1 s, and a view asks
        for every layer several times."""
        if layer not in self._entries:
            self._entries[layer] = self._find_expert_entries(layer)
        return self._entries[layer]

    def _find_expert_entries(self, layer: int) -> list[ExpertStack]:
        ids = self.expert_ids(layer)
        infos = {}
        for s in self.specs[f"layer.{layer}"]:
            if s.family == "experts":
                infos[s.name] = self._info(s)  # check all before writing
        out = []
        base = f"language_model.model.layers.{layer}"
        for w, dst in layout.EXPERT_PROJ.items():
            p0 = infos[f"{base}.block_sparse_moe.experts.0.{w}.weight_packed"]
            s0 = infos[f"{base}.block_sparse_moe.experts.0.{w}.weight_scale"]
            rows, pcols = p0.shape
            for kind, dtype, shape, suffix in (
                ("weight_packed", "U32", (len(ids), rows, pcols // 4), "weight"),
                ("weight_scale", "U8", (len(ids), rows, s0.shape[1]), "scales"),
            ):
                parts = tuple(infos[f"{base}.block_sparse_moe.experts.{e}.{w}.{kind}"] for e in ids)
                out.append(
                    ExpertStack(f"{base}.mlp.switch_mlp.{dst}.{suffix}", dtype, shape, parts)
                )
        return out

    def unit(
        self, group: str, read: Reader | None = None
    ) -> tuple[list[tuple[str, mx.array]], list[ExpertStack], dict]:
        """What a decoder-layer or head unit holds, as its file stores it: the non-expert
        tensors (lazy arrays: nothing is read until they are evaluated), the expert stacks
        (source byte ranges) and the unit's quantization entries. ``read``: how source
        tensors become arrays (a fresh :class:`ShardReader` by default; pass one to share
        its opened shards, or :func:`shape_only` for shapes alone)."""
        dense, qconfig = self._dense(group, ShardReader() if read is None else read)
        experts = []
        if group.startswith("layer.") and layout.is_moe_layer(self.tc, int(group.split(".")[1])):
            experts = self._expert_entries(int(group.split(".")[1]))
            for e in experts:
                if e.name.endswith(".weight"):
                    qconfig[e.name[: -len(".weight")]] = MXFP4.qconfig()
        return dense, experts, qconfig

    def convert_unit(self, group: str) -> dict:
        path = self.out / output_file(group)
        if group == "vision":
            infos = self.vision_infos()
            entries = [(t.name, t.dtype, t.shape) for t in infos]
            with StreamWriter(path, entries, {"format": "mlx"}) as w:
                for t in infos:
                    w.write(t.name, iter_chunks(t))
            return {
                "file": path.name,
                "bytes": w.size,
                "sha256": w.sha256,
                "tensors": len(entries),
                "quantization": {},
                "header_sha256": w.header_sha256,
                "tensor_sha256": w.tensor_sha256,
            }

        dense, experts, qconfig = self.unit(group)
        entries = [(n, mx_dtype_name(a), tuple(a.shape)) for n, a in dense]
        entries += [(e.name, e.dtype, e.shape) for e in experts]
        with StreamWriter(path, entries, {"format": "mlx"}) as w:
            for n, a in dense:
                w.write(n, mx_to_bytes(a))
            for e in experts:
                w.write(e.name, e.chunks())
        return {
            "file": path.name,
            "bytes": w.size,
            "sha256": w.sha256,
            "tensors": len(entries),
            "quantization": qconfig,
            "header_sha256": w.header_sha256,
            "tensor_sha256": w.tensor_sha256,
        }

    def vision_infos(self) -> list[TensorInfo]:
        """The vision tower's source tensors, carried through as they are."""
        return [self.src.info(s.name) for s in self.specs["vision"]]

    def preflight(self) -> None:
        """Every header entry against the config, and the A_log tails, before any
        byte is written: bad input fails here and leaves the output untouched."""
        expected = {s.name for specs in self.specs.values() for s in specs}
        extra = sorted(set(self.src.weight_map) - expected)
        if extra:
            raise CheckpointError(
                f"{self.src.index_path}: {len(extra)} tensors that config.json does not imply "
                f"(e.g. {extra[:3]}); converting would drop them silently. Is config.json "
                "from this checkpoint?"
            )
        heads = self.tc["linear_attn_config"]["num_heads"]
        checked = {}
        for specs in self.specs.values():
            for s in specs:
                # vision shapes are ours, not Moonshot's: carried as-is, not enforced
                t = self.src.info(s.name, None if s.family == "vision" else s)
                if s.name.endswith("self_attn.A_log"):
                    check_a_log_tail(t, heads)
                checked[s.name] = t
        self._checked = checked

    def _info(self, s: layout.TensorSpec) -> TensorInfo:
        """Where ``s``'s source tensor is: as preflight found and checked it (once is
        enough: 497,220 lookups and checks are ~1.5 s), else looked up and checked now."""
        t = self._checked.get(s.name)
        return self.src.info(s.name, s) if t is None else t

    # -- whole build --------------------------------------------------------------
    def units(self) -> list[str]:
        """Conversion units in order (one output file each)."""
        groups = layout.groups(self.src.config)
        if not self.src.config.get("vision_config") or "vision" not in self.specs:
            groups = [g for g in groups if g != "vision"]
        return groups

    def run(self, progress: bool = True) -> Path:
        if self.experts is not None:
            raise ValueError(
                "an expert subset makes a rank folder, not a build; use "
                "k3dist.pipeline.slicing.slice_rank"
            )
        self.preflight()
        folder = JournaledFolder(self.out, "build", self.ident)
        if folder.open():
            return self.out  # same identity, already complete
        groups = self.units()
        total = sum(s.nbytes for g in groups for s in self.specs.get(g, []))
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
        t0 = time.perf_counter()
        for g in groups:
            if folder.unit(g, lambda g=g: self.convert_unit(g)):
                mx.clear_cache()
            bar.update(sum(s.nbytes for s in self.specs.get(g, [])))
        bar.close()
        self._finish(folder, groups, time.perf_counter() - t0)
        return self.out

    def write_metadata(self, done: dict, groups: list[str]) -> dict[str, str]:
        """Index, config.json and tokenizer files for the finished units ``done``;
        returns {tokenizer file: sha256} of the files copied."""
        weight_map = {}
        for g in groups:
            for name in read_header(self.out / done[g]["file"]).tensors:
                weight_map[name] = done[g]["file"]
        total = sum((self.out / done[g]["file"]).stat().st_size for g in groups)
        write_json_atomic(
            self.out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )

        write_json_atomic(self.out / CONFIG_NAME, self.build_config([done[g] for g in groups]))
        return self.copy_tokenizer(self.out)

    def build_config(self, units: list[dict]) -> dict:
        """config.json of the build whose units carry these ``quantization`` entries."""
        cfg = json.loads(json.dumps(self.src.config))
        # auto_map points at Moonshot's remote code: transformers would prompt for
        # trust_remote_code on load. mlx-lm needs none of it.
        for d in (cfg, cfg.get("text_config", {})):
            d.pop("quantization_config", None)
            d.pop("auto_map", None)
        # the default block applies to no module here: every quantized one has its own
        quant = (
            MXFP4.qconfig()
            if self.bits == 16
            else {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
        )
        for u in units:
            quant.update(u.get("quantization", {}))
        cfg["quantization"] = quant
        return cfg

    def copy_tokenizer(self, out: Path) -> dict[str, str]:
        """The tokenizer files into ``out``; returns {file: sha256}."""
        copied = {}
        for name in TOKENIZER_FILES:
            p = self.src.path / name
            if p.exists():
                shutil.copyfile(p, out / name)
                copied[name] = sha256_file(out / name)
        # K3 ships tiktoken.model + a remote-code tokenizer_config.json: add tokenizer.json,
        # a plain tokenizer_config.json and the chat template, so serving needs nothing else.
        if "tiktoken.model" in copied and "tokenizer.json" not in copied:
            for name in tokenizer.write_hf_tokenizer(self.src.path, out):
                copied[name] = sha256_file(out / name)
        return copied

    def profile(self, done: dict, groups: list[str]) -> dict:
        """The manifest's profile: expert format and non-expert formats; per class, how
        many modules got each format (a group size may drop where columns need it)."""
        if self.nonexpert is None:
            return {
                "experts": "mxfp4 (source bytes)",
                "nonexpert_bits": self.bits,
                "nonexpert_group_size": self.group_size if self.bits < 16 else None,
            }
        used: dict[str, dict[str, int]] = {}
        for g in groups:
            for path, q in done[g].get("quantization", {}).items():
                c = module_class(path)
                if c == "experts":
                    continue
                name = QFormat(q["mode"], q["bits"], q["group_size"]).name
                used.setdefault(c, {}).setdefault(name, 0)
                used[c][name] += 1
        return {
            "experts": "mxfp4 (source bytes)",
            "nonexpert": {c: f.name for c, f in self.nonexpert.items()},
            "nonexpert_modules": used,
            "nonexpert_rule": "a class's format at the largest group size up to the "
            "one asked that divides the columns; else source dtype",
        }

    def _finish(self, folder: JournaledFolder, groups: list[str], seconds: float) -> None:
        done = folder.done
        copied = self.write_metadata(done, groups)
        manifest = {
            "tool": f"k3dist {__version__}",
            "kind": "build",
            "identity": self.ident,
            "build_hash": build_hash(self.ident),
            "source": str(self.src.path.resolve()),
            "profile": self.profile(done, groups),
            "files_by_group": done,
            "files": {
                done[g]["file"]: {"sha256": done[g]["sha256"], "bytes": done[g]["bytes"]}
                for g in groups
            }
            | {n: {"sha256": h} for n, h in copied.items()},
            "seconds": round(seconds, 2),
        }
        folder.finish(manifest)


def convert(
    src: str | Path,
    out: str | Path,
    nonexpert_bits: int = 16,
    group_size: int = 64,
    progress: bool = True,
    nonexpert: str | dict | None = None,
) -> Path:
    """Convert a Moonshot-format K3 folder into an MLX build; resumable. ``nonexpert``:
    a format per non-expert class (``parse_nonexpert``) instead of ``nonexpert_bits``."""
    return Converter(Source(src), Path(out), nonexpert_bits, group_size, nonexpert=nonexpert).run(
        progress
    )


def add_nonexpert_args(ap: argparse.ArgumentParser) -> None:
    """The non-expert format flags (``convert``'s and ``profiles``')."""
    ap.add_argument(
        "--nonexpert-bits",
        type=int,
        default=16,
        choices=(16, 8, 4),
        help="16 keeps source dtypes; 8/4 quantize affine like mlx_lm.convert",
    )
    ap.add_argument("--group-size", type=int, default=64, help="affine group size (8/4-bit)")
    ap.add_argument(
        "--nonexpert",
        metavar="CLASS=FORMAT,...",
        help="a format per non-expert class instead of --nonexpert-bits, e.g. "
        "attention=6bit-g64,shared=8bit-g64,*=bf16 (classes: "
        f"{', '.join(CLASSES)}; unnamed ones keep bf16)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m k3dist.pipeline.convert",
        description="Convert Moonshot's K3 checkpoint to an MLX build (experts mxfp4 "
        "bit-exact), one layer at a time. Low-bit and graded builds: python -m "
        "k3dist.pipeline.profiles.",
    )
    ap.add_argument("--src", required=True, help="Moonshot-format checkpoint folder")
    ap.add_argument("--out", required=True, help="output build folder (resumes if partial)")
    add_nonexpert_args(ap)
    # the profiles moved to their own command; an old command line is told where
    ap.add_argument("--profile", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.profile is not None:
        ap.error(
            f"--profile {args.profile}: build profiles with python -m "
            "k3dist.pipeline.profiles --profile ... (same flags); this command makes the "
            "mxfp4 build"
        )
    try:
        path = convert(
            args.src, args.out, args.nonexpert_bits, args.group_size, nonexpert=args.nonexpert
        )
    except (CheckpointError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
