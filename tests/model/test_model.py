"""N = 1 reduces to exactly mlx-lm's computation, in both forms."""

from __future__ import annotations

import json

from k3dist.bench.greedy import greedy
from k3dist.format import layout, placement
from k3dist.model.ep import make_model_class

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import kimi_k3
from mlx_lm.utils import load_model
from util import load_f32, prompt_ids


@pytest.mark.parametrize("form", ["placeholder", "local"])
def test_single_rank_is_mlx_lm(mini_build, form):
    tc = layout.text_config(json.loads((mini_build / "config.json").read_text()))
    moe = layout.moe_layers(tc)
    cls = make_model_class(placement.contiguous(tc["num_experts"], 1, moe), 0, None, form)
    ep, _ = load_model(mini_build, get_model_classes=lambda config: (cls, kimi_k3.ModelArgs))
    ep.set_dtype(mx.float32)
    ref, _ = load_f32(mini_build)
    prompt = prompt_ids(tc["vocab_size"], 24)
    t_ep, l_ep = greedy(ep, prompt, 8)
    t_ref, l_ref = greedy(ref, prompt, 8)
    assert t_ep == t_ref
    assert np.array_equal(l_ep, l_ref)
