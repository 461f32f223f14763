"""The package's layers: serving imports the format, config and model layers only, the
build pipeline nothing from serve, no import cycles."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import k3dist
from k3dist.format import manifest
from k3dist.pipeline import convert, slicing

from util import REPO

PACKAGE = REPO / "k3dist"
# what each subpackage may import from k3dist (besides itself and the package root)
MAY_IMPORT = {
    "format": set(),
    # the EP model: mlx-lm's kimi_k3 with the routed experts swapped
    "model": {"format"},
    # the deployment schema and the box: directly above format, beside the model (what
    # both need, e.g. the MoE forms, lives in format), below everything that reads one
    "config": {"format"},
    # the build pipeline runs the model (a block of a graded build: the streamed
    # teacher, calibration), never serving; serving never imports it (SERVING below)
    "pipeline": {"format", "config", "model"},
    "serve": {"format", "config", "model"},
    "factory": {"format", "config", "model", "pipeline"},
    "bench": {"format", "config", "model", "pipeline", "serve", "factory"},
}
# imports up the layers allowed, each inside a function: rank start-up makes the
# embedded default on first use (the serving start-up test below: never at import)
LAZY = {("k3dist.serve.rank", "k3dist.pipeline.default")}
# the bottom layer reads no configuration: these stay out of it
FORMAT_MAY_NOT_IMPORT = ("pydantic", "yaml", "annotated_types")
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
    "k3dist.config",
    "k3dist.config.deployment",
    "k3dist.serve.admission",
    "k3dist.serve.anthropic_api",
    "k3dist.serve.auth",
    "k3dist.serve.exit_codes",
    "k3dist.serve.handler",
    "k3dist.serve.hosts",  # supervise's hosts
    "k3dist.serve.keepawake",
    "k3dist.serve.loader",
    "k3dist.serve.lockstep",
    "k3dist.serve.metrics",
    "k3dist.serve.notices",
    "k3dist.serve.openai_api",
    "k3dist.serve.peer_link",
    "k3dist.serve.peer_process",
    "k3dist.serve.preflight",
    "k3dist.serve.prefix_api",
    "k3dist.serve.prompt_cache",
    "k3dist.serve.relay",
    "k3dist.serve.rank",
    "k3dist.serve.responses_api",
    "k3dist.serve.server",
    "k3dist.serve.status_page",
    "k3dist.serve.supervise",  # a rank announces mlx.launch's temp files (issue 39)
    "k3dist.serve.warmup",
    "k3dist.serve.watchdog",
}


# the size goals: a module with one job fits in this many lines, a function in this many
MODULE_LINES, FUNCTION_LINES = 700, 100
# what is still over them (lines today): to be split by job; none may grow, none be added
OVER = {}


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
            allowed = other in (None, "_blas", layer) or other in MAY_IMPORT[layer]
            if not allowed and (mod, d) not in LAZY:
                wrong.append(f"{mod} imports {d}")
    assert not wrong, wrong


def test_the_format_layer_reads_no_configuration():
    wrong = []
    for path in (PACKAGE / "format").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            wrong += [
                f"{_module(path)}: {n}" for n in names if n.split(".")[0] in FORMAT_MAY_NOT_IMPORT
            ]
    assert not wrong, wrong


def test_config_and_model_sit_side_by_side():
    """Neither imports the other: a deployment is read without the model, and the
    model runs without the configuration's schema (pydantic, yaml)."""
    wrong = sorted(
        f"{m} imports {d}"
        for m, deps in _imports().items()
        for a, b in (("config", "model"), ("model", "config"))
        if m.startswith(f"k3dist.{a}")
        for d in deps
        if d.startswith(f"k3dist.{b}")
    )
    assert not wrong, wrong


def test_the_pipeline_imports_nothing_from_serve():
    wrong = sorted(
        f"{m} imports {d}"
        for m, deps in _imports().items()
        if m.startswith("k3dist.pipeline")
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
    build = convert.convert(k3dist.MINI_K3, tmp_path / "build", progress=False)
    slicing.slice_rank(build, tmp_path / "runs" / "ranks" / "rank0", 0, 2, progress=False)
    code = f"""
import runpy, json, sys
runpy.run_path({str(REPO / "launch" / "serve.py")!r})  # the entry point's imports
from k3dist.serve import loader, rank
dep = rank.parse_args(["--config", {str(REPO / "deploy" / "local.yaml")!r}])
folder = rank.rank_folder(dep, 0, 2)
loader.check_rank_folder(folder, 0, 2)
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
    current build of k3dist/data/mini-k3 in this k3dist's formats; anything else is remade."""
    shipped = k3dist.MINI_K3
    build = convert.convert(shipped, tmp_path / "build", progress=False)
    rank0 = slicing.slice_rank(build, tmp_path / "rank0", 0, 2, progress=False)
    assert manifest.slices_current_build(rank0, shipped)
    # another source (a retrained k3dist/data/mini-k3 looks like this)
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


def test_modules_and_functions_stay_small():
    """No module over MODULE_LINES lines, no function over FUNCTION_LINES, but those in
    OVER, which may only shrink."""
    sizes = {}
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(REPO))
        src = path.read_text()
        sizes[rel] = (src.count("\n"), MODULE_LINES)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                key = f"{rel}:{node.name}"
                sizes[key] = max(n, sizes.get(key, (0, 0))[0]), FUNCTION_LINES
    wrong = {k: n for k, (n, limit) in sizes.items() if n > OVER.get(k, limit)}
    assert not wrong, f"over the size goals (split by job): {wrong}"
