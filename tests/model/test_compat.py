"""The private mlx-lm names k3dist relies on are all still there, and all are listed."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from k3dist.model import compat

import mlx.core as mx
import mlx_lm
from mlx_lm import server as mlx_server

PKG = Path(compat.__file__).parents[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _mlx_lm_definitions() -> set[str]:
    """Every private name mlx-lm defines: functions, classes, module and instance attributes."""
    names: set[str] = set()
    for f in Path(mlx_lm.__file__).parent.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
    return {n for n in names if _private(n)}


def _mlx_lm_bases(module: str, name: str) -> list[type]:
    """The mlx-lm classes k3dist's class ``module.name`` derives from (none: [])."""
    cls = getattr(importlib.import_module(module), name, None)
    if not inspect.isclass(cls):
        return []
    return [b for b in cls.__mro__[1:] if b.__module__.startswith("mlx_lm")]


def _scan(tree: ast.AST, module: str, rel: str, used: dict, own: set) -> None:
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = _mlx_lm_bases(module, cls.name)
        for item in cls.body:
            if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if any(item.name in vars(b) for b in bases):
                used.setdefault(item.name, set()).add(rel)  # overrides mlx-lm's
            else:
                own.add(item.name)
        if not bases:  # self._x set in a class of k3dist's own is its own name
            for n in ast.walk(cls):
                if (
                    isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                ):
                    own.add(n.attr)
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name not in used:
            own.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "add_argument"
        ):  # an option's dest is k3dist's own name
            for a in n.args:
                if isinstance(a, ast.Constant) and str(a.value).startswith("--"):
                    own.add(str(a.value)[2:].replace("-", "_"))
        elif isinstance(n, ast.Attribute):
            used.setdefault(n.attr, set()).add(rel)
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("mlx_lm"):
            for alias in n.names:
                used.setdefault(alias.name, set()).add(rel)


def private_names_in_use() -> dict[str, set[str]]:
    """The private mlx-lm names k3dist's code reaches, derived from the code: attributes it
    reads or sets that mlx-lm defines and k3dist does not, names it imports from mlx_lm, and
    private methods of mlx-lm classes that k3dist's subclasses override. name -> files."""
    used: dict[str, set[str]] = {}
    own: set[str] = set()
    for f in sorted(PKG.rglob("*.py")):
        rel = str(f.relative_to(PKG.parent))
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        _scan(ast.parse(f.read_text()), module, rel, used, own)
    theirs = _mlx_lm_definitions()
    return {k: v for k, v in used.items() if _private(k) and k in theirs and k not in own}


def test_every_private_mlx_lm_name_in_use_is_listed():
    listed = {path.rsplit(".", 1)[-1].rsplit(":", 1)[-1] for path in compat.PRIVATE}
    unlisted = {k: sorted(v) for k, v in private_names_in_use().items() if k not in listed}
    assert not unlisted, (
        f"k3dist uses private mlx-lm names that k3dist.model.compat.PRIVATE does not list: "
        f"{unlisted}. Add each there (module:Class.name -> what k3dist uses it for)."
    )


def test_the_scan_finds_known_uses():
    found = private_names_in_use()
    # one of each kind: an override, an attribute read, a name imported through compat
    assert "_is_batchable" in found and "_trie" in found and "_group_expert_select" in found
    assert "_fail" not in found  # k3dist's own method on its mlx-lm subclass


def test_every_private_mlx_lm_name_is_there():
    gone = compat.missing()
    assert not gone, (
        "mlx-lm changed: k3dist relies on these private names, now gone: "
        + "; ".join(gone)
        + ". Adapt k3dist.model.compat and its users."
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
