"""Plots and reports from results tables: each plot only with its data, a self-contained HTML report.

The runs here are built from synthetic timings passed through the runner's own row
making (harness.results.rows), so every column is what a real run writes, no worker starts, and
CPU/GPU cells exist on a machine without a GPU.
"""

import json
import os
import shutil
import subprocess
from itertools import groupby
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import harness
from harness.cli import app
from harness.config import load_config
from harness.results.plots import arithmetic_intensity, crossover_batch, make_plots
from harness.results.report import build_report, to_markdown, write_report
from harness.results.store import RunStore
from harness.run.group import Outcome
from harness.run.runner import Runner, finish_meta, new_run_meta

SWEEP = """
name: synthetic
seed: 1
model: {kind: elman, hidden: 64}
task: {kind: random, input_size: 32, output_size: 32, seq_len: 10}
workloads: [train_step]
batch: [1, 64]
threads: [1, 2]
device: [cpu, gpu]
backends: [ref, 'ref:slow', 'bad:raise', 'bad:unsupported']
---
model: {kind: elman, hidden: 16}
task: {kind: lm_markov, vocab: 30, seq_len: 8, n_sequences: 64, n_eval: 16}
workloads: [train]
batch: [4, 8]
threads: [1, 2]
device: [cpu]
backends: [ref, 'ref:slow']
train: {epochs: 2, lr: 0.1, eval_every: 32, target_loss: 3.0, patience: 2}
"""
CPU_ONLY = """
name: small
seed: 1
model: {kind: elman, hidden: 32}
task: {kind: random, input_size: 16, output_size: 16, seq_len: 5}
workloads: [train_step]
batch: [2]
backends: [ref, 'ref:slow']
"""
ALL_PLOTS = {"speedup.png", "loss_vs_time.png", "scaling.png", "roofline.png", "threads_batch.png", "crossover.png",
             "train_tradeoff.png", "threads.png"}


def _seconds(cell) -> float:
    """A plausible cost model: CPU time grows with the batch, the GPU pays a fixed launch cost."""
    p = cell.problem
    if p.device == "cpu":
        t = (2e-4 + 1e-4 * p.batch) / (1.6 if cell.threads == 2 else 1.0)
    else:
        t = 1.5e-3 + 4e-6 * p.batch
    return t * (1.5 if cell.backend.endswith(":slow") else 1.0)


