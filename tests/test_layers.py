"""The house's layers, read from the import graph: spec at the bottom, backends above it,
then verification, running, results, and the CLI on top. No module imports a layer above
its own, and no two modules import each other (directly or round a longer circle)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# bottom to top; a module belongs to the first prefix it starts with
LAYERS = [
    ("spec", ("harness.spec",)),
    ("backends", ("backends",)),
    ("verify", ("harness.verify",)),
    ("run", ("harness.run",)),
    ("results", ("harness.results",)),
    ("top", ("harness.cli", "harness.testing", "harness.reference", "harness")),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (at any depth of its code: lazy imports count)."""
    files = [p for pkg in ("harness", "backends") for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import mod` names a module when pkg.mod is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, deps in import_graph().items():
        mine = _layer(module)
        for dep in deps:
            theirs = _layer(dep)
            # a package's __init__ is where its layer starts: importing it from below is still upward
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module} ({LAYERS[mine][0]}) imports {dep} ({LAYERS[theirs][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_backends_import_only_the_spec_layer():
    wrong = [f"{m} imports {d}" for m, deps in import_graph().items() if m.startswith("backends")
             for d in deps if d.startswith("harness") and not d.startswith("harness.spec")]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle():
    graph = import_graph()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package __init__ that re-exports its own modules is not a circle of concerns
    circles = [c for c in circles if not _only_package_reexport(c)]
    assert not circles, "\n".join(circles)


def _only_package_reexport(circle: str) -> bool:
    nodes = circle.split(" -> ")
    return len(set(nodes)) == 2 and any(n + "." in m for n in nodes for m in nodes if m != n)


def test_every_module_has_a_layer():
    assert all(_layer(m) is not None for m in import_graph())
