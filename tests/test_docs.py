"""docs/architecture.md names only what exists: every file it cites is in the tree, every ``gpullama.`` name it
cites imports, and every name of ours it cites (``Class``, ``Class.member``, ``module.name``) is defined in the
package. A rename or a deletion that forgets the map fails here."""

from __future__ import annotations

import ast
import importlib
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpullama"
DOC = ROOT / "docs" / "architecture.md"
MODULES = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()} | {"ops"}

# names the map cites that belong to other projects or to the wire format, not to gpullama
EXTERNAL = {
    "CORSMiddleware", "TrustedHostMiddleware", "PrefixCacheAffinityRouter", "TCPStore", "SchedulerOutput",
    "ValueError", "init_process_group", "GGUFReader",
}


def _cited(text: str) -> list[str]:
    return sorted(set(re.findall(r"`([^`\n]+)`", text)))


def _defined_names() -> set[str]:
    """Every class, function, attribute (``self.x = ``, ``x: T``, ``x = ``) and module name of the package."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names.add(path.stem)
        names.add(path.parent.name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    names |= set(re.findall(r"\b(gl_\w+)\s*\(", (PACKAGE / "kernels" / "cpu_native.c").read_text()))
    return names


def _files() -> list[str]:
    """Every file and folder of the checkout, relative to its root (the environment and build folders left out)."""
    found = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in (".git", ".venv", "build", "__pycache__")]
        base = Path(folder).relative_to(ROOT)
        found += [str(base / name) for name in names + subfolders]
    return found


def missing_files(text: str) -> list[str]:
    files = _files()
    missing = []
    for token in _cited(text):
        path = token.split(" ")[0].rstrip("/")
        path = re.sub(r"(\.py)\.\w+$", r"\1", path)  # `engine/kv_events.py.KVEventPublisher`
        if re.fullmatch(r"[\w./-]+\.(py|c|md|sh)", path) or (re.fullmatch(r"[a-z_]+(/[a-z_]+)+", path)):
            if not any(f == path or f.endswith("/" + path) or f.endswith("/" + path + ".py") for f in files):
                missing.append(token)
    return missing


def missing_imports(text: str) -> list[str]:
    missing = []
    for token in _cited(text):
        if not re.fullmatch(r"gpullama(\.\w+)+", token):
            continue
        parts = token.split(".")
        for k in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:k]))
            except ImportError:
                continue
            try:
                for part in parts[k:]:
                    obj = getattr(obj, part)
            except AttributeError:
                missing.append(token)
            break
    return missing


def missing_names(text: str, defined: set[str]) -> list[str]:
    missing = []
    for token in _cited(text):
        name = re.sub(r"\(.*\)$|\[.*?\]", "", token)  # `ops.attention(..., sinks)`, `drafts[i]`
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name) or name.startswith("gpullama.") \
                or re.search(r"\.(py|c|md)$", name):
            continue
        parts = name.split(".")
        # ours: a class of ours (`ScheduledBatch`, `LLMEngine.admit`) or a module of ours (`ops.attention`)
        ours = parts[0] in defined and (parts[0][0].isupper() or parts[0] in MODULES)
        if not ours:  # a bare lower-case word is prose (a field, a flag's value); a CamelCase one must be ours
            if len(parts) == 1 and parts[0][0].isupper() and "_" not in parts[0] and parts[0] not in EXTERNAL \
                    and not parts[0].isupper():
                missing.append(token)
            continue
        missing += [token for part in parts[1:] if part not in defined]
    return missing


def test_the_architecture_map_cites_only_what_exists():
    text = DOC.read_text()
    assert not missing_files(text), f"files that are not there: {missing_files(text)}"
    assert not missing_imports(text), f"gpullama names that do not import: {missing_imports(text)}"
    missing = missing_names(text, _defined_names())
    assert not missing, f"names the package does not define: {missing}"


def test_the_checks_catch_stale_citations():
    """Names this codebase once had and lost, cited the way the map cites things, are each caught."""
    stale = ("`WorkerSpec` and `LLM.run_headless_node` in `engine/tp_workers.py`, `EngineStats.acceptance_rate`, "
             "`gpullama.llm.run_headless_node`, `server/tokenization.py`, `gpullama.server.fields`")
    assert missing_names(stale, _defined_names()) == ["EngineStats.acceptance_rate", "LLM.run_headless_node",
                                                      "WorkerSpec"]
    assert missing_imports(stale) == ["gpullama.llm.run_headless_node", "gpullama.server.fields"]
    assert missing_files(stale) == ["server/tokenization.py"]
