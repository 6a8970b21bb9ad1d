"""The import graph: no loops, and every module imports on its own in dependency order.

Why from the AST: an import loop patched over by a function-level or ``TYPE_CHECKING`` import
still ties two modules together; reading every ``import`` statement, wherever it stands, finds
those too.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("paro_fsdp", "passes")
REPOSITORY = (*PACKAGES, "tools", "train.py")  # what the folder test folds
OPTIONAL = "paro_fsdp.integrations."  # needs the torchtitan extra
#: subpackages that use the engine and that no engine module may import: the trainer's parts and
#: the plug-ins (torchtitan, Hugging Face)
NOT_ENGINE = ("paro_fsdp.train", "paro_fsdp.integrations")


def _engine(modules) -> list[str]:
    return [m for m in modules if m.startswith("paro_fsdp") and not m.startswith(NOT_ENGINE)]


def _modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else [ROOT / pkg]:
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(importer: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports (any statement: top level, in functions, under
    ``TYPE_CHECKING``)."""
    modules = _modules(packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:  # "paro_fsdp.comm.CommStats" -> "paro_fsdp.comm"
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def dependency_order(graph: dict[str, set[str]]) -> list[str]:
    """Modules, each after every module it imports (and after its parent package)."""
    order: list[str] = []
    done: set[str] = set()

    def visit(v: str) -> None:
        if v in done:
            return
        done.add(v)
        parent = v.rpartition(".")[0]
        for w in sorted(graph[v] | ({parent} if parent in graph else set())):
            visit(w)
        order.append(v)

    for v in sorted(graph):
        visit(v)
    return order


def test_import_graph_is_a_dag():
    found = cycles(import_graph())
    assert found == [], "import loops: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_module_imports_alone_in_dependency_order():
    """One fresh interpreter imports every module, leaves first: a module that only works when
    something else happened to be imported before it fails here."""
    order = dependency_order(import_graph())
    # the torchtitan plug-in last, after the CPU shims its own tests use (torchtitan imports triton)
    order = [m for m in order if not m.startswith(OPTIONAL)] + [m for m in order if m.startswith(OPTIONAL)]
    from paro_fsdp._compat import torch_version

    if torch_version() < (2, 13):  # torchtitan 0.3 cannot be installed beside this torch
        order = [m for m in order if not m.startswith(OPTIONAL)]
    script = ("import importlib, sys\nsys.path.insert(0, 'tests/harness')\nfor name in sys.argv[1:]:\n"
              f"    if name.startswith({OPTIONAL!r}):\n        import titan_shims; titan_shims.install()\n"
              "    importlib.import_module(name)\n")
    r = subprocess.run([sys.executable, "-c", script, *order], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_engine_imports_neither_passes_nor_the_trainer():
    """Nor the plug-in, the benchmarks or the GPU check: they may import the engine, never the reverse."""
    graph = import_graph()
    bad = {m: sorted(t for t in graph[m] if t.startswith(("passes", *NOT_ENGINE))) for m in _engine(graph)}
    assert {m: t for m, t in bad.items() if t} == {}


# ---- tools/ and train.py: nothing imports tools/; the engine stands alone ----


def _file_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, wherever it stands; ``from a import b`` gives
    both ``a`` and ``a.b`` (b may be a module)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    name, is_pkg = ".".join(p for p in parts if p != "__init__"), parts[-1] == "__init__"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_pkg, node)
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _importing(paths: list[Path], roots: tuple[str, ...]) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in paths for line, mod in _file_imports(p)
            if any(mod == r or mod.startswith(r + ".") for r in roots)]


def test_the_installed_package_imports_no_tools():
    """``tools/`` (benchmarks, the emulator, the GPU check, the advisor's command line) uses the
    package and the tests may use tools; the package, the passes and train.py never do."""
    files = [*sorted((ROOT / "paro_fsdp").rglob("*.py")), *sorted((ROOT / "passes").rglob("*.py")), ROOT / "train.py"]
    assert _importing(files, ("tools",)) == []


