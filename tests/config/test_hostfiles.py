"""The shipped hostfiles parse with mlx.launch's own parser and say what they claim."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx._distributed_utils.common import Hostfile

HOSTFILES = Path(__file__).resolve().parents[2] / "hostfiles"


@pytest.mark.parametrize(
    "name,backend,n",
    [
        ("local.json", "", 2),
        ("tb5.json", "ring", 2),
        ("tb5-jaccl.json", "jaccl", 2),
        ("tb5-3.json", "ring", 3),
        ("tb5-4.json", "ring", 4),
        ("tb5-3-jaccl.json", "jaccl", 3),
        ("tb5-4-jaccl.json", "jaccl", 4),
    ],
)
def test_hostfile_parses(name, backend, n):
    h = Hostfile.from_file(HOSTFILES / name)
    assert len(h.hosts) == n and h.backend == backend
    assert all(x.ips for x in h.hosts)  # ring and jaccl both need rank 0's IP
    if backend == "jaccl":  # mlx.launch's own rule: null for self, a device per peer
        assert all(x.rdma[i] is None and len(x.rdma) == n for i, x in enumerate(h.hosts))
        # a mesh: a cable (a device) between every pair, each to its own port
        for i, x in enumerate(h.hosts):
            peers = [d for j, d in enumerate(x.rdma) if j != i]
            assert all(peers) and len(set(peers)) == n - 1, (name, i, x.rdma)
    if backend == "ring" and n > 2:  # one point-to-point address per host, all distinct
        assert all(len(x.ips) == 1 for x in h.hosts)
        assert len({x.ips[0] for x in h.hosts}) == n
    assert len({x.ssh_hostname for x in h.hosts}) == (1 if name == "local.json" else n)
    if name == "local.json":
        assert {x.ssh_hostname for x in h.hosts} == {"127.0.0.1"}