def _train_result(cell, rng) -> dict:
    step = _seconds(cell)
    curve, wall = [], 0.0
    for k, loss in enumerate([3.4, 3.1, 2.95, 2.9, 2.88]):
        curve.append({"epoch": k // 3, "examples": 32 * k, "wall_s": wall, "loss": loss, "split": "eval", "lr": 0.1})
        wall += 8 * step
    return {"curve": curve, "step_samples": list(step * (1 + 0.02 * rng.standard_normal(40))), "train_s": wall,
            "eval_s": 0.01, "time_to_target_s": curve[3]["wall_s"], "stop": "target", "status": "ok",
            "peak_rss_mb": 90.0}


def synthetic_run(path: Path, text: str):
    """A results folder whose rows come from the runner's row making with synthetic samples."""
    config_path = path.parent / f"{path.name}.yaml"
    config_path.write_text(text)
    cfg = load_config(config_path)
    store = RunStore.create(path, new_run_meta(cfg))
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 90.0, "float32|threads=2": 180.0}
    store.meta["gemm_peak_gflops"] = runner.gemm_peaks
    rng = np.random.default_rng(0)
    for _, group in groupby(cfg.cells(), key=lambda c: c.group_key):
        outcomes = []
        for cell in group:
            if cell.backend == "bad:unsupported":
                outcomes.append(Outcome(cell, "unsupported", "unsupported: this test backend supports nothing"))
            elif cell.backend == "bad:raise":
                outcomes.append(Outcome(cell, "error", "RuntimeError: kernel exploded\nTraceback: in sgd_step", compile_s=0.1))
            elif cell.problem.workload == "train":
                result = _train_result(cell, rng)
                outcomes.append(Outcome(cell, compile_s=0.3, samples=result["step_samples"], peak_rss_mb=90.0,
                                        train=result, data_meta={"loss_floor": 2.5}, versions={"numpy": np.__version__}))
            else:
                samples = list(_seconds(cell) * (1 + 0.03 * rng.standard_normal(12)))
                outcomes.append(Outcome(cell, compile_s=0.2, samples=samples, peak_rss_mb=100.0,
                                        versions={"numpy": np.__version__}))
        store.add_group(outcomes, runner.gemm_peaks, runner.gpu_roofs)
    finish_meta(store)
    return path


@pytest.fixture(scope="module")
def registered():
    """The test backends of tests/fake_backends.py, registered for the whole module (as conftest's fixture does)."""
    tests = str(Path(__file__).resolve().parent)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_BACKENDS", "ref=fake_backends:RefBackend,bad=fake_backends:BadBackend")
        mp.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
        mp.syspath_prepend(tests)
        yield


@pytest.fixture(scope="module")
def sweep_run(registered, tmp_path_factory):
    """A CPU/GPU x threads x batch sweep with failures and a training curve, its report written once."""
    run = synthetic_run(tmp_path_factory.mktemp("runs") / "sweep", SWEEP)
    write_report(run)
    return run


@pytest.fixture(scope="module")
def small_run(registered, tmp_path_factory):
    return synthetic_run(tmp_path_factory.mktemp("runs") / "small", CPU_ONLY)


def test_every_plot_is_drawn_when_the_run_has_its_data(sweep_run):
    made = sorted((sweep_run / "plots").glob("*.png"))
    assert {p.name for p in made} == ALL_PLOTS
    for p in made:
        assert p.stat().st_size > 10_000
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_plots_are_skipped_without_their_data(small_run):
    names = {p.name for p in make_plots(small_run)}
    # one batch, one thread count, CPU only, no training: nothing to sweep, cross or curve
    assert names == {"speedup.png", "roofline.png"}


def test_crossover_batch():
    cpu = pd.Series([1.0, 2.0, 3.0, 4.0], index=[1, 4, 16, 64])
    assert crossover_batch(cpu, pd.Series([5.0, 2.5, 1.0, 0.5], index=[1, 4, 16, 64])) == 16
    assert crossover_batch(cpu, pd.Series([0.5] * 4, index=[1, 4, 16, 64])) == 1
    assert crossover_batch(cpu, pd.Series([9.0] * 4, index=[1, 4, 16, 64])) is None
    # a GPU win in the middle that does not last is no crossover
    assert crossover_batch(cpu, pd.Series([5.0, 1.0, 9.0, 9.0], index=[1, 4, 16, 64])) is None


def test_arithmetic_intensity_grows_with_batch_and_matches_a_hand_count():
    df = pd.DataFrame({"model": ["elman", "elman", "lstm"], "dtype": ["float32", "float32", "float64"],
                       "batch": [1, 64, 64], "input_size": [10, 10, 10], "hidden_size": [20, 20, 20],
                       "output_size": [5, 5, 5], "layers": [1, 1, 1], "tokens": [False, False, False]})
    ai = arithmetic_intensity(df)
    weights = 20 * (10 + 20) + 20 * 5  # W_xh, W_hh, W_hy for one step
    moved = 4 * (weights + 1 * (10 + 20 + 20 + 20 + 5))
    assert ai.iloc[0] == pytest.approx(2 * weights / moved)
    assert ai.iloc[1] > 5 * ai.iloc[0]
    assert ai.iloc[2] != ai.iloc[1]  # gates and dtype count


def test_report_is_complete_and_self_contained(sweep_run):
    md, page = (sweep_run / "report.md").read_text(), (sweep_run / "report.html").read_text()
    for section in ("## Run", "## Machine", "## Library versions", "## Conformance", "## Results", "## Plots",
                    "## Failed and unsupported cells", "## Training"):
        assert section in md
    for name in ALL_PLOTS:
        assert f"(plots/{name})" in md
    # every image inline, nothing fetched from disk or network
    assert page.count('src="data:image/png;base64,') == len(ALL_PLOTS)
    assert "plots/" not in page.replace("plots/ ", "") and "http://" not in page and "https://" not in page
    assert "<link" not in page and "<script" not in page
    # speedup with its interval, failures with reasons, training outcome
    assert "0.667x [" in md or "x [0.6" in md
    assert "kernel exploded" in md and "unsupported: this test backend supports nothing" in md
    assert "harness check --backends" in md and "holds no conformance record" in md
    t = harness.load_run(sweep_run).timings
    final = t[t["workload"] == "train"]["final_loss"].iloc[0]
    assert f"| {final:.4g} | 2.5 | 3 |" in md
    assert "GEMM peak, float32, threads 2 | 180 GFLOP/s" in md


def test_report_shows_a_stored_conformance_record_and_worker_flags(sweep_run, tmp_path):
    run = shutil.copytree(sweep_run, tmp_path / "run")
    meta = json.loads((run / "run.json").read_text())
    meta["conformance"] = {"ref": {"pass": 312, "fail": 0, "unsupported": 12}}
    meta["worker_env"] = {"jax": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "1"}}
    (run / "run.json").write_text(json.dumps(meta))
    title, blocks = build_report(run, plots=[])
    md = to_markdown(title, blocks, run)
    assert "holds no conformance record" not in md
    assert "| ref | 312 | 0 | 12 |" in md
    assert "| jax | `XLA_FLAGS=--xla_cpu_multi_thread_eigen=false` |" in md  # thread counts are per cell, not listed


