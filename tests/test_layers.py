"""The house's layers (:mod:`harness.layers`): no module imports a layer above its own, backends
import only the spec layer, and no modules import each other round a circle."""

from harness.layers import LAYERS, import_graph, layer

def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, deps in import_graph().items():
        mine = layer(module)
        for dep in deps:
            theirs = layer(dep)
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
    assert all(layer(m) is not None for m in import_graph())


def test_the_worker_side_imports_only_what_every_environment_holds():
    # the worker runs in Theano's numpy 1.23 environment and every pinned one: the standard library,
    # numpy, PyYAML, the spec and verify layers and the backends, nothing else (lazy imports count)
    from harness.layers import WORKER_MAY_IMPORT, worker_imports_beyond

    wrong = worker_imports_beyond()
    assert not wrong, "\n".join(f"{m} imports {', '.join(sorted(d))} (allowed: the standard library, "
                                f"{', '.join(WORKER_MAY_IMPORT)})" for m, d in sorted(wrong.items()))


def test_the_worker_rule_reads_lazy_and_relative_imports(tmp_path):
    from harness.layers import imports_of

    path = tmp_path / "measure.py"
    path.write_text("import os\nfrom . import stats\ndef f():\n    from scipy.stats import t\n    import torch.nn\n")
    assert imports_of("harness.worker.measure", path) == {"os", "harness.worker.stats", "scipy.stats.t", "torch.nn"}


def test_the_picture_has_a_command_line(tmp_path):
    """`--help` explains and writes nothing; `--out` names the picture; a stray argument is refused."""
    import subprocess
    import sys

    from harness.layers import ROOT

    run = lambda *a: subprocess.run([sys.executable, "-m", "harness.layers", *a], cwd=tmp_path,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    helped = run("--help")
    assert helped.returncode == 0 and "--out" in helped.stdout and list(tmp_path.iterdir()) == []
    assert run("-h").returncode == 0 and list(tmp_path.iterdir()) == []
    wrong = run("picture.png")
    assert wrong.returncode == 2 and list(tmp_path.iterdir()) == []
    drawn = run("--out", "layers.png")
    assert drawn.returncode == 0 and (tmp_path / "layers.png").read_bytes()[:4] == b"\x89PNG", drawn.stderr
    assert not list(ROOT.glob("-*.png"))  # no picture named after an option in the checkout
