"""The private mlx-lm names k3dist relies on are all still there."""

from __future__ import annotations

from k3dist.serve import compat

import mlx.core as mx
from mlx_lm import server as mlx_server


def test_every_private_mlx_lm_name_is_there():
    gone = compat.missing()
    assert not gone, (
        "mlx-lm changed: k3dist relies on these private names, now gone: "
        + "; ".join(gone)
        + ". Adapt k3dist.serve.compat and its users."
    )


def test_missing_names_a_name_that_is_gone(monkeypatch):
    monkeypatch.setitem(
        compat.PRIVATE,
        "mlx_lm.server:ResponseGenerator._gone_in_mlx_lm",
        "a name a future mlx-lm dropped",
    )
    assert compat.missing() == [
        "mlx_lm.server:ResponseGenerator._gone_in_mlx_lm (a name a future mlx-lm dropped)"
    ]
    monkeypatch.setitem(compat.PRIVATE, "mlx_lm.server:NoSuchClass.x", "gone too")
    assert "mlx_lm.server:NoSuchClass.x (gone too)" in compat.missing()


def test_holds_request_reads_the_generators_rank():
    gen = object.__new__(mlx_server.ResponseGenerator)
    for rank, dist, holds in ((0, True, True), (1, True, False), (0, False, True)):
        gen._rank, gen._is_distributed = rank, dist
        assert compat.holds_request(gen) is holds


def test_group_expert_select_routes_top_k():
    scores = mx.array([[0.0, 3.0, -1.0, 2.0]])
    inds, w = compat.group_expert_select(scores, mx.zeros((4,)), 2, 1, 1, 1.0, True)
    assert sorted(inds.tolist()[0]) == [1, 3]
    assert abs(float(w.sum()) - 1.0) < 1e-6