def rooms(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The import graph with every module folded into its folder ``depth`` levels down
    (``paro_fsdp.cost.predict`` -> ``paro_fsdp`` at 1, ``paro_fsdp.cost`` at 2): what a picture
    of the repository draws as one room."""
    def room(m: str) -> str:
        parts = m.split(".")
        if len(parts) > depth and (ROOT.joinpath(*parts[:depth])).is_dir():
            return ".".join(parts[:depth])
        return m
    out: dict[str, set[str]] = {}
    for v, targets in graph.items():
        out.setdefault(room(v), set()).update(room(t) for t in targets if room(t) != room(v))
    return out


def test_folders_import_only_downward():
    """No arrow back up: folded into folders (the repository's top-level packages, then the
    package's subfolders and modules), the imports still form no loop. A module-level DAG can hide
    one, e.g. ``ledger.py`` importing ``cost/`` while ``cost/`` imports the ledger."""
    graph = import_graph(REPOSITORY)
    for depth in (1, 2):
        found = cycles(rooms(graph, depth))
        assert found == [], f"folders importing each other (depth {depth}): " + "; ".join(
            " <-> ".join(c) for c in found
        )


def test_the_engine_source_imports_no_tools_nor_train_script():
    skip = [ROOT.joinpath(*pkg.split(".")) for pkg in NOT_ENGINE]
    engine = [p for p in sorted((ROOT / "paro_fsdp").rglob("*.py")) if not any(s in p.parents for s in skip)]
    assert _importing(engine, ("tools", "train", "passes", *NOT_ENGINE)) == []


_ENGINE_PROBE = r"""
import importlib, json, sys
engine = json.loads(sys.argv[1])
for n in engine:
    importlib.import_module(n)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("passes", "tools", "train")
                or m.startswith(tuple(json.loads(sys.argv[2]))))
print(json.dumps({"engine": engine, "loaded": loaded}))
"""


def test_fresh_interpreter_importing_the_whole_engine_loads_no_passes_tools_or_trainer():
    import json

    engine = _engine(_modules())
    r = subprocess.run([sys.executable, "-c", _ENGINE_PROBE, json.dumps(engine), json.dumps(NOT_ENGINE)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "paro_fsdp.api" in out["engine"] and "paro_fsdp.collectives" in out["engine"]
    assert out["loaded"] == [], f"importing the engine loaded {out['loaded']}"


# ---- docs/ARCHITECTURE.md's module picture is the import graph ----------------------------------
PICTURE_BEGIN, PICTURE_END = "<!-- import layers: begin -->", "<!-- import layers: end -->"


def import_layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Modules by layer: layer 0 imports no project module, layer k only modules of layers < k
    (and at least one of layer k - 1)."""
    layer: dict[str, int] = {}

    def of(v: str) -> int:
        if v not in layer:
            layer[v] = 1 + max((of(w) for w in graph[v]), default=-1)
        return layer[v]

    out: list[list[str]] = [[] for _ in range(1 + max(of(v) for v in graph))]
    for v in sorted(graph):
        out[layer[v]].append(v)
    return out


def render_layers(layers: list[list[str]], width: int = 100) -> str:
    """Top layer first, as a picture reads; ``paro_fsdp.`` is left out of the names."""
    lines = []
    for k in reversed(range(len(layers))):
        names = [m.removeprefix("paro_fsdp.") for m in layers[k]]
        line = f"{k:>2} |"
        for name in names:
            if len(line) + 1 + len(name) > width:
                lines.append(line)
                line = "   |"
            line += " " + name
        lines.append(line)
    return "\n".join(lines)


def test_the_architecture_picture_is_the_import_graph():
    """docs/ARCHITECTURE.md draws the modules in layers, each importing only from layers below it;
    regenerate the block with ``python tests/test_imports.py`` when this fails."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    drawn = text.split(PICTURE_BEGIN)[1].split(PICTURE_END)[0].strip().strip("`").strip()
    assert drawn == render_layers(import_layers(import_graph())).strip(), "regenerate: python tests/test_imports.py"


if __name__ == "__main__":
    print(render_layers(import_layers(import_graph())))