def test_the_report_answers_first_and_folds_the_environment_after_the_results(sweep_run, tmp_path):
    run = shutil.copytree(sweep_run, tmp_path / "run")
    meta = json.loads((run / "run.json").read_text())
    cache = "/home/someone/checkout/.harness/cache/jax"
    blas = "/home/someone/checkout/.venv/lib/python3.11/site-packages/scipy.libs/libscipy_openblas-6cdc3b4a.so"
    meta["versions"] = {"jax": {"jax": "0.4.38", "jax_compilation_cache_dir": cache},
                        "native": {"blas": f"OpenBLAS ({blas})"}}
    meta["worker_env"] = {"jax": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}}
    (run / "run.json").write_text(json.dumps(meta))
    write_report(run)
    md, page = (run / "report.md").read_text(), (run / "report.html").read_text()
    order = ["Answer", "Results", "Plots", "Failed and unsupported cells", "Training", "Run", "Machine",
             "Library versions", "Conformance"]
    # the answer and the figures first, the environment after them (as asv and pytest-benchmark put it)
    for text in (md, page):
        heads = [h for h in order if f"## {h}\n" in text or f'<h2 id="{h.lower().replace(" ", "-")}">' in text]
        assert heads == order
        at = [text.index(f"## {h}\n") if f"## {h}\n" in text else text.index(f'<h2 id="{h.lower().replace(" ", "-")}">')
              for h in order]
        assert at == sorted(at), "sections out of order"
        before = text[:at[order.index("Machine")]]
        assert "](plots/" in before or "data:image/png" in before  # the figures come before the machine
        # the library versions and each backend's own environment are folded; the machine's long table too
        tail = text[at[order.index("Machine")]:]
        assert tail.count("<details><summary>") >= 3 and tail.count("</details>") == tail.count("<details><summary>")
        versions = tail[tail.index("Library versions"):tail.index("Conformance")]
        assert versions.index("<details><summary>") < versions.index("jax_compilation_cache_dir")
        assert versions.index("<details><summary>") < versions.index("XLA_FLAGS")
        # local paths from the environment's or the cache's name on, never the absolute prefix
        assert "/home/someone" not in text
        assert "jax_compilation_cache_dir .harness/cache/jax" in text
        assert ".venv/…/scipy.libs/libscipy_openblas-6cdc3b4a.so" in text
    # in Markdown the folded table keeps the blank lines GitHub needs to render it inside <details>
    assert "</summary>\n\n| backend | libraries" in md
    # a short section stays open: the Run table of this run has fewer than 16 lines
    run_part = md.split("## Run\n", 1)[1].split("\n## ", 1)[0]
    assert "<details>" not in run_part and "| run id |" in run_part


def test_short_path_keeps_what_identifies_a_path():
    from harness.results.report_blocks import short_path, short_paths

    assert short_path("/work/main/.harness/envs/theano/lib/python3.11/site-packages/scipy_openblas32/lib/x.so") == \
        "theano/…/scipy_openblas32/lib/x.so"
    assert short_path("/work/main/.harness/cache/envs/pytensor@2.30.3/pytensor/blas") == \
        ".harness/cache/envs/pytensor@2.30.3/pytensor/blas"
    assert short_path("/usr/bin/g++") == "/usr/bin/g++"  # a system path says what it is as it is
    assert short_paths("flags -O3 -march=native, cache /a/b/.harness/cache/jax, -L/a/b/.harness/blas -lx") == \
        "flags -O3 -march=native, cache .harness/cache/jax, -L.harness/blas -lx"


