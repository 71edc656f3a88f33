"""The layering rule, checked on the AST of every module of the package.

- Layers point one way: ``utils`` (with the core modules ``coax_utils._x``) at the bottom;
  ``replay`` and ``envs`` on ``utils``; ``sources`` on ``utils`` and ``envs``;
  ``distributed`` on ``replay`` and ``utils``. An import anywhere in a module counts, at
  module level or inside a function.
- The jittable buffers (``replay/_functional.py``) do not import the host buffers.
- No module imports a private name of another module: every ``_x`` part of an imported path
  (a private module, or a private name) must belong to a package that contains the importing
  module (``coax_utils.replay._host`` may be imported inside ``coax_utils.replay``;
  ``coax_utils._checks`` anywhere; ``coax_utils.utils._segment_tree_fn`` only in
  ``coax_utils.utils``).

Two documented exceptions, both name-listed: ``coax_utils.utils.__getattr__`` re-exports
``replay.get_transition_batch`` lazily (coax's name, built on ``TransitionBatch``), and the
checkpoint registry imports the public packages by name with ``importlib.import_module`` to
register their checkpoint types (a string, not an import statement, so outside this check).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import coax_utils

ROOT = pathlib.Path(coax_utils.__file__).parent

# the subpackages each layer may import (besides itself and the core modules coax_utils._x)
ALLOWED = {
    "utils": set(),
    "envs": {"utils"},
    "replay": {"utils"},
    "sources": {"utils", "envs"},
    "distributed": {"utils", "replay"},
}
# the jittable buffers build on no module of the host buffers
_HOST = {"coax_utils.replay._host", "coax_utils.replay._ring", "coax_utils.replay._host_state",
         "coax_utils.replay._folders"}
FORBIDDEN_MODULES = {"coax_utils.replay._functional": _HOST}
# (importing module, enclosing function, imported module): the lazy re-export
EXCEPTIONS = {("coax_utils.utils", "__getattr__", "coax_utils.replay")}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool):
    """(imported dotted path, enclosing function name or None, line) for every import."""
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, func: str | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, child.name)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, func, child.lineno
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    yield f"{base}.{alias.name}", func, child.lineno
            yield from visit(child, func)

    yield from visit(tree, None)


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every breach of the layering rule in ``source``, the code of module ``module``."""
    found = []
    parts = module.split(".")
    layer = parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None
    for target, func, line in _imports(ast.parse(source), module, is_package):
        t = target.split(".")
        where = f"{module}:{line} imports {target}"
        if t[0] != "coax_utils":
            continue
        forbidden = FORBIDDEN_MODULES.get(module, ())
        if any(target == m or target.startswith(m + ".") for m in forbidden):
            found.append(f"{where}: the jittable buffers must not import the host buffers")
        other = t[1] if len(t) > 1 and t[1] in ALLOWED else None
        excepted = any(
            module == m and func == f and (target == x or target.startswith(x + "."))
            for m, f, x in EXCEPTIONS
        )
        if other is not None and other != layer and not excepted and module != "coax_utils":
            if layer is None:  # (the root package imports every subpackage)
                found.append(f"{where}: core modules import no subpackage")
            elif other not in ALLOWED[layer]:
                found.append(f"{where}: layer {layer} may not import {other}")
        package = parts if is_package else parts[:-1]
        for k, part in enumerate(t):
            owner = t[:k]  # the package or module that the private part belongs to
            if part.startswith("_") and not part.startswith("__") and package[:k] != owner:
                found.append(f"{where}: {part} is private to {'.'.join(owner)}")
    return found


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_module_follows_the_layering_rule(path):
    assert violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


def test_every_layer_is_checked():
    names = {module_name(p).split(".")[1] for p in MODULES if module_name(p).count(".") >= 1}
    assert set(ALLOWED) <= names


@pytest.mark.parametrize(
    "module, source, expected",
    [
        # a lower layer importing a higher one, at module level or inside a function
        ("coax_utils.utils._envs", "from coax_utils.replay import TransitionBatch", "layer utils"),
        ("coax_utils.utils._envs", "def f():\n    import coax_utils.sources", "layer utils"),
        ("coax_utils.replay._host", "from coax_utils.sources import ArraySource", "layer replay"),
        ("coax_utils._checks", "from coax_utils.utils import jit", "core modules"),
        ("coax_utils.utils", "def g():\n    from coax_utils import replay", "layer utils"),
        # the jittable buffers and the host buffers
        ("coax_utils.replay._functional", "from coax_utils.replay._host import X", "host"),
        # private names and private modules of other packages or modules
        ("coax_utils.replay._record", "from coax_utils.replay._host import _Ring", "_Ring"),
        ("coax_utils.replay._functional", "from coax_utils.utils._segment_tree_fn import f",
         "_segment_tree_fn"),
        ("coax_utils.sources._array", "from coax_utils.sources import _base", None),
        ("coax_utils.utils._x", "from . import _y", None),
        ("coax_utils.utils._x", "from ..replay import _host", "_host"),
        ("coax_utils.replay._x", "from coax_utils._checks import _private", "_private"),
        ("coax_utils.replay._x", "from coax_utils._checks import check_int", None),
    ],
)
def test_the_checker_catches_breaches(module, source, expected):
    found = violations(source, module)
    if expected is None:
        assert found == []
    else:
        assert found and all(expected in f or "layer" in f for f in found), found
        assert any(expected in f for f in found), found
