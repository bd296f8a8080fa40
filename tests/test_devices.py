"""CPU and GPU in one run: a baseline per device, the GPU-over-CPU ratio of each backend,
the GPU's roofs in the roofline, and the GPU settings of the JAX backend."""

from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.config import load_config
from harness.results.devices import gpu_over_cpu
from harness.spec.errors import HarnessError
from harness.results.plots import plot_crossover, plot_roofline
from harness.results.store import load_run

from test_report import SWEEP, registered, synthetic_run  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
MIXED = """
name: mixed
model: {kind: lstm, hidden: 8}
task: {kind: random, input_size: 4, output_size: 4, seq_len: 5}
batch: [1, 8]
device: [cpu, gpu]
backends: [numpy, torch, "torch:fused", jax]
"""


def _load(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return load_config(path)


def test_a_gpu_group_gets_a_baseline_that_runs_on_the_gpu(tmp_path):
    cfg = _load(tmp_path, MIXED)
    assert cfg.baselines == {"cpu": "numpy", "gpu": "torch"}  # numpy has no GPU implementation
    for cell in cfg.cells():
        assert cell.baseline == ("numpy" if cell.problem.device == "cpu" else "torch")
        assert cell.baseline in [c.backend for c in cfg.cells() if c.group_key == cell.group_key]


def test_a_baseline_per_device(tmp_path):
    cfg = _load(tmp_path, MIXED + 'baseline: {cpu: numpy, gpu: "torch:fused"}\n')
    assert cfg.baselines == {"cpu": "numpy", "gpu": "torch:fused"}
    assert cfg.baseline == "cpu: numpy, gpu: torch:fused"
    firsts = {c.group_key: c.backend for c in reversed(cfg.cells())}  # the baseline leads its group
    assert {b for k, b in firsts.items() if "|gpu|" in k} == {"torch:fused"}


@pytest.mark.parametrize("baseline, message", [
    ("{tpu: numpy}", "baseline.tpu: expected a device the config runs on"),
    ("{gpu: native}", "baseline.gpu: expected one of the configured backends"),
    ("{gpu: nosuch}", "baseline.gpu: unknown backend"),
])
def test_bad_per_device_baselines_name_the_key(tmp_path, baseline, message):
    with pytest.raises(HarnessError, match=message):
        _load(tmp_path, MIXED + f"baseline: {baseline}\n")


def test_lstm_cpu_gpu_config_times_its_gpu_rows_against_cudnn():
    cfg = load_config(ROOT / "configs" / "lstm_cpu_gpu.yaml")
    assert cfg.baselines == {"cpu": "numpy", "gpu": "torch:fused"}


def test_quick_has_a_gpu_profile_with_gpu_backends_only():
    cfg = load_config(ROOT / "configs" / "quick.yaml", profile="gpu")
    cells = cfg.cells()
    assert {c.problem.device for c in cells} == {"gpu"}
    assert {c.baseline for c in cells} == {"torch:fused"}


def _timings(rows):
    base = {"workload": "train_step", "model": "lstm", "task": "random", "dtype": "float32", "seq_len": 5,
            "input_size": 4, "hidden_size": 8, "output_size": 4, "bptt": "full", "layers": 1, "activation": "lstm",
            "head": "mse", "output_act": "linear", "peephole": False, "bias": True, "tokens": False, "sweep": "{}",
            "variant": "default", "status": "ok"}
    return pd.DataFrame([base | r for r in rows])


def test_gpu_over_cpu_pairs_each_backend_with_itself_at_its_fastest_cpu_thread_count():
    t = _timings([
        {"backend": "jax", "device": "cpu", "threads": 1, "batch": 8, "median_s": 4.0},
        {"backend": "jax", "device": "cpu", "threads": 2, "batch": 8, "median_s": 3.0},
        {"backend": "jax", "device": "gpu", "threads": 2, "batch": 8, "median_s": 1.5},
        {"backend": "jax", "device": "gpu", "threads": 2, "batch": 1, "median_s": 1.0},  # no CPU cell at batch 1
        {"backend": "numpy", "device": "cpu", "threads": 2, "batch": 8, "median_s": 2.0},  # no GPU cell
        {"backend": "torch", "device": "cpu", "threads": 2, "batch": 8, "median_s": 2.0},
        {"backend": "torch", "device": "gpu", "threads": 2, "batch": 8, "median_s": 4.0, "status": "error"},
    ])
    r = gpu_over_cpu(t)
    assert len(r) == 1
    row = r.iloc[0]
    assert (row["backend"], row["batch"], row["cpu_threads"]) == ("jax", 8, 2)
    assert row["gpu_speedup"] == pytest.approx(2.0)
    assert gpu_over_cpu(t[t["device"] == "cpu"]).empty


def test_crossover_plot_and_summary_show_the_gpu_over_cpu_ratio(tmp_path, registered):  # noqa: F811
    run_dir = synthetic_run(tmp_path / "sweep", SWEEP)
    run = load_run(run_dir)
    ratios = gpu_over_cpu(run.timings)
    assert len(ratios) and set(ratios["batch"]) == {1, 64}
    assert plot_crossover(run.timings, tmp_path / "crossover.png").exists()
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    text = (run_dir / "report.md").read_text()
    assert "GPU over CPU" in text


def test_gpu_roofs_are_drawn_from_the_rows(tmp_path, registered):  # noqa: F811
    run = load_run(synthetic_run(tmp_path / "sweep", SWEEP))
    t = run.timings.copy()
    gpu = t["device"] == "gpu"
    t.loc[gpu, "gemm_peak_gflops"] = 50_000.0
    t.loc[gpu, "gpu_tf32_gflops"] = 400_000.0
    t.loc[gpu, "gpu_bandwidth_gbs"] = 3000.0
    assert plot_roofline(t, tmp_path / "roofline.png").exists()


def test_list_keeps_install_hints_in_brackets(monkeypatch):
    import backends

    row = backends.Listing("halide", "default", "halide", False,
                           "unavailable: halide not installed (pip install 'rnn-harness[halide]')", ("cpu",), None)
    monkeypatch.setattr(backends, "list_backends", lambda: [row])
    result = CliRunner().invoke(app, ["list"])
    assert "rnn-harness[halide]" in result.output


def test_jax_compiles_for_gpus_without_autotuning_unless_asked():
    from backends.jax_backend import GPU_XLA_FLAGS, JaxBackend
    from harness.spec.model import ModelSpec, Problem

    env = JaxBackend.environment_variables("default", 1, "gpu", "float32")
    assert env["XLA_FLAGS"] == GPU_XLA_FLAGS == "--xla_gpu_autotune_level=0"
    assert "XLA_FLAGS" not in JaxBackend.environment_variables("autotune", 1, "gpu", "float32")
    cpu = Problem(ModelSpec(), 4, 4, False, "float32", 1, 5, "cpu", "train_step")
    ok, why = JaxBackend("autotune").supports(cpu)
    assert not ok and why.startswith("unsupported: ")


def test_run_summary_prints_the_gpu_over_cpu_table(tmp_path, registered, capsys):  # noqa: F811
    from harness.cli import _print_summary
    from harness.results.store import RunStore

    store = RunStore.open(synthetic_run(tmp_path / "sweep", SWEEP))
    _print_summary(store)
    out = capsys.readouterr().out
    assert "GPU over CPU, same backend" in out


def test_gpu_rows_are_read_against_the_gpu_roofs_and_cpu_rows_against_numpy(tmp_path):
    from harness.results.rows import peak_columns
    from harness.results.store import RunStore
    from harness.run.runner import Runner, new_run_meta

    cfg = _load(tmp_path, MIXED)
    runner = Runner(cfg, RunStore(tmp_path / "run", new_run_meta(cfg)))
    runner.gemm_peaks = {"float32|threads=1": 90.0}
    runner.gpu_roofs = {"gemm_fp32_gflops": 50e3, "gemm_tf32_gflops": 400e3, "gemm_fp64_gflops": 25e3, "bandwidth_gbs": 3e3}
    cpu = next(c for c in cfg.cells() if c.problem.device == "cpu")
    gpu = next(c for c in cfg.cells() if c.problem.device == "gpu")
    assert peak_columns(cpu, runner.gemm_peaks, runner.gpu_roofs) == {
        "gemm_peak_gflops": 90.0, "gemm_peak_library": "numpy", "master_peak_gflops": None}
    assert peak_columns(gpu, runner.gemm_peaks, runner.gpu_roofs) == {
        "gemm_peak_gflops": 50e3, "gemm_peak_library": "cublas", "master_peak_gflops": None,
        "gpu_tf32_gflops": 400e3, "gpu_bandwidth_gbs": 3e3}


def test_gpu_roofs_request_travels_the_worker_protocol():
    from harness.worker import protocol

    req = protocol.decode_request(protocol.encode_request(protocol.GpuRoofs(1024)))
    assert isinstance(req, protocol.GpuRoofs) and req.n == 1024


def test_no_gpu_means_no_roofs_and_a_note(tmp_path):
    from harness.results.store import RunStore
    from harness.run.runner import Runner, new_run_meta

    cfg = _load(tmp_path, MIXED)
    said = []
    runner = Runner(cfg, RunStore(tmp_path / "run", new_run_meta(cfg)))
    runner._say = said.append
    runner.measure_roofs([c for c in cfg.cells() if c.problem.device == "gpu"])
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        assert runner.gpu_roofs["gemm_fp32_gflops"] > 0
    else:
        assert runner.gpu_roofs is None and "GPU roofs not measured" in said[0]
