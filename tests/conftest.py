from __future__ import annotations

from k3dist.build import convert
from k3dist.factory import synth

# conftest imports k3dist before any test module imports mlx (OpenBLAS preload).
import pytest


@pytest.fixture(scope="session")
def mini_src(tmp_path_factory):
    """One mini-K3 source checkpoint for the session (read-only: copy to corrupt)."""
    return synth.synthesize(tmp_path_factory.mktemp("src") / "mini", "mini", seed=0, progress=False)


@pytest.fixture(scope="session")
def mini_build(mini_src, tmp_path_factory):
    return convert.convert(mini_src, tmp_path_factory.mktemp("build") / "mini", progress=False)


@pytest.fixture(scope="session")
def ranks(mini_build, tmp_path_factory):
    """The mini build sliced for 2 ranks (``rank{rank}`` pattern), for the servers to read."""
    from serving import rank_folders

    return rank_folders(mini_build, tmp_path_factory.mktemp("serve-ranks"))
