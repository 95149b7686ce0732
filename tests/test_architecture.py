"""The shape of the house: the layer contract, no import cycles, and no stale names.

* the import-linter contract in ``pyproject.toml`` holds (a lower layer never imports a
  higher one, imports inside functions included), and its layers are the ones
  ``specviz/__init__``'s docstring draws;
* no two specviz modules import each other through a cycle;
* every dotted ``specviz.`` name in a docstring, the README or a notebook cell resolves to a
  module or an attribute of one.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import specviz
from specviz.locations import REPO_ROOT

PACKAGE = Path(specviz.__file__).resolve().parent


def _layers() -> list[str]:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return contract["layers"]


def _lint(config: Path) -> "subprocess.CompletedProcess":
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def test_the_layer_contract_holds():
    done = _lint(REPO_ROOT / "pyproject.toml")
    assert done.returncode == 0, f"the layer contract is broken:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"


def test_the_contract_check_fails_on_an_upward_import(tmp_path):
    config = tmp_path / "upside-down.toml"
    config.write_text('[tool.importlinter]\nroot_package = "specviz"\n\n[[tool.importlinter.contracts]]\n'
                      'name = "tree above decode"\ntype = "layers"\ncontainers = ["specviz"]\n'
                      'layers = ["tree", "decode"]\n')
    done = _lint(config)
    assert done.returncode != 0 and "specviz.decode" in done.stdout


def test_the_package_docstring_draws_the_contract_s_layers():
    doc = specviz.__doc__
    drawn = re.findall(r"^\s*(\d+)\.\s+``([^`]+)``", doc, re.M)
    assert [int(n) for n, _ in drawn] == list(range(1, len(drawn) + 1)), "layers numbered 1, 2, ... from the top"
    names = [" | ".join(part.strip() for part in layer.split("|")) for _, layer in drawn]
    assert names == _layers(), "specviz/__init__'s layer list and pyproject.toml's contract differ"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):  # every import, inside functions too
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                dep = owner(target) if target.startswith("specviz") else None
                # a package's __init__ re-exporting its own modules is not a cycle of theirs
                if dep and dep != mod and not dep.startswith(mod + "."):
                    graph[mod].add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, deps in graph.items() for b in deps])
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def test_no_import_cycles():
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = _import_graph()
    graph["specviz.tree.core"].add("specviz.decode.engine")  # decode already reaches tree.core
    assert any("specviz.tree.core" in c and "specviz.decode.engine" in c for c in _cycles(graph))


_DOTTED = re.compile(r"(?<![\w./-])specviz(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
#: file names such as ``specviz.json`` are not dotted names
_FILE_SUFFIXES = {"json", "jsonl", "csv", "md", "py", "ipynb", "cpp"}


def _texts():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield f"{path.relative_to(REPO_ROOT)}:{getattr(node, 'lineno', 1)}", doc
    yield "README.md", (REPO_ROOT / "README.md").read_text()
    for nb in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            yield f"{nb.relative_to(REPO_ROOT)} cell {i}", "".join(cell["source"])


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute (chain) of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            if not hasattr(obj, attr) and attr not in fields:
                return False
            obj = getattr(obj, attr, None)
        return True
    return False


def test_every_dotted_specviz_name_resolves():
    stale = sorted({(where, name) for where, text in _texts() for name in _DOTTED.findall(text)
                    if name.rpartition(".")[2] not in _FILE_SUFFIXES and not resolves(name)})
    assert not stale, "names that do not resolve:\n" + "\n".join(f"{w}: {n}" for w, n in stale)


@pytest.mark.parametrize("name, ok", [("specviz.tree.core.DraftTree", True), ("specviz.tree.DraftTree.parents", True),
                                      ("specviz.drafters", False), ("specviz.tree.core.NoSuchThing", False)])
def test_the_resolver_tells_stale_names(name, ok):
    assert resolves(name) is ok


#: the house's size limits: no module over this many lines, no function over that many
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def _oversized(paths) -> list[str]:
    found = []
    for path in paths:
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_or_function_is_oversized():
    assert _oversized(sorted(PACKAGE.rglob("*.py"))) == []


def test_the_size_check_finds_a_long_module_and_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text("def f():\n" + body + "\n" + "\n" * MAX_MODULE_LINES)
    assert [line.split(":")[0] for line in _oversized([tmp_path / "long.py"])] == ["long.py", "long.py"]
