"""The CPU roof: the hardware's FMA peak (the native engine's kernel) beside the best library GEMM,
the higher of the two being what a cell's GFLOP/s is read against."""

import pytest

from harness.spec.errors import HarnessError

CONFIG = """
name: roofs
dtype: [{dtype}]
model: {{kind: lstm, hidden: 8}}
task: {{kind: random, input_size: 4, output_size: 4, seq_len: 5}}
threads: [1]
backends: [numpy]
"""


def _peaks(write_config, monkeypatch, dtype, rates, known=None):
    from harness.config import load_config
    from harness.run import roofs

    cfg = load_config(write_config(CONFIG.format(dtype=dtype)))
    asked = []

    def measure(dtype, threads, library, extra, say, record, clean=False):
        asked.append((dtype, library))
        return rates.get(library)

    monkeypatch.setattr(roofs, "_measure", measure)
    monkeypatch.setattr(roofs, "_UNAVAILABLE", set())
    return cfg, roofs.gemm_peaks(cfg.cells(), dict(known or {})), asked


def test_the_roof_is_the_higher_of_the_fma_peak_and_the_library_gemm(write_config, monkeypatch):
    from harness.results.rows import peak_columns

    cfg, peaks, asked = _peaks(write_config, monkeypatch, "float32", {"numpy": 99.0, "fma": 114.0})
    assert sorted(asked) == [("float32", "fma"), ("float32", "numpy")]
    assert peaks == {"float32|threads=1|numpy": 99.0, "float32|threads=1|fma": 114.0, "float32|threads=1": 114.0}
    assert peak_columns(cfg.cells()[0], peaks, None)["gemm_peak_library"] == "fma"
    # a library that beats the kernel (a clock boost during its run) sets the roof instead
    cfg, peaks, _ = _peaks(write_config, monkeypatch, "float32", {"numpy": 120.0, "fma": 114.0})
    assert peaks["float32|threads=1"] == 120.0
    assert peak_columns(cfg.cells()[0], peaks, None)["gemm_peak_library"] == "numpy"


def test_a_known_roof_is_not_measured_again(write_config, monkeypatch):
    _, peaks, asked = _peaks(write_config, monkeypatch, "float32", {"numpy": 1.0, "fma": 2.0},
                             known={"float32|threads=1": 5.0})
    assert peaks == {} and asked == []


def test_a_run_recorded_before_the_hardware_peak_reads_its_numpy_roof():
    from harness.worker.cpu_roofs import roof_library

    assert roof_library({"float32|threads=1": 99.0}, "float32", 1) == "numpy"
    assert roof_library({"float32|threads=1": 99.0}, "float32", 2) is None


def test_the_fma_rate_is_measured_by_the_engine_kernel():
    from harness.worker.cpu_roofs import HARDWARE, gemm_rate

    try:
        from backends import _native
    except ImportError:
        pytest.skip("the native engine is not built")
    if not hasattr(_native, "fma_peak"):
        pytest.skip("this engine has no FMA peak kernel")
    assert gemm_rate("float32", HARDWARE, seconds=0.05) > 0
    if _native.bf16_cpu():
        assert gemm_rate("bfloat16", HARDWARE, seconds=0.05) > 0
    with pytest.raises(HarnessError, match="unavailable"):
        gemm_rate("float64", HARDWARE, seconds=0.01)


def test_a_runs_float32_gemm_text_is_numpys_product_not_the_fma_roof():
    from harness.results.labels import gemm_peak_text

    meta = {"gemm_peak_gflops": {"float32|threads=1": 200.0, "float32|threads=1|numpy": 100.0,
                                 "float32|threads=1|fma": 200.0, "float64|threads=1": 50.0}}
    assert gemm_peak_text(meta) == "float32 GEMM 100 GFLOP/s"
    assert gemm_peak_text({"gemm_peak_gflops": {"float32|threads=2": 180.0}}) == "float32 GEMM 180 GFLOP/s"  # older runs


def test_a_roofline_panel_whose_roof_is_the_fma_kernel_says_so(tmp_path, monkeypatch):
    import pandas as pd

    from harness.results import plot_roofline

    drawn = []
    save = plot_roofline._save
    monkeypatch.setattr(plot_roofline, "_save", lambda plt, fig, *a, **k: (drawn.extend(
        t.get_text() for ax in fig.axes for t in ax.texts), save(plt, fig, *a, **k))[1])
    row = {"status": "ok", "device": "cpu", "threads": 1, "model": "lstm", "batch": 16, "input_size": 512,
           "hidden_size": 512, "output_size": 512, "backend": "native", "variant": None, "workload": "train_step",
           "dtype": "float32", "gflops": 90.0, "gemm_peak_gflops": 118.0, "gemm_peak_library": "fma",
           "master_peak_gflops": None}
    plot_roofline.plot_roofline(pd.DataFrame([row]), tmp_path / "roofline.png")
    assert any("float32 FMA peak 118 GFLOP/s (the native engine's register-only FMA kernel)" in t for t in drawn), drawn
