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
