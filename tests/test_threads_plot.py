"""The thread-scaling plot: drawn from a results table that sweeps threads, skipped without one."""

import numpy as np
import pandas as pd
import pytest

from harness.results.plots import plot_threads


def _rows(backends, threads, problems, seconds):
    rows = []
    for hidden in problems:
        for backend in backends:
            for n in threads:
                med = seconds(backend, hidden, n)
                rows.append({"status": "ok", "backend": backend, "variant": "default", "model": "elman",
                             "hidden_size": hidden, "seq_len": 50, "batch": 32, "dtype": "float32",
                             "input_size": 128, "tokens": False, "threads": n, "device": "cpu", "bptt": "full",
                             "layers": 1, "activation": "tanh", "workload": "train_step", "median_s": med,
                             "iqr_s": 0.05 * med})
    return pd.DataFrame(rows)


def _cost(backend, hidden, n):
    base = 4e-3 if hidden == 100 else 40e-3
    return base / (n ** (0.8 if backend == "native" else 0.5))


def test_threads_plot_draws_a_panel_per_problem(tmp_path):
    pytest.importorskip("matplotlib")
    df = _rows(["numpy", "native"], [1, 2, 4], [100, 512], _cost)
    out = plot_threads(df, tmp_path / "threads.png")
    assert out == tmp_path / "threads.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from matplotlib import image

    height, width = image.imread(out).shape[:2]
    assert width > 1.5 * height  # two panels side by side


def test_threads_plot_needs_two_thread_counts_of_one_backend(tmp_path):
    pytest.importorskip("matplotlib")
    single = _rows(["numpy", "native"], [1], [100], _cost)
    assert plot_threads(single, tmp_path / "a.png") is None
    # two thread counts in the table, but each backend ran at only one of them
    mixed = pd.concat([_rows(["numpy"], [1], [100], _cost), _rows(["native"], [2], [100], _cost)])
    assert plot_threads(mixed, tmp_path / "b.png") is None
    failed = _rows(["native"], [1, 2], [100], _cost).assign(status="error", median_s=np.nan)
    assert plot_threads(failed, tmp_path / "c.png") is None
    assert not any(tmp_path.iterdir())
