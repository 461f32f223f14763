from __future__ import annotations

from k3dist.factory import synth
from k3dist.pipeline import convert

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


@pytest.fixture(scope="session")
def shared(ranks, tmp_path_factory):
    """serving.SHARED's servers for this process, each started by the first file that
    reads it (see serving.SharedServers)."""
    from serving import SharedServers

    pool = SharedServers(ranks, tmp_path_factory)
    yield pool
    pool.stop()


def _scope_of(path: str) -> str:
    """The xdist work unit of a test file: the files that read one shared server are
    one unit (one worker, one start of it), any other file is its own."""
    from serving import SHARED

    name = path.rsplit("/", 1)[-1]
    for key, (_, readers) in SHARED.items():
        if name in readers:
            return f"shared server {key}"
    return path


# The files that took longest (seconds, setup + calls, at load ~17 on 2 cores): run
# first, so the two workers do not end on one long file while the other idles. A file
# not listed runs after these, in collection order; a stale number only costs time.
SLOW = {
    "shared server text": 400,
    "tests/pipeline/test_pipeline.py": 330,
    "tests/model/test_ep_parity.py": 300,
    "tests/serve/test_server_faults.py": 240,
    "shared server vision": 210,
    "tests/bench/test_bench.py": 185,
    "tests/factory/test_mini_k3.py": 170,
    "tests/serve/test_loader.py": 160,
    "tests/model/test_lo_banks_128.py": 150,
    "tests/model/test_batch.py": 150,
    "tests/serve/test_prefix_restart.py": 140,
    "tests/factory/test_train.py": 140,
    "tests/bench/test_costmodel.py": 130,
    "tests/model/test_banks.py": 120,
    "tests/serve/test_server_abandon.py": 140,
    "tests/serve/test_launch.py": 120,
    "tests/config/test_deployment.py": 85,
    "tests/serve/test_vision.py": 85,
    "tests/serve/test_server_batch.py": 80,
    "tests/serve/test_agent_streams.py": 75,
    "tests/serve/test_two_hosts.py": 120,  # the two-host rig: sshd in two namespaces
}


def pytest_collection_modifyitems(config, items):
    """Slow work units first (SLOW), each unit's tests together and in their order."""
    weight = {}
    for item in items:
        scope = _scope_of(item.nodeid.split("::", 1)[0])
        weight.setdefault(scope, (-SLOW.get(scope, 0), len(weight)))
    items.sort(key=lambda item: weight[_scope_of(item.nodeid.split("::", 1)[0])])


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (pyproject's addopts), with a shared server's readers kept together
    and the work units handed out in collection order (slow first: see SLOW)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # xdist's default: most tests first

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope_of(super()._split_scope(nodeid))

    return SharedServerScheduling(config, log)
