"""The package's import graph has no cycle, and its layers hold. Every
import counts, the ones inside functions too: a lazy import only hides a
cycle (or a layer crossed) from the interpreter, not from the reader. Read
with ast from the source, nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trajserve"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in the file)."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                # `from a import b`: the module a.b if there is one, else a itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:  # `import a.b.c` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle(tmp_path):
    pkg = tmp_path / "trajserve"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from trajserve.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import x\n")
    (pkg / "c.py").write_text("import trajserve.a\nx = 1\n")
    (pkg / "d.py").write_text("from trajserve import a, c\n")
    g = import_graph(pkg)
    assert g["trajserve.d"] == {"trajserve.a", "trajserve.c"}
    assert cycles(g) == [["trajserve.a", "trajserve.c", "trajserve.sub.b"]]


@pytest.mark.parametrize("root", [PACKAGE], ids=["trajserve"])
def test_the_package_has_no_import_cycle(root):
    found = cycles(import_graph(root))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_module_is_small_and_says_what_it_owns():
    """No module over 500 lines (split by concern instead), and each non-empty
    one opens with a docstring saying what it owns."""
    long, silent = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long.append(f"{path.relative_to(PACKAGE)}: {len(text.splitlines())} lines")
        if text.strip() and not ast.get_docstring(ast.parse(text)):
            silent.append(str(path.relative_to(PACKAGE)))
    assert not long, long
    assert not silent, silent


# package -> the packages it must never import (anywhere in it, lazily or not).
LAYERS = {
    "model": {"kv", "engine", "sessions", "server", "sim", "bench", "cluster", "commands", "speculative"},
    "lora": {"engine", "sessions", "server", "sim", "bench", "cluster", "commands", "speculative"},
    "kv": {"engine", "sessions", "server", "sim", "bench", "cluster", "commands", "speculative"},
    "plan": {"engine", "kv", "sessions", "server", "sim", "bench", "cluster", "commands", "speculative", "lora"},
    "speculative": {"engine", "sessions", "server", "sim", "bench", "cluster", "commands"},
    "engine": {"sessions", "server", "sim", "bench", "cluster", "commands"},
    "sessions": {"server", "sim", "bench", "cluster", "commands"},
    "sim": {"server", "bench", "commands"},
    "server": {"cluster", "bench", "sim", "commands"},
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def crossings(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if _package(d) in layers.get(_package(m), ()))


def test_the_checker_finds_a_layer_crossed(tmp_path):
    pkg = tmp_path / "trajserve"
    for sub in ("model", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "a.py").write_text("def f():\n    from trajserve.engine import b\n")
    (pkg / "engine" / "b.py").write_text("from trajserve.model import a\n")
    assert crossings(import_graph(pkg)) == ["trajserve.model.a -> trajserve.engine.b"]


def test_the_layers_hold():
    found = crossings(import_graph())
    assert not found, "layers crossed:\n" + "\n".join(found)
