"""The notebooks in notebooks/ run top to bottom against the committed example runs.

They are committed without outputs; executing them needs nbclient, nbformat and
ipykernel (the dev extra) and a run under results/examples/.
"""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXAMPLES = ROOT / "results" / "examples"
NAMES = ["explore_results.ipynb", "compare_backends.ipynb"]


def _example_runs() -> list[Path]:
    return sorted(p.parent for p in EXAMPLES.glob("*/run.json"))


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_are_committed_without_outputs(name):
    nb = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "a notebook without code"
    for cell in code:
        assert cell.get("outputs") == [] and cell.get("execution_count") is None, "strip outputs before committing"


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernel spec that starts this interpreter, whatever ``python3`` means elsewhere on the machine."""
    pytest.importorskip("ipykernel")
    spec = tmp_path / "kernels" / "harness-python"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "harness", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path) + os.pathsep + os.environ.get("JUPYTER_PATH", ""))
    # an uninstalled source tree must import too; the notebooks read the committed examples, not HARNESS_RUNS
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv("HARNESS_RUNS", raising=False)
    return "harness-python"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_against_the_example_runs(name, kernel):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    if not _example_runs():
        pytest.skip(f"no example run under {EXAMPLES.relative_to(ROOT)} yet")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    before = {p: p.stat().st_mtime_ns for p in EXAMPLES.rglob("*") if p.is_file()}
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name=kernel,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, "the notebook drew nothing"
    # a notebook reads the examples; it must not write into them
    assert {p: p.stat().st_mtime_ns for p in EXAMPLES.rglob("*") if p.is_file()} == before
