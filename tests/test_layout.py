"""The test tree cannot shadow installed packages (pytest must import our test folders as `tests.*` only), and the
package keeps its layers: no import of a layer above, no import circle."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_folder_is_a_package():
    """pytest puts the first folder above a test file that lacks ``__init__.py`` on ``sys.path``; were that
    ``tests/``, its subfolders (``kernels``, ``engine``, ...) would be importable as top-level packages and hide
    installed ones (``tests/kernels``, now ``tests/kernel_tests``, once hid transformers' ``kernels`` dependency)."""
    folders = [TESTS, *(p.parent for p in TESTS.rglob("*.py"))]
    missing = sorted({str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").is_file()})
    assert not missing, f"test folders without __init__.py: {missing}"


def test_no_top_level_module_comes_from_the_test_tree():
    assert str(TESTS) not in [str(Path(p).resolve()) for p in sys.path if p]
    shadowing = sorted(
        name for name, module in list(sys.modules.items())
        if "." not in name and name != "tests" and getattr(module, "__file__", None)
        and Path(module.__file__).resolve().is_relative_to(TESTS)
    )
    assert not shadowing, f"top-level modules imported from tests/: {shadowing}"


def test_no_test_folder_is_named_like_an_installed_module():
    """A test folder named like an importable top-level module (``tests/kernels`` beside the ``kernels``
    distribution) is one missing ``__init__.py`` away from hiding it, and confuses whoever reads a traceback."""
    names = sorted({p.name for p in TESTS.rglob("*") if p.is_dir() and (p / "__init__.py").is_file()})
    clashes = [name for name in names if importlib.util.find_spec(name) is not None]
    assert not clashes, f"test folders named like installed modules: {clashes}"


# ---- the package's own layers -------------------------------------------------------------------------------------

PACKAGE = TESTS.parent / "gpullama"
STACK = ("integrations", "cli", "server", "bench", "llm", "chat", "engine", "model", "ops", "kernels")
"""gpullama's layers, top first (docs/architecture.md): each may import only the ones below it. The modules not
named here (structured, tokenizer, config, checks, ...) are the base: they import none of the first seven."""


def _module_imports() -> dict[str, set[str]]:
    """Every gpullama module and the gpullama modules it imports, read from the source with `ast`: imports inside
    functions and under ``if TYPE_CHECKING:`` count (a lazy import is an import), ``from pkg import name`` counts as
    the submodule ``pkg.name`` when there is one."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]) if node.level \
                    else node.module or ""
                base = base.strip(".")
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target.startswith("gpullama") and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return STACK.index(part) if part in STACK else len(STACK)


def test_no_module_imports_a_layer_above_it():
    graph = _module_imports()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m != "gpullama" for t in targets
                    if _layer(t) < _layer(m) and (_layer(m) < len(STACK) or _layer(t) < STACK.index("model")))
    assert not upward, f"imports of a layer above: {upward}"


def test_the_import_graph_has_no_circle():
    graph = _module_imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"