def test_report_command(small_run):
    result = CliRunner().invoke(app, ["report", str(small_run)])
    assert result.exit_code == 0, result.output
    assert "report.html" in result.output and (small_run / "report.md").exists()
    assert (small_run / "report.html").read_text().count("data:image/png;base64,") == 2
    missing = CliRunner().invoke(app, ["report", str(small_run / "nowhere")])
    assert missing.exit_code == 2 and "not a results folder" in missing.output


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(_browser() is None, reason="no Chromium or Chrome found for the headless rendering test")
def test_report_renders_in_a_headless_browser(sweep_run, tmp_path):
    from matplotlib import image

    html_path = sweep_run / "report.html"
    shot = tmp_path / "report.png"
    cmd = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           f"--screenshot={shot}", "--window-size=1200,1600", html_path.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
    pixels = image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (1600, 1200)
    colours = np.unique((pixels.reshape(-1, 3) * 255).round().astype(np.uint8), axis=0)
    inked = (pixels.min(axis=2) < 0.9).mean()
    assert len(colours) > 100, "the page rendered (nearly) blank"
    assert inked > 0.02


EXAMPLES = Path(__file__).resolve().parents[1] / "results" / "examples"


def test_a_paired_run_s_answer_answers_the_paired_question_first():
    title, blocks = build_report(EXAMPLES / "mixed_precision", plots=[])
    md = to_markdown(title, blocks, EXAMPLES / "mixed_precision")
    answer = md.split("## Answer", 1)[1].split("\n## ", 1)[0]
    paired, baseline = answer.split("### Against the baseline")
    assert "speedup over float32 [95% CI]" in paired
    # marked as settings.png marks it: its interval is wider than the run's ±2% target
    assert "| train_step · lstm D=512 H=512 T=25 B=64 2 thr | native | 106 ms | 56.4 ms | 1.88x [1.52, 2.31] † |" in paired
    assert "† interval wider than ±2%" in paired
    assert "| train_step · lstm D=512 H=512 T=25 B=64 2 thr | torch | 153 ms | unsupported | - |" in paired
    assert "fastest" in baseline
    # the first setting's own rows say so, not "1x [1, 1]"
    assert "1x [1, 1]" not in md.split("## Results", 1)[1].split("## ", 1)[0]


def test_mixed_precision_curves_share_one_axis_per_backend(monkeypatch, tmp_path):
    from harness.results import plot_training

    drawn = {}

    def keep(plt, fig, axes, n, out, **kw):
        drawn["axes"] = axes
        return out

    monkeypatch.setattr(plot_training, "_save", keep)
    curves = harness.load_run(EXAMPLES / "mixed_precision").curves
    assert plot_training.plot_loss_vs_time(curves, tmp_path / "loss.png") is not None
    axes = [ax for ax in drawn["axes"].flat if ax.get_visible()]
    native = next(ax for ax in axes if ax.get_title().startswith("native ·"))
    assert len(native.get_lines()) >= 2  # float32's curve and bfloat16's on one axis
    assert {t.get_text() for t in native.get_legend().get_texts()} >= {"float32", "bfloat16"}
    assert not any("float32" in ax.get_title() or "bfloat16" in ax.get_title() for ax in axes)


