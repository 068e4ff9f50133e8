"""The layout's one rule, checked on the source: imports run one way.

Every ``import`` in bench/ and methods/ (module level and inside functions alike) is read from
the syntax tree. A module may import its own package's modules and any lower layer's, never a
higher one's, and no two modules may import each other through any chain (a cycle). The layer
order is docs/architecture.md's; a new package has to be placed in it here."""
import ast
from pathlib import Path

import pytest

from bench.core.paths import REPO_ROOT

# lowest first; packages on one line are one layer and may not import each other
LAYERS = (
    ("methods",),
    ("bench.core",),
    ("bench.spec", "bench.knobs"),
    ("bench.report",),
    ("bench.engines", "bench.drafters"),
    ("bench.traces",),
    ("bench.harness",),
    ("bench.benchmarks", "bench.train"),
)
TOP_LEVEL = {"bench", "bench.__main__"}  # the package docstring and ``python -m bench``: the main job's door


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in ("bench", "methods") for p in sorted((REPO_ROOT / top).rglob("*.py"))}


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The suite's modules ``path`` imports at run time (``from a.b import c`` counts as a.b, and as
    a.b.c too where that is a module)."""
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if f"{node.module}.{a.name}" in known]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in ("bench", "methods"))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: {i for i in _imports(p, known) if i != m} for m, p in mods.items()}


def _layer(module: str) -> int | None:
    for rank, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return rank
    return None


def _package(module: str) -> str:
    for packages in LAYERS:
        for p in packages:
            if module == p or module.startswith(p + "."):
                return p
    return module


def test_every_module_has_a_layer():
    unplaced = [m for m in _graph() if m not in TOP_LEVEL and _layer(m) is None]
    assert not unplaced, f"modules outside every layer (add their package to LAYERS and docs/architecture.md): {unplaced}"


def test_imports_only_go_down():
    upward = []
    for module, imports in _graph().items():
        if module in TOP_LEVEL:
            continue
        for imported in imports:
            if imported in ("bench",):
                continue
            own, their = _layer(module), _layer(imported)
            if their is None or (their > own) or (their == own and _package(imported) != _package(module)):
                upward.append(f"{module} -> {imported}")
    assert not upward, "imports against the layer order:\n" + "\n".join(sorted(upward))


def test_methods_import_neither_torch_nor_an_engine():
    forbidden = ("torch", "vllm", "sglang", "transformers", "bench")
    bad = []
    for module, path in _modules().items():
        if not module.startswith("methods"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            bad += [f"{module} imports {n}" for n in names if n.split(".")[0] in forbidden]
    assert not bad, bad


def test_the_simulator_runs_without_importing_torch():
    """The simulator reads a run's log with no model: its command and the one loop it drives import
    the torch-free halves of coupled sampling and the verifier (``bench.core.coupling``,
    ``bench.core.verdicts``), so torch's start-up time and memory stay out of its processes."""
    import subprocess
    import sys
    code = ("import sys, bench.harness.simulate, bench.benchmarks.simulate_scale; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert out.stdout.strip() == "[]", f"the simulator imports {out.stdout.strip()}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1; stack.append(child); on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop(); on.discard(member); comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles():
    # ``from a.b import c`` is an edge to a.b (whose __init__ runs) and to a.b.c where that is a module:
    # a package __init__ that imports its own modules back closes a cycle with each that names it
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_sees_a_package_that_imports_its_module_back(tmp_path):
    """``pkg/__init__.py`` importing ``pkg.mod`` (even inside a function) while ``pkg.mod`` says
    ``from pkg import other``: a cycle through the package."""
    (tmp_path / "init.py").write_text("def f():\n    from bench.pkg.mod import g\n")
    (tmp_path / "mod.py").write_text("from bench.pkg import other\n")
    known = {"bench.pkg", "bench.pkg.mod", "bench.pkg.other"}
    graph = {"bench.pkg": _imports(tmp_path / "init.py", known), "bench.pkg.mod": _imports(tmp_path / "mod.py", known),
             "bench.pkg.other": set()}
    assert _cycles(graph) == [["bench.pkg", "bench.pkg.mod"]]


@pytest.mark.parametrize("module", ["bench.spec.scheduler", "bench.core.verify"])
def test_the_checker_reads_function_level_imports(module):
    assert _graph()[module], f"{module} imports nothing the checker saw"


def test_the_architecture_page_names_every_package():
    page = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    packages = sorted({m for m, p in _modules().items() if p.name == "__init__.py"})
    missing = [m for m in packages if f"{m.split('.')[-1]}/" not in page]
    assert not missing, f"docs/architecture.md does not show these packages (regenerate its tree): {missing}"
