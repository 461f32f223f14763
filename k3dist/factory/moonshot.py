"""The one writer of Moonshot's source checkpoint layout, shared by ``synth`` (random
weights) and ``train`` (a trained mini-K3's export): one shard per decoder layer like
the real checkpoint, then the head, the projector and the vision tower; the index and
``config.json`` beside them. Each caller supplies only the bytes of each tensor."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from k3dist.format import layout
from k3dist.format.folder import CONFIG_NAME, INDEX_NAME
from k3dist.format.sfile import StreamWriter

from tqdm import tqdm


def shard_names(tc: dict) -> dict[str, str]:
    """Group -> shard file, as the real checkpoint: layer L in shard L+1, then the
    head (embeddings, norm, output AttnRes, lm_head), the projector, the vision tower."""
    n = tc["num_hidden_layers"] + 3

    def name(i: int) -> str:
        return f"model-{i:05d}-of-{n:06d}.safetensors"

    out = {f"layer.{i}": name(i + 1) for i in range(tc["num_hidden_layers"])}
    out.update(head=name(n - 2), projector=name(n - 1), vision=name(n))
    return out


def files_of(cfg: dict) -> dict[str, list[layout.TensorSpec]]:
    """Shard file -> the tensors it holds, in writing order: the checkpoint's layout
    (for the ``k3counts`` preset, the real index's key -> shard map exactly)."""
    files = shard_names(layout.text_config(cfg))
    by_file: dict[str, list[layout.TensorSpec]] = {}
    for s in layout.source_specs(cfg):
        key = "projector" if s.name.startswith("mm_projector.") else s.group
        by_file.setdefault(files[key], []).append(s)
    return by_file


def write_source(
    out: str | Path, cfg: dict, data: Callable[[layout.TensorSpec], bytes], desc: str | None = None
) -> Path:
    """Write every tensor of ``cfg``'s source layout (``data(spec)``: its raw bytes, in
    the spec's dtype and shape), the index and ``config.json`` into ``out``; a progress
    bar titled ``desc`` when given. Tokenizer files are the caller's."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    by_file = files_of(cfg)
    weight_map, total = {}, 0
    bar = tqdm(
        total=sum(s.nbytes for v in by_file.values() for s in v),
        unit="B",
        unit_scale=True,
        desc=desc,
        disable=desc is None,
    )
    for fname, specs in by_file.items():
        entries = [(s.name, s.dtype, s.shape) for s in specs]
        with StreamWriter(out / fname, entries, {"format": "pt"}) as w:
            for s in specs:
                w.write(s.name, data(s))
                weight_map[s.name] = fname
                total += s.nbytes
                bar.update(s.nbytes)
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    return out
