"""The house's layers, read from the import graph of ``harness/`` and ``backends/``.

Bottom to top: the spec, the backends, verification, the configs, the worker side, the running
(the manager's side), results, and the CLI (with ``reproduce``, ``docs``, the public
``harness.testing`` and ``harness.reference``) on top. A module may import its own layer
and those below it, never one above; ``tests/test_layers.py`` holds the tree to that, and
``python -m harness.layers`` draws the picture in ``docs/architecture.md`` (``docs/layers.png``;
``--out FILE`` elsewhere) from the same graph.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# bottom to top; a module belongs to the first prefix it starts with
LAYERS = [
    ("spec", ("harness.spec",)),
    ("backends", ("backends",)),
    ("verify", ("harness.verify",)),
    ("config", ("harness.config",)),
    ("worker", ("harness.worker",)),
    ("run", ("harness.run",)),
    ("results", ("harness.results",)),
    ("top", ("harness.cli", "harness.reproduce", "harness.docs", "harness.testing", "harness.reference",
             "harness.layers", "harness")),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def _files() -> dict[str, Path]:
    files = [p for pkg in ("harness", "backends") for p in (ROOT / pkg).rglob("*.py")]
    return {_module_name(p): p for p in files}


def imports_of(module: str, path: Path) -> set[str]:
    """Every module name ``module`` (in file ``path``) imports, at any depth of its code (lazy imports
    count), relative imports resolved; ``from pkg import name`` gives ``pkg.name``."""
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (at any depth of its code: lazy imports count)."""
    modules = _files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for t in imports_of(name, path):
            # `from pkg import name` names a module when pkg.name is one, else pkg
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                deps.add(t)
        graph[name] = deps
    return graph


#: what the worker side may import: it runs in every backend's environment (Theano's numpy 1.23,
#: a pinned ``jax@0.4.38``), which hold the standard library, numpy, PyYAML and the backend
WORKER_MAY_IMPORT = ("numpy", "yaml", "harness.spec", "harness.verify", "backends", "harness.worker")
# imported by the worker side only where installed, with a fallback where not (an isolated environment
# need not hold them): threadpoolctl names the BLAS kernel a worker runs (harness.worker.blas_probe)
WORKER_MAY_TRY = ("threadpoolctl",)


def worker_imports_beyond() -> dict[str, set[str]]:
    """Each worker-side module -> the modules it imports beyond the standard library and
    :data:`WORKER_MAY_IMPORT` (lazy imports count)."""
    out = {}
    for name, path in _files().items():
        if not (name == "harness.worker" or name.startswith("harness.worker.")):
            continue
        wrong = set()
        for t in imports_of(name, path):
            top = t.partition(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if any(t == p or t.startswith(p + ".") for p in WORKER_MAY_IMPORT + WORKER_MAY_TRY):
                continue
            wrong.add(t)
        if wrong:
            out[name] = wrong
    return out


def layer_edges(graph: dict[str, set[str]] | None = None) -> dict[tuple[int, int], int]:
    """How many module imports go from each layer to each other layer."""
    edges: dict[tuple[int, int], int] = {}
    for module, deps in (graph or import_graph()).items():
        for dep in deps:
            a, b = layer(module), layer(dep)
            if a is not None and b is not None and a != b:
                edges[(a, b)] = edges.get((a, b), 0) + 1
    return edges


def draw(path: str) -> None:
    """The layers as stacked boxes (modules and lines of code each), with the imports between them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph = import_graph()
    members: dict[int, list[str]] = {}
    for m in graph:
        members.setdefault(layer(m), []).append(m)
    lines = {r: sum(len(_file(m).read_text().splitlines()) for m in ms) for r, ms in members.items()}
    fig, ax = plt.subplots(figsize=(9, 7))
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.5, len(LAYERS) * 1.5)
    for rank, (name, prefixes) in enumerate(LAYERS):
        y = rank * 1.5
        ax.add_patch(plt.Rectangle((1, y), 5.2, 0.9, facecolor=f"C{rank}", alpha=0.25, edgecolor=f"C{rank}"))
        short = sorted({m.split(".")[-1] for m in members.get(rank, [])})
        ax.text(1.15, y + 0.6, f"{name}: {', '.join(prefixes[:1])}", fontsize=11, weight="bold", va="center")
        ax.text(1.15, y + 0.25, f"{len(members.get(rank, []))} modules, {lines.get(rank, 0)} lines", fontsize=9, va="center")
        ax.text(6.4, y + 0.45, ", ".join(short[:9]) + (" ..." if len(short) > 9 else ""), fontsize=7, va="center", wrap=True)
    for (a, b), n in sorted(layer_edges(graph).items()):
        x = 0.35 + 0.12 * a
        ax.annotate("", xy=(x, b * 1.5 + 0.9), xytext=(x, a * 1.5),
                    arrowprops=dict(arrowstyle="->", color="C3" if b > a else "0.4", lw=0.6 + 0.15 * min(n, 10)))
    ax.text(0.1, -0.35, "arrows: imports from a layer (tail) to one below (head), width by count", fontsize=8)
    ax.axis("off")
    ax.set_title("rnn-harness layers, from the import graph (bottom imports nothing above it)")
    fig.savefig(path, dpi=110, bbox_inches="tight")


def _file(module: str) -> Path:
    path = ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.layers [--out FILE]``: draw the picture; ``--help`` says so and draws nothing."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m harness.layers",
                                     description="Draw the layers of harness/ and backends/ from their import graph.")
    parser.add_argument("--out", default=str(ROOT / "docs" / "layers.png"), metavar="FILE",
                        help="the picture to write (PNG, SVG or PDF by its suffix; default: docs/layers.png)")
    args = parser.parse_args(argv)
    draw(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
