"""The benchmarks' own outputs go through the one write rule: a --out among the project's own files, inside a
run, or with a link where a file goes is refused before any measurement, in one ``error:`` line (exit 2);
bad sizes the same way. (benchmarks/calibration.py: tests/test_calibration_benchmark.py.)"""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cuda():
    return _load("measure_cuda")


@pytest.fixture(scope="module")
def pyperf_cmp():
    return _load("compare_pyperf")


def _refused(module, capsys, argv) -> str:
    assert module.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def a_run(tmp_path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(ROOT / "results" / "examples" / "quick", folder, ignore=shutil.ignore_patterns("plots", "report.*"))
    return folder


def _configs() -> list:
    return sorted((p.name, p.stat().st_mtime_ns) for p in (ROOT / "configs").iterdir())


def test_measure_cuda_out_is_checked_before_any_kernel(cuda, capsys, a_run, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # refused before torch is imported
    before = _configs()
    assert "among the project's own files" in _refused(cuda, capsys, ["--out", str(ROOT / "configs")])
    assert _configs() == before
    assert f"inside the run folder {a_run}" in _refused(cuda, capsys, ["--out", str(a_run / "kernels")])
    out = tmp_path / "out"
    out.mkdir()
    (out / "kernels.json").symlink_to(tmp_path / "elsewhere.json")
    assert "symbolic link" in _refused(cuda, capsys, ["--out", str(out)])
    assert "--batch: expected comma-separated positive integers" in _refused(cuda, capsys, ["--batch", "1,x", "--out", str(tmp_path / "o")])
    assert "--rounds: expected a positive integer, got 0" in _refused(cuda, capsys, ["--rounds", "0", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists() and not (a_run / "kernels").exists()


def test_compare_pyperf_out_is_checked_before_any_turn(pyperf_cmp, capsys, a_run, tmp_path, monkeypatch):
    monkeypatch.setattr(pyperf_cmp, "compare", lambda *a, **k: pytest.fail("no turn for a refused call"))
    before = _configs()
    assert "among the project's own files" in _refused(pyperf_cmp, capsys, ["--out", str(ROOT / "configs")])
    assert _configs() == before
    assert f"inside the run folder {a_run}" in _refused(pyperf_cmp, capsys, ["--out", str(a_run / "cmp")])
    out = tmp_path / "out"
    (out / "clean").mkdir(parents=True)
    (out / "clean" / "turns.json").symlink_to(tmp_path / "elsewhere.json")
    assert "symbolic link" in _refused(pyperf_cmp, capsys, ["--out", str(out)])
    assert "--setup: expected inherited, clean, got 'nope'" in _refused(pyperf_cmp, capsys, ["--setup", "nope"])
    assert "--turns and --values: expected at least 1" in _refused(pyperf_cmp, capsys, ["--turns", "0"])


def test_compare_pyperf_writes_its_files_by_the_rule_from_the_caller_s_folder(pyperf_cmp, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(pyperf_cmp, "compare", lambda setup, envs, out, args: seen.append(out))
    monkeypatch.chdir(tmp_path)
    assert pyperf_cmp.main(["--out", "cmp", "--setup", "clean"]) == 0
    assert seen == [tmp_path / "cmp" / "clean"]  # absolute: pyperf's processes run from the project's folder
