"""pytest-benchmark JSON in and out: the benchmark suite's file imports as a run that plots, reports and
compares; a run exports to a file pytest-benchmark reads; other pytest-benchmark files import too."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import harness
from harness.cli import app
from harness.results.pytest_benchmark import PAIRED_NOTE, UNPAIRED_NOTE

pytest.importorskip("pytest_benchmark")

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # a loaded 2-core machine; the suite itself takes well under a minute


def _invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result


@pytest.mark.heavy  # the whole pytest-benchmark suite, every backend
def test_suite_json_imports_as_a_run_with_a_speedup_plot(tmp_path):
    """The whole way: the suite under pytest-benchmark, harness import, report, export, pytest-benchmark compare."""
    out_json = tmp_path / "out.json"
    # a plain pytest of its own: not an xdist worker of this run (pytest-benchmark turns itself off under xdist,
    # which it reads from the PYTEST_XDIST_* variables this process would hand down)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks/test_bench_backends.py", "--benchmark-only", "-p", "no:cacheprovider",
         "-p", "no:xdist",
         "-q", "-k", "numpy and V64 and B1", f"--benchmark-json={out_json}", "--benchmark-max-time=0.02",
         "--benchmark-min-rounds=5", "-o", "addopts="],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = json.loads(out_json.read_text())
    assert len(data["benchmarks"]) == 4  # numpy and numpy:wildml, forward and train_step
    assert all(b["extra_info"]["cell_id"] and b["stats"]["data"] for b in data["benchmarks"])

    run_dir = tmp_path / "run"
    result = _invoke("import", out_json, "--out", run_dir)
    assert result.exit_code == 0, result.output
    run = harness.load_run(run_dir)
    t = run.timings
    assert set(t["backend"] + ":" + t["variant"]) == {"numpy:fast", "numpy:wildml"}
    assert (t["status"] == "ok").all() and (t["baseline"] == "numpy").all()
    wildml = t[t["variant"] == "wildml"]
    assert wildml["speedup"].notna().all() and (wildml["speedup_lo"] <= wildml["speedup"]).all()
    assert (wildml["speedup"] <= wildml["speedup_hi"]).all()
    assert run.meta["speedup_interval"] == UNPAIRED_NOTE
    assert t["gflops"].gt(0).all()

    result = _invoke("report", run_dir)
    assert result.exit_code == 0, result.output
    assert (run_dir / "plots" / "speedup.png").stat().st_size > 0
    report = (run_dir / "report.md").read_text()
    assert "speedup.png" in report and "rounds are not paired" in report

    exported = tmp_path / "back.json"
    result = _invoke("export", run_dir, "--format", "pytest-benchmark", "--out", exported)
    assert result.exit_code == 0, result.output
    back = json.loads(exported.read_text())
    by_name = {b["name"]: b for b in back["benchmarks"]}
    for b in data["benchmarks"]:  # the same benchmarks, names and timings come back
        assert by_name[b["name"]]["fullname"] == b["fullname"] and by_name[b["name"]]["group"] == b["group"]
        assert by_name[b["name"]]["stats"]["data"] == b["stats"]["data"]
        assert by_name[b["name"]]["stats"]["median"] == pytest.approx(b["stats"]["median"])
    proc = subprocess.run([sys.executable, "-m", "pytest_benchmark", "compare", str(out_json), str(exported)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0 and "test_backend[numpy:wildml-train_step" in proc.stdout, proc.stdout + proc.stderr


def _bench(name, group, samples, data=True, **extra):
    a = np.asarray(samples, dtype=float)
    q1, q3 = np.percentile(a, [25, 75])
    stats = {"min": a.min(), "max": a.max(), "mean": a.mean(), "stddev": a.std(ddof=1), "rounds": a.size,
             "median": float(np.median(a)), "iqr": q3 - q1, "q1": q1, "q3": q3, "iqr_outliers": 0,
             "stddev_outliers": 0, "outliers": "0;0", "ld15iqr": a.min(), "hd15iqr": a.max(), "ops": 1 / a.mean(),
             "total": a.sum(), "iterations": 1}
    if data:
        stats["data"] = list(a)
    return {"group": group, "name": name, "fullname": f"tests/test_x.py::{name}", "params": None, "param": None,
            "extra_info": extra, "options": {"timer": "perf_counter"}, "stats": {k: (v.item() if hasattr(v, "item") else v)
                                                                                  for k, v in stats.items()}}


def _file(tmp_path, benches, name="other.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"machine_info": {"node": "box", "system": "Linux", "release": "6", "machine": "x86_64",
                                                 "python_version": "3.11.7", "cpu": {"brand_raw": "Some CPU", "count": 4}},
                                "commit_info": {"id": "abc123", "dirty": True}, "benchmarks": benches,
                                "datetime": "2026-01-02T03:04:05+00:00", "version": "5.2.3"}))
    return path


@pytest.mark.parametrize("with_data", [True, False], ids=["raw-data", "stats-only"])
def test_any_pytest_benchmark_file_imports_and_reports(tmp_path, with_data):
    rng = np.random.default_rng(0)
    fast, slow = 1e-3 * (1 + 0.01 * rng.random(20)), 3e-3 * (1 + 0.01 * rng.random(20))
    path = _file(tmp_path, [_bench("test_sum[list]", "sum", slow, with_data), _bench("test_sum[array]", "sum", fast, with_data),
                            _bench("test_other", None, fast, with_data)])
    run_dir = tmp_path / "run"
    result = _invoke("import", path, "--out", run_dir, "--baseline", "test_sum[list]")
    assert result.exit_code == 0, result.output
    run = harness.load_run(run_dir)
    t = run.timings.set_index("backend")
    assert t.loc["test_sum[array]", "speedup"] == pytest.approx(np.median(slow) / np.median(fast))
    assert t.loc["test_sum[list]", "speedup"] == 1.0
    assert np.isnan(t.loc["test_other", "speedup"])  # its group has no baseline
    assert run.meta["machine"]["cpu_model"] == "Some CPU" and run.meta["git_commit"] == "abc123-dirty"
    if with_data:
        assert run.meta["speedup_interval"] == UNPAIRED_NOTE
        assert t.loc["test_sum[array]", "speedup_lo"] < t.loc["test_sum[array]", "speedup"] < t.loc["test_sum[array]", "speedup_hi"]
        assert t.loc["test_sum[array]", "n_samples"] == 20
    else:  # documented fallback: the ratio of medians, no interval
        assert run.meta["speedup_interval"] == PAIRED_NOTE
        assert np.isnan(t.loc["test_sum[array]", "speedup_lo"])
        assert len(t.loc["test_sum[array]", "samples_s"]) == 0
    assert _invoke("report", run_dir).exit_code == 0
    assert (run_dir / "plots" / "speedup.png").exists()
    assert "None" not in (run_dir / "report.md").read_text()  # a foreign benchmark is named by its group
    again = _invoke("import", path, "--out", run_dir)
    assert again.exit_code == 2 and "a run already exists there" in again.output

    # and back: the same benchmarks, with the stats they came with
    exported = tmp_path / "back.json"
    assert _invoke("export", run_dir, "--out", exported).exit_code == 0
    back = {b["name"]: b for b in json.loads(exported.read_text())["benchmarks"]}
    assert set(back) == {"test_sum[list]", "test_sum[array]", "test_other"}
    assert back["test_sum[list]"]["group"] == "sum" and back["test_other"]["fullname"] == "tests/test_x.py::test_other"
    assert back["test_sum[array]"]["stats"]["median"] == pytest.approx(np.median(fast))
    assert back["test_sum[array]"]["stats"]["max"] == pytest.approx(fast.max())


def test_a_suite_cells_backend_is_read_from_its_fields_not_from_its_ids_text(tmp_path):
    """The speedup's baseline is found by the backend the row names (name, variant, pins), whatever the
    text of its cell id (which a run writes, and reads, in one place)."""
    rng = np.random.default_rng(1)
    fast, slow = 1e-3 * (1 + 0.01 * rng.random(12)), 2e-3 * (1 + 0.01 * rng.random(12))
    benches = [_bench("test_backend[a]", "g", slow, cell_id="cell-a", backend="numpy", variant="fast"),
               _bench("test_backend[b]", "g", fast, cell_id="cell-b", backend="numpy", variant="wildml")]
    for b in benches:
        b["extra_info"].update(group="g", baseline="numpy", workload="forward")
    path = _file(tmp_path, benches)
    run_dir = tmp_path / "run"
    result = _invoke("import", path, "--out", run_dir)
    assert result.exit_code == 0, result.output
    t = harness.load_run(run_dir).timings.set_index("cell_id")
    assert t.loc["cell-a", "speedup"] == 1.0
    assert t.loc["cell-b", "speedup"] == pytest.approx(np.median(slow) / np.median(fast))


def test_a_harness_run_exports_and_compares_with_its_import(tmp_path, fake_backends, write_config):
    cfg = write_config(textwrap.dedent("""
        name: tiny
        seed: 1
        dtype: float64
        model: {kind: elman, hidden: 4}
        task: {kind: random, input_size: 3, output_size: 3, seq_len: 3, n_sequences: 4}
        workloads: [forward, train_step]
        batch: [2]
        backends: [numpy, ref]
        timing: {warmup: 1, min_rounds: 5, min_time_s: 0.01, max_time_s: 1, timeout_s: 120}
    """))
    run_dir = tmp_path / "run"
    assert _invoke("run", cfg, "--out", run_dir, "--no-plots").exit_code == 0
    exported = tmp_path / "run.json"
    result = _invoke("export", run_dir, "--out", exported)
    assert result.exit_code == 0, result.output
    from pytest_benchmark.storage.file import FileStorage

    class Log:
        def warning(self, text):
            raise AssertionError(text)

    loaded = list(FileStorage(str(tmp_path), default_machine_id="x", logger=Log()).load(str(exported)))
    assert len(loaded[0][1]["benchmarks"]) == 4

    again = tmp_path / "again"
    assert _invoke("import", exported, "--out", again).exit_code == 0
    a, b = harness.load_run(run_dir).timings, harness.load_run(again).timings
    assert sorted(a["cell_id"]) == sorted(b["cell_id"])
    merged = a.merge(b, on="cell_id")
    assert np.allclose(merged["median_s_x"], merged["median_s_y"])
    result = _invoke("compare", run_dir, again, "--json")
    # 3: a cell the busy test machine made unsteady or contended in the run cannot be judged fairly
    assert result.exit_code in (0, 3), result.output
    out = json.loads(result.output)
    assert out["regressions"] == [] and all(abs(c["ratio"] - 1) < 1e-9 for c in out["cells"])


def test_bad_inputs_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = _invoke("import", bad)
    assert result.exit_code == 2 and "not valid JSON" in result.output
    bad.write_text(json.dumps({"results": []}))
    assert "expected a 'benchmarks' list" in _invoke("import", bad).output
    bad.write_text(json.dumps({"benchmarks": [{"name": "x", "stats": {"median": 1}}]}))
    assert "benchmarks[0].stats.min: required key is missing" in _invoke("import", bad).output
    result = _invoke("export", tmp_path, "--format", "csv")
    assert result.exit_code == 2 and "expected pytest-benchmark" in result.output
    result = _invoke("export", tmp_path)
    assert result.exit_code == 2 and "not a results folder" in result.output
