"""mlx-lm's own ways to run K3, the baselines expert parallelism is compared with:
one process, tensor parallelism (``sharded_load``: ``kimi_k3.Model.shard``) and
pipeline parallelism (``KimiK3TextModel.pipeline``)."""

from __future__ import annotations

from pathlib import Path

from k3dist.bench.collectives import barrier
from k3dist.format import layout
from k3dist.format.folder import load_config
from k3dist.serve import loader

import mlx.core as mx
from mlx_lm.utils import load_model, sharded_load


def load_single(build: str | Path, dtype: str = "float32"):
    """mlx-lm's kimi_k3, whole, in this process."""
    model, config = load_model(Path(build), lazy=True, strict=True)
    model.set_dtype(loader.DTYPES[dtype])
    mx.eval(model.parameters())
    return model, config


def load_tensor_parallel(build: str | Path, group: mx.distributed.Group, dtype: str = "float32"):
    """mlx-lm's own tensor parallelism: ``sharded_load`` (``kimi_k3.Model.shard``)."""
    try:
        model, _, config = sharded_load(str(build), tensor_group=group, return_config=True)
    except ValueError as e:
        tc = layout.text_config(load_config(build))
        raise ValueError(
            f"mlx-lm's kimi_k3 shard() cannot split this build over {group.size()} ranks "
            f"({e}); its experts are split by their intermediate dimension "
            f"({tc['moe_intermediate_size']}), so moe_intermediate_size / {group.size()} must "
            "be a multiple of the quantization group (32 for mxfp4): use a build with wider "
            "experts (the bench preset) or fewer ranks"
        ) from None
    model.set_dtype(loader.DTYPES[dtype])
    mx.eval(model.parameters())
    return model, config


def load_pipeline(build: str | Path, group: mx.distributed.Group, dtype: str = "float32"):
    """mlx-lm's own pipeline parallelism (``model.language_model.model.pipeline``).
    Not ``sharded_load``: it pipelines only models with ``model.model.pipeline``."""
    model, config = load_model(Path(build), lazy=True, strict=True)
    model.language_model.model.pipeline(group)
    model.set_dtype(loader.DTYPES[dtype])
    mx.eval(model.parameters())
    barrier(group)
    return model, config
