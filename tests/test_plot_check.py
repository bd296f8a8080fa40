"""Plots are outputs of runs, checked like tables: each file stamped with what drew it, ``harness docs
--check`` failing on a plot or report that today's code would not draw from its run; one palette."""

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.results import plots
from harness.results.report import check_report, write_report
from harness.spec.errors import HarnessError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "results" / "examples" / "lstm_gpu"  # small: six groups, three plots


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "examples" / "lstm_gpu"
    shutil.copytree(EXAMPLE, folder)
    write_report(folder)
    return folder


def test_a_fresh_drawing_checks_clean_and_every_file_carries_its_stamp(run):
    assert plots.check_plots(run) == [] and check_report(run) == []
    files = sorted(p.name for p in (run / "plots").iterdir() if p.suffix in (".png", ".svg"))
    assert "speedup.png" in files and "speedup.svg" in files  # SVG beside every PNG
    stamps = {name: plots.read_stamp(run / "plots" / name) for name in files}
    assert all(stamps.values()) and len(set(stamps.values())) == len(files)


def test_swapped_plots_other_rows_stray_files_and_a_missing_manifest_are_caught(run):
    folder = run / "plots"
    a, b = folder / "speedup.png", folder / "scaling.png"
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    problems = plots.check_plots(run)
    assert any("speedup.png: not the plot drawn under this name" in p for p in problems)
    assert any("scaling.png: not the plot drawn under this name" in p for p in problems)
    plots.make_plots(run)
    assert plots.check_plots(run) == []
    # other rows: the same files, but the table changed since they were drawn
    t = pd.read_parquet(run / "timings.parquet")
    t.loc[t.index[0], "median_s"] = float(t["median_s"].iloc[0]) * 2
    t.to_parquet(run / "timings.parquet")
    assert any("drawn from other rows" in p for p in plots.check_plots(run))
    assert any("report.md" in p for p in check_report(run))
    plots.make_plots(run)
    (folder / "old.png").write_bytes(a_bytes)
    assert any("old.png not drawn by harness plot" in p for p in plots.check_plots(run))
    plots.make_plots(run)  # a redraw removes what it does not draw
    assert not (folder / "old.png").exists()
    (folder / plots.MANIFEST).unlink()
    assert any("no plots.json" in p for p in plots.check_plots(run))


def test_a_plugin_installed_or_removed_leaves_every_stamp_as_it_was(run, fake_backends, monkeypatch):
    """The stamps depend on what the run holds: registering backends it does not hold (a plugin installed
    after the run was drawn, the test backends here) makes neither its plots nor its report stale."""
    monkeypatch.delenv("HARNESS_BACKENDS")
    plots.make_plots(run)
    write_report(run)
    assert plots.check_plots(run) == [] and check_report(run) == []
    monkeypatch.setenv("HARNESS_BACKENDS", "ref=fake_backends:RefBackend,bad=fake_backends:BadBackend")
    assert plots.check_plots(run) == [] and check_report(run) == []
    # a backend the run does hold still counts: its class's variants colour its cells
    held = str(pd.read_parquet(run / "timings.parquet")["backend"].iloc[0])
    assert plots.plotting_code_digest([held]) != plots.plotting_code_digest([held, "ref"])


