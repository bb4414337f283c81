"""The package's shape (docs/ARCHITECTURE.md): no import circles, project imports at the top of each
file (only the modules that load torch or triton may be imported inside a function), every model
family known to the config, and modules small enough to read in one sitting."""
import ast
from pathlib import Path

import pytest

import handgrad
from handgrad.config import ARCHS
from handgrad.models import FAMILIES, get_family

SRC = Path(handgrad.__file__).parent
# imported lazily, inside functions: they load torch (and triton), optional dependencies
LAZY_MODULES = ("handgrad.torch_ref", "handgrad.backends.gpu")
MAX_LINES = 500


def _modules():
    mods = {}
    for f in sorted(SRC.rglob("*.py")):
        parts = list(f.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(name, path, mods):
    """(target module, line, inside a function?) for every project import in the file."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        else:
            continue
        for t in targets:
            if t.split(".")[0] != "handgrad":
                continue
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is no edge
                out.append((t, node.lineno, id(node) in nested))
                break
    return out


def _cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    mods = _modules()
    edges = {m: {t for t, _, _ in _imports(m, f, mods)} for m, f in mods.items()}
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_project_imports_at_the_top():
    mods = _modules()
    lazy = [f"{f.relative_to(SRC.parent)}:{line} imports {t}" for m, f in mods.items()
            for t, line, inside in _imports(m, f, mods)
            if inside and not t.startswith(LAZY_MODULES)]
    assert lazy == [], "project modules imported inside functions (move them to the top):\n" + "\n".join(lazy)


def test_modules_fit_one_sitting():
    long = {m: n for m, f in _modules().items() if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_family_is_known_to_the_config():
    assert ARCHS == tuple(FAMILIES)
    for arch, family in FAMILIES.items():
        assert family.arch == arch and family.model.__name__
    with pytest.raises(ValueError, match="model.arch: unknown architecture 'nope'"):
        get_family("nope")
