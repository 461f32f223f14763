"""The package's layers: serving imports the format and model layers only, build nothing
from serve, no import cycles."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import k3dist
from k3dist.build import convert, slicing
from k3dist.format import manifest

from util import REPO

PACKAGE = REPO / "k3dist"
# what each subpackage may import from k3dist (besides itself and the package root)
MAY_IMPORT = {
    "format": set(),
    # the EP model: mlx-lm's kimi_k3 with the routed experts swapped
    "model": {"format"},
    # build runs the model (a block of a graded build: the streamed teacher,
    # calibration), never serving; serving never imports build (SERVING below)
    "build": {"format", "model"},
    "serve": {"format", "model"},
    "factory": {"format", "model", "build"},
    "bench": {"format", "model", "build", "serve", "factory"},
}
# launch/serve.py with its rank folder in place, in a fresh interpreter: exactly these
SERVING = {
    "k3dist",
    "k3dist._blas",
    "k3dist.format",
    "k3dist.format.folder",
    "k3dist.format.graded",
    "k3dist.format.kvmemory",
    "k3dist.format.layout",
    "k3dist.format.manifest",
    "k3dist.format.placement",
    "k3dist.format.sfile",
    "k3dist.format.verify",
    "k3dist.model",
    "k3dist.model.attention",
    "k3dist.model.compat",
    "k3dist.model.ep",
    "k3dist.model.experts",
    "k3dist.model.forms",
    "k3dist.model.group",
    "k3dist.model.two_bank",
    "k3dist.serve",
    "k3dist.serve.anthropic_api",
    "k3dist.serve.auth",
    "k3dist.serve.exit_codes",
    "k3dist.format.deployment",
    "k3dist.serve.keepawake",
    "k3dist.serve.loader",
    "k3dist.serve.lockstep",
    "k3dist.serve.metrics",
    "k3dist.serve.notices",
    "k3dist.serve.openai_api",
    "k3dist.serve.preflight",
    "k3dist.serve.prompt_cache",
    "k3dist.serve.relay",
    "k3dist.serve.responses_api",
    "k3dist.serve.server",
    "k3dist.serve.status_page",
    "k3dist.serve.supervise",  # a rank announces mlx.launch's temp files (issue 39)
    "k3dist.serve.warmup",
    "k3dist.serve.watchdog",
}


def _module(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """k3dist module -> the k3dist modules it imports (anywhere in the file)."""
    names = {_module(p) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                out |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                    for a in node.names
                }
        graph[_module(path)] = {m for m in out if m in names}
    return graph


def test_each_layer_imports_only_the_layers_below():
    wrong = []
    for mod, deps in _imports().items():
        layer = mod.split(".")[1] if mod.count(".") else None
        if layer not in MAY_IMPORT:
            continue
        for d in deps:
            other = d.split(".")[1] if d.count(".") else None
            if other not in (None, "_blas", layer) and other not in MAY_IMPORT[layer]:
                wrong.append(f"{mod} imports {d}")
    assert not wrong, wrong


def test_build_imports_nothing_from_serve():
    wrong = sorted(
        f"{m} imports {d}"
        for m, deps in _imports().items()
        if m.startswith("k3dist.build")
        for d in deps
        if d.startswith("k3dist.serve")
    )
    assert not wrong, wrong


def test_no_module_imports_another_ones_private_names():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("k3dist."):
                wrong += [
                    f"{_module(path)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not wrong, wrong


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d == m or d == "k3dist":
                continue
            assert state.get(d) != 1, " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_serving_entry_point_imports_the_format_layer_only(tmp_path):
    # the embedded default's rank folder already in place (cwd-relative runs/ranks/rank0)
    build = convert.convert(k3dist.DATA_DIR / "mini-k3", tmp_path / "build", progress=False)
    slicing.slice_rank(build, tmp_path / "runs" / "ranks" / "rank0", 0, 2, progress=False)
    code = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("serve_entry", {str(REPO / "launch" / "serve.py")!r})
serve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve)
dep = serve.parse_args(["--config", {str(REPO / "deploy" / "local.yaml")!r}])
folder = serve.rank_folder(dep, 0, 2)
serve.loader.check_rank_folder(folder, 0, 2)
print(json.dumps(sorted(m for m in sys.modules if m == "k3dist" or m.startswith("k3dist."))))
"""
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert loaded == SERVING, {
        "extra": sorted(loaded - SERVING),
        "missing": sorted(SERVING - loaded),
    }


def test_a_stale_default_cache_is_not_trusted(mini_src, mini_build, tmp_path):
    """launch/serve.py serves a cached default rank folder only while it slices the
    current build of data/mini-k3 in this k3dist's formats; anything else is remade."""
    shipped = k3dist.DATA_DIR / "mini-k3"
    build = convert.convert(shipped, tmp_path / "build", progress=False)
    rank0 = slicing.slice_rank(build, tmp_path / "rank0", 0, 2, progress=False)
    assert manifest.slices_current_build(rank0, shipped)
    # another source (a retrained data/mini-k3 looks like this)
    other = slicing.slice_rank(mini_build, tmp_path / "other", 0, 2, progress=False)
    assert not manifest.slices_current_build(other, shipped)
    assert not manifest.slices_current_build(rank0, mini_src)
    # an older rank-folder format
    mp = rank0 / manifest.MANIFEST
    m = json.loads(mp.read_text())
    m["identity"]["format_version"] = manifest.RANK_FORMAT_VERSION - 1
    mp.write_text(json.dumps(m))
    assert not manifest.slices_current_build(rank0, shipped)
    # an incomplete folder, or none
    assert not manifest.slices_current_build(tmp_path / "missing", shipped)