def test_docs_check_fails_on_a_swapped_plot_and_docs_redraws_it(run, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# results\n\n<!-- table: speedups lstm_gpu -->\n<!-- /table -->\n")
    args = ["docs", "--page", str(page), "--examples", str(run.parent)]
    assert CliRunner().invoke(app, args).exit_code == 0
    ok = CliRunner().invoke(app, args + ["--check"])
    assert ok.exit_code == 0, ok.output
    folder = run / "plots"
    speedup, roofline = (folder / "speedup.png").read_bytes(), (folder / "roofline.png").read_bytes()
    (folder / "speedup.png").write_bytes(roofline)
    (folder / "roofline.png").write_bytes(speedup)
    bad = CliRunner().invoke(app, args + ["--check"])
    flat = " ".join(bad.output.split())  # the console wraps long paths
    assert bad.exit_code == 1 and "speedup.png: not the plot drawn under this name" in flat.replace("\n", "")
    fixed = CliRunner().invoke(app, args)
    assert fixed.exit_code == 0 and "plots and report redrawn" in fixed.output
    assert CliRunner().invoke(app, args + ["--check"]).exit_code == 0


def test_one_palette_libraries_keep_their_hue_and_no_two_labels_of_a_plot_share_a_colour():
    labels = ["numpy 2.4.6", "jax 0.10.2", "jax 0.4.38", "pytensor 2.30.3", "pytensor 2.31.7", "pytensor:numba",
              "jax:unroll=4", "numpy", "myplugin", "otherplugin:fast"]
    palette = plots._palette(None, labels)
    assert len(set(palette.values())) == len(labels)
    # a library's own colour does not depend on the plot it is in
    assert plots._palette(None, ["numpy", "jax"])["numpy"] == plots._palette(None, ["torch", "numpy"])["numpy"]
    assert palette["numpy"] == plots.backend_colour("numpy")
    # versions are shades of their library's hue: closer to it than to any other library's
    jax, numpy = np.array(plots.backend_colour("jax")), np.array(plots.backend_colour("numpy"))
    v = np.array(palette["jax 0.4.38"])
    assert np.linalg.norm(v - jax) < np.linalg.norm(v - numpy)
    # plugins get none of the fixed hues
    fixed = {tuple(round(c, 4) for c in plots._shade(plots._hue(n), 0)) for n in ("numpy", "torch", "jax", "native",
                                                                                  "numba", "theano", "pytensor",
                                                                                  "halide", "cuda")}
    assert tuple(round(c, 4) for c in palette["myplugin"]) not in fixed


def test_a_speedup_plot_whose_cells_all_ran_draws(tmp_path):
    t = pd.read_parquet(EXAMPLE / "timings.parquet")
    assert plots.plot_speedup(t[t["status"] == "ok"], tmp_path / "speedup.png") is not None
    assert (tmp_path / "speedup.svg").exists()


def test_drawing_twice_writes_the_same_bytes_svg_included(run):
    # a redrawing of unchanged rows must leave git nothing to see: no date in an SVG, no random element ids
    before = {p.name: p.read_bytes() for p in (run / "plots").iterdir()}
    plots.make_plots(run)
    after = {p.name: p.read_bytes() for p in (run / "plots").iterdir()}
    assert any(name.endswith(".svg") for name in before)
    assert before == after
    assert all(b"<dc:date>" not in v for name, v in after.items() if name.endswith(".svg"))


def test_speedups_are_points_on_one_axis_centred_on_1x_in_panels_by_what_was_swept(monkeypatch, tmp_path):
    from harness.results import plot_speedup

    drawn = {}

    def keep(plt, fig, axes, n, out, **kw):
        drawn["axes"] = axes
        return out

    monkeypatch.setattr(plot_speedup, "_save", keep)
    t = pd.read_parquet(EXAMPLE / "timings.parquet")  # forward and train_step at batch 1, 16 and 64
    # the six cuda variants' train steps at batch 64 failed (as in an earlier run of this config)
    failed = (t["workload"] == "train_step") & (t["batch"] == 64) & (t["backend"] == "cuda")
    assert failed.sum() == 6
    t.loc[failed, "status"] = "error"
    t.loc[failed, ["median_s", "speedup", "speedup_lo", "speedup_hi"]] = float("nan")
    assert plots.plot_speedup(t, tmp_path / "speedup.png") is not None
    axes = drawn["axes"]
    # rows by workload, columns by batch in its order (the run listed them 64, 1, 16)
    assert [[ax.get_title() for ax in row] for row in axes] == [
        ["forward · B=1", "forward · B=16", "forward · B=64"],
        ["train_step · B=1", "train_step · B=16", "train_step · B=64"]]
    limits = {ax.get_xlim() for ax in axes.flat}
    assert len(limits) == 1  # one axis for every panel
    lo, hi = limits.pop()
    assert lo * hi == pytest.approx(1.0) and hi > 1 / 0.0266  # centred on 1x, wide enough for the slowest
    assert all(not ax.patches for ax in axes.flat)  # points, not bars from an arbitrary edge
    # failures keep their rows, with why
    texts = [t.get_text() for t in axes[1, 2].texts]
    assert texts.count("not timed: error") == 6
    # variants of one library differ by marker as well as shade
    assert plots.backend_marker("cuda") != plots.backend_marker("cuda:persistent")


def test_a_gpu_roofline_reads_in_tflops_and_tbs_with_a_share_axis_that_stops_at_100_percent(monkeypatch, tmp_path):
    from harness.results import plot_roofline

    drawn = {}

    def keep(plt, fig, axes, n, out, **kw):
        drawn["fig"], drawn["axes"] = fig, axes
        return out

    monkeypatch.setattr(plot_roofline, "_save", keep)
    t = pd.read_parquet(EXAMPLE / "timings.parquet")  # an H200: roofs of tens and hundreds of TFLOP/s
    assert plots.plot_roofline(t, tmp_path / "roofline.png") is not None
    ax = drawn["axes"].flat[0]
    assert ax.get_title() == "GPU · float32"  # no CPU thread count on a GPU panel
    assert ax.get_ylabel() == "achieved TFLOP/s"
    texts = [x.get_text() for x in ax.texts]
    assert any("TB/s" in x for x in texts) and any("TFLOP/s" in x for x in texts)
    assert not any("e+" in x for x in texts)
    share = next(other for other in drawn["fig"].axes if other is not ax and other.bbox.bounds == ax.bbox.bounds)
    assert max(share.get_yticks()) <= 100


def test_a_drawing_no_longer_drawn_is_removed_by_the_write_rule_and_a_link_in_its_place_is_refused(run, tmp_path):
    """A stray drawing of an earlier code is removed at the next drawing; a link of a drawing's name (into
    another folder) is not followed: refused, naming it, and what it points at is left alone."""
    folder = run / "plots"
    (folder / "crossover.png").write_bytes(b"an earlier drawing")
    plots.make_plots(run)
    assert not (folder / "crossover.png").exists()
    outside = tmp_path / "elsewhere.png"
    outside.write_bytes(b"someone's picture")
    (folder / "crossover.png").symlink_to(outside)
    with pytest.raises(HarnessError, match="crossover.png"):
        plots.make_plots(run)
    assert outside.read_bytes() == b"someone's picture"
