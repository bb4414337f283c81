"""The package's shape (docs/ARCHITECTURE.md): every import runs down the layers, no import circles,
project imports at the top of each file (only the modules that load torch or triton may be imported
inside a function), no module reading another's underscore names, every model family known to the
config, and modules small enough to read in one sitting (a warning, not a failure)."""
import ast
import warnings
from pathlib import Path

import pytest

import handgrad
from handgrad.config import ARCHS
from handgrad.models import FAMILIES, get_family

SRC = Path(handgrad.__file__).parent
# imported lazily, inside functions: they load torch (and triton), optional dependencies
LAZY_MODULES = ("handgrad.torch_ref", "handgrad.backends.gpu")
MAX_LINES = 500
# docs/ARCHITECTURE.md's layers, bottom first, by module prefix; a module is in the layer of its
# longest matching prefix, so training/command.py, data/prepare.py and interop/convert.py are commands
# (they may import anything), not training, data and interop; eval's tasks and scorer sit below
# training (train.eval_tasks scores with them), eval/command.py is the command. Beside the layers, unranked: machine,
# torch, torch_ref and the package's __init__ (the public names).
COMMANDS = ("handgrad.__main__", "handgrad.cli", "handgrad.sample", "handgrad.chat_cli", "handgrad.serve",
            "handgrad.verify", "handgrad.bench", "handgrad.training.command", "handgrad.data.prepare", "handgrad.interop.convert",
            "handgrad.eval.command")
LAYERS = (("config, files", ("handgrad.config", "handgrad.config_keys", "handgrad.presets", "handgrad.files")),
          ("ops", ("handgrad.backends",)),
          ("model family", ("handgrad.models",)),
          ("data, interop, eval", ("handgrad.data", "handgrad.interop", "handgrad.eval")),
          ("training", ("handgrad.training",)),
          ("commands", COMMANDS))


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


def _layer(module):
    """The index in LAYERS of the module's layer, or None for a module beside them."""
    found = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else None


def _upward(edges):
    """(module, target, line) for every import of a module in a higher layer than the importer's."""
    return [(m, t, line) for m, targets in edges.items() if (below := _layer(m)) is not None
            for t, line in targets if (above := _layer(t)) is not None and above > below]


def test_imports_run_down_the_layers():
    mods = _modules()
    assert [p for _, prefixes in LAYERS for p in prefixes if p not in mods] == []  # no layer names a lost module
    edges = {m: [(t, line) for t, line, _ in _imports(m, f, mods)] for m, f in mods.items()}
    up = [f"{mods[m].relative_to(SRC.parent)}:{line} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
          for m, t, line in _upward(edges)]
    assert up == [], "imports up the layers (move what is imported down, or the importer up):\n" + "\n".join(up)


def test_layer_check_finds_an_upward_import():
    edges = {"handgrad.interop.hf": [("handgrad.training.optim", 1), ("handgrad.models.gpt2", 2)],
             "handgrad.data.chat": [("handgrad.sample", 3), ("handgrad.data.prepare", 4)],
             "handgrad.models.llama": [("handgrad.interop.common", 5), ("handgrad.backends.cpu", 6)],
             "handgrad.config": [("handgrad.models", 7)],
             "handgrad.interop.convert": [("handgrad.training.optim", 8)],  # a command
             "handgrad.training.trainer": [("handgrad.interop.load", 9), ("handgrad.torch_ref", 10)],
             "handgrad.machine": [("handgrad.backends.cpu.blas", 11)]}  # beside the layers
    assert _upward(edges) == [("handgrad.interop.hf", "handgrad.training.optim", 1),
                              ("handgrad.data.chat", "handgrad.sample", 3),
                              ("handgrad.data.chat", "handgrad.data.prepare", 4),
                              ("handgrad.models.llama", "handgrad.interop.common", 5),
                              ("handgrad.config", "handgrad.models", 7)]


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


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(name, is_pkg, source, mods):
    """(line, what) for every use of another project module's underscore name: imported
    (`from handgrad.x import _y`) or read off the module (`x._y`). Dunders pass, and so does a
    private submodule (`from . import _x`)."""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    tree = ast.parse(source)
    modules, found = {}, []  # local name -> the project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "handgrad":
                continue
            for a in node.names:
                if f"{mod}.{a.name}" in mods:
                    modules[a.asname or a.name] = f"{mod}.{a.name}"
                elif _private(a.name):
                    found.append((node.lineno, f"from {mod} import {a.name}"))
        elif isinstance(node, ast.Import):
            modules.update({a.asname: a.name for a in node.names if a.asname and a.name in mods})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and modules.get(node.value.id, name) != name):
            found.append((node.lineno, f"{modules[node.value.id]}.{node.attr}"))
    return sorted(found)


def test_no_module_reads_another_modules_underscore_names():
    """A name another module needs is public in its own; an underscore name stays in its file."""
    mods = _modules()
    found = [f"{f.relative_to(SRC.parent)}:{line} uses {what}" for m, f in mods.items()
             for line, what in _private_uses(m, f.name == "__init__.py", f.read_text(), mods)]
    assert found == [], "another module's underscore names (make them public there, or drop the use):\n" + \
        "\n".join(found)


def test_underscore_check_finds_a_private_import():
    mods = {"handgrad.backends.cpu", "handgrad.backends.cpu.blas", "handgrad.backends.cpu._fast",
            "handgrad.backends.cpu.attention"}
    source = ("from . import _fast, blas\n"
              "from .blas import __all__, _PATH, gemm\n"
              "from handgrad.backends.cpu.blas import (\n    _one_openmp)\n"
              "import handgrad.backends.cpu.blas as b\n"
              "x = blas._PATH, b._lib, blas.__name__, blas.gemm, _fast._x, self._y\n"
              "def f():\n    from .blas import _late\n")
    assert _private_uses("handgrad.backends.cpu.attention", False, source, mods) == [
        (2, "from handgrad.backends.cpu.blas import _PATH"),
        (3, "from handgrad.backends.cpu.blas import _one_openmp"),
        (6, "handgrad.backends.cpu._fast._x"),
        (6, "handgrad.backends.cpu.blas._PATH"),
        (6, "handgrad.backends.cpu.blas._lib"),
        (8, "from handgrad.backends.cpu.blas import _late")]


def test_modules_fit_one_sitting():
    """A module past MAX_LINES is named in a warning, not failed: it is split where the code has a
    seam, never squeezed under a number."""
    long = {m: n for m, f in _modules().items() if (n := len(f.read_text().splitlines())) > MAX_LINES}
    if long:
        warnings.warn(f"modules over {MAX_LINES} lines (split them where the code has a seam): "
                      + ", ".join(f"{m} ({n})" for m, n in sorted(long.items())))


def test_every_family_is_known_to_the_config():
    assert ARCHS == tuple(FAMILIES)
    for arch, family in FAMILIES.items():
        assert family.arch == arch and family.model.__name__
    with pytest.raises(ValueError, match="model.arch: unknown architecture 'nope'"):
        get_family("nope")