def test_a_run_s_commit_is_clean_when_only_outputs_and_untracked_files_differ(tmp_path):
    from harness.results.report_sections import _run_section
    from harness.run.machine import git_changes, git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results" / "examples" / "quick").mkdir(parents=True)
    (tmp_path / "results" / "examples" / "quick" / "timings.txt").write_text("old\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    # a run rewrote its committed folder, and left a new file: the code is still the commit's
    (tmp_path / "results" / "examples" / "quick" / "timings.txt").write_text("new\n")
    (tmp_path / "scratch.txt").write_text("untracked\n")
    assert git_changes(tmp_path) == [] and not git_commit(tmp_path).endswith("-dirty")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_changes(tmp_path) == ["code.py"] and git_commit(tmp_path).endswith("-dirty")
    meta = {"git_commit": git_commit(tmp_path), "git_changed": git_changes(tmp_path)}
    rows = _run_section(meta, pd.DataFrame(), tmp_path)[1].rows
    assert any(r[0] == "git commit" and "-dirty` (changed: `code.py`)" in r[1] for r in rows)


def test_the_answer_reads_a_sweep_in_order_and_says_in_words_where_the_baseline_is_fastest():
    title, blocks = build_report(EXAMPLES / "lstm_gpu", plots=[])
    answer = to_markdown(title, blocks, EXAMPLES / "lstm_gpu").split("## Answer", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in answer.splitlines() if line.startswith("| forward") or line.startswith("| train_step")]
    # run order was B=64 forward, B=64 train_step, then B=1 and 16 of each: the reader gets each workload's sweep
    assert [r.split(" · ")[0].strip("| ") + " " + r.split(" B=")[1].split()[0] for r in rows] == [
        "forward 1", "forward 16", "forward 64", "train_step 1", "train_step 16", "train_step 64"]
    assert "| cuda (1.31 ms) | 4.03x [3.67, 5.13] |" in rows[0]
    # the answer first: who was fastest how often
    assert "The fastest backend per comparison group: cuda in 6 of 6 groups." in answer.split("| problem")[0]
    # the results follow the Answer's order
    results = to_markdown(title, blocks, EXAMPLES / "lstm_gpu").split("## Results", 1)[1]
    heads = [line for line in results.splitlines() if line.startswith("### ")]
    assert [h.split(" B=")[1].split()[0] for h in heads[:3]] == ["1", "16", "64"] and heads[0].startswith("### forward")


def test_where_the_baseline_is_fastest_the_answer_says_so_in_words():
    title, blocks = build_report(EXAMPLES / "numpy_vs_theano", plots=[])
    answer = to_markdown(title, blocks, EXAMPLES / "numpy_vs_theano").split("## Answer", 1)[1].split("\n## ", 1)[0]
    assert "1x [1, 1]" not in answer
    assert "| numpy (1.53 ms) | numpy fastest; next: pytensor:jax 0.945x [0.928, 0.965] † |" in answer
    assert "numpy (the baseline) in 3 of 3 groups." in answer.split("| problem")[0]


def test_the_terminal_summary_gives_each_group_s_answer_first_in_the_answer_s_order():
    from rich.console import Console

    from harness.results.terminal import print_summary

    t = pd.read_parquet(EXAMPLES / "numpy_vs_theano" / "timings.parquet")
    console = Console(width=80, record=True, color_system=None)
    print_summary(t, {"name": "numpy_vs_theano", "baseline": "numpy"}, console)
    text = console.export_text()
    assert "numpy (the baseline) in 3 of 3 groups" in text
    lines = text.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("train_step elman V=8000 H=100 T=20 B=1 float32"))
    assert lines[title + 1].startswith("numpy fastest; next: pytensor:jax 0.945x [0.928, 0.965]")
    last = next(i for i, line in enumerate(lines) if line.startswith("train_step elman D=512"))
    assert lines[last + 1].startswith("numpy fastest; next: pytensor:jax 0.979x [0.969, 0.996]")
    assert "1x [1, 1]" not in text


def test_reading_order_puts_the_batch_innermost_and_the_workloads_in_order():
    from harness.results.labels import reading_order

    def block(workload, batch, threads=1):
        return (None, pd.DataFrame([{"model": "lstm", "input_size": 4, "hidden_size": 8, "seq_len": 5, "tokens": False,
                                     "batch": batch, "dtype": "float32", "threads": threads, "device": "cpu",
                                     "workload": workload, "bptt": "full", "layers": 1}]))

    blocks = [block("train_step", 64), block("forward", 64), block("train_step", 1, 2), block("train_step", 1),
              block("forward", 1)]
    got = [(b.iloc[0]["workload"], int(b.iloc[0]["batch"]), int(b.iloc[0]["threads"])) for _, b in reading_order(blocks)]
    assert got == [("forward", 1, 1), ("forward", 64, 1), ("train_step", 1, 1), ("train_step", 64, 1),
                   ("train_step", 1, 2)]
