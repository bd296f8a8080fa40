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


def _texts_of(monkeypatch, module, draw):
    """The figure's panels as drawn: per panel its texts' strings and their places (axes fraction)."""
    drawn = {}

    def keep(plt, fig, axes, n, out, **kw):
        drawn["axes"] = [ax for ax in fig.axes if ax.get_visible()]
        drawn["fig"] = fig
        return out

    monkeypatch.setattr(module, "_save", keep)
    assert draw() is not None
    return drawn


def test_scaling_and_thread_lines_are_named_at_their_right_ends_clear_of_each_other(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from harness.results import plot_sweeps

    # four backends whose lines end at nearly one time: their names must be nudged apart
    near = lambda backend, hidden, n: 4e-3 * (1 + 0.01 * ["numpy", "native", "jax", "torch"].index(backend)) / n
    df = _rows(["numpy", "native", "jax", "torch"], [1, 2, 4], [100], near)
    drawn = _texts_of(monkeypatch, plot_sweeps, lambda: plot_sweeps.plot_threads(df, tmp_path / "t.png"))
    ax = drawn["axes"][0]
    names = {t.get_text(): t for t in ax.texts}
    assert len(names) == 4 and {n.split(":")[0] for n in names} == {"numpy", "native", "jax", "torch"}
    assert ax.get_legend() is None  # the names replace the legend
    fig = drawn["fig"]
    fig.tight_layout()  # as the plot is saved
    fig.canvas.draw()
    from matplotlib.text import Text

    boxes = sorted((Text.get_window_extent(t) for t in names.values()), key=lambda b: b.y0)  # the words, not leaders
    assert all(a.y1 <= b.y0 + 0.5 for a, b in zip(boxes, boxes[1:]))  # no two names overlap
    last_x = ax.transData.transform((4, 1e-3))[0]
    assert all(b.x0 > last_x for b in boxes)  # right of the lines' last points
    assert all(b.x1 <= ax.get_window_extent().x1 + 1 for b in boxes)  # inside the panel
    plt.close(fig)

    sizes = df.assign(threads=1, output_size=2)
    sizes = pd.concat([sizes.assign(hidden_size=h, median_s=sizes["median_s"] * h / 100) for h in (100, 200, 400)])
    drawn = _texts_of(monkeypatch, plot_sweeps, lambda: plot_sweeps.plot_scaling(sizes.drop_duplicates(
        ["backend", "hidden_size"]), tmp_path / "s.png"))
    ax = drawn["axes"][0]
    assert {t.get_text() for t in ax.texts} == set(names) and ax.get_legend() is None
    plt.close(drawn["fig"])
