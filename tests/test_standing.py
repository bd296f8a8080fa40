"""What a run knows reaches every reader: the standing of each figure (trusted, contended, unsteady,
imprecise, not significant), computed once in harness/results/standing.py, in the report, the plots,
`harness compare`, the multi-run report, `load_run` and the terminal; ties named as ties.

The runs here are made from synthetic rounds passed through the runner's own row making (as
tests/test_report.py does): no worker starts, and a contended machine is what the guard would have
recorded while the rounds were timed.
"""

import json
import re
from itertools import groupby
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import harness
from harness.cli import app
from harness.config import load_config
from harness.results.store import RunStore
from harness.run.group import Outcome
from harness.run.runner import Runner, finish_meta, new_run_meta

CONFIG = """
name: standing
seed: 1
model: {kind: elman, hidden: 16}
task: {kind: random, input_size: 8, output_size: 8, seq_len: 5}
workloads: [train_step]
batch: [2, 4]
backends: [ref, 'ref:slow']
"""
#: other processes took both cores of a 2-core machine while the rounds were timed (two busy loops)
BUSY = {"seconds": 2.0, "n_samples": 4, "others_cores": 1.95, "others_cores_max": 2.0, "steal_share": 0.0,
        "load_mean": 3.0, "load_max": 3.5, "cores": 2}
QUIET = {**BUSY, "others_cores": 0.02, "others_cores_max": 0.05, "load_mean": 0.1, "load_max": 0.2}


def _rounds(scale: float, seed: int, n: int = 12, noise: float = 0.01) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(1e-3 * scale * (1 + noise * rng.standard_normal(n)))


def make_run(path: Path, scale=None, busy: bool = False, text: str = CONFIG, processes=None) -> Path:
    """A results folder of ``text``'s cells with synthetic rounds: ``scale(cell)`` the time of a cell in
    milliseconds (default: ref 1, ref:slow 1.5); ``busy``: every cell timed on a loaded machine;
    ``processes(cell)``: per round, the worker process that took it (None: unrecorded)."""
    config_path = path.parent / f"{path.name}.yaml"
    config_path.write_text(text)
    cfg = load_config(config_path)
    meta = new_run_meta(cfg)
    meta["machine"]["cores"] = 2  # the guard's readings above are of a 2-core machine
    store = RunStore.create(path, meta)
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 90.0, "float32|threads=2": 180.0}
    store.meta["gemm_peak_gflops"] = runner.gemm_peaks
    scale = scale or (lambda cell: 1.5 if cell.backend.endswith(":slow") else 1.0)
    for seed, (_, group) in enumerate(groupby(cfg.cells(), key=lambda c: c.group_key)):
        outcomes = []
        for k, cell in enumerate(group):
            samples = _rounds(scale(cell), 10 * seed + k)
            outcomes.append(Outcome(cell, compile_s=0.1, samples=samples, peak_rss_mb=50.0,
                                    versions={"numpy": np.__version__}, conditions=[BUSY if busy else QUIET],
                                    processes=processes(cell) if processes else None))
        store.add_group(outcomes, runner.gemm_peaks, runner.gpu_roofs)
    finish_meta(store)
    return path


def _table_rows(md: str, section: str) -> list[str]:
    """The body rows of the Markdown tables of a report's section (headers left out)."""
    lines = md.split(f"## {section}", 1)[1].split("\n## ", 1)[0].splitlines()
    return [line for i, line in enumerate(lines) if line.startswith("| ")
            and not (i + 1 < len(lines) and lines[i + 1].startswith("|-"))]


def _lead(row: str) -> tuple[float, float, float, str]:
    """The lead over the runner-up an Answer row shows: value, interval and the runner-up."""
    found = re.search(r"\| (\d+(?:\.\d+)?)x \[(\d+(?:\.\d+)?), (\d+(?:\.\d+)?)\] over ([\w:]+)", row)
    assert found, row
    return float(found.group(1)), float(found.group(2)), float(found.group(3)), found.group(4)


# -- load_run: identity and standing ---------------------------------------------------------------------
def test_load_run_labels_each_backend_as_the_config_names_it_with_its_standing(fake_backends, tmp_path):
    t = harness.load_run(make_run(tmp_path / "a")).timings
    assert set(t["backend"]) == {"ref"}
    assert set(t["label"]) == {"ref", "ref:slow"}  # torch and torch:fused apart, as the config names them
    assert set(t["time_standing"]) == {"trusted"}
    slow = t[t["label"] == "ref:slow"]
    assert set(slow["speedup_standing"]) == {"trusted"}  # 0.67x with a tight interval
    busy = harness.load_run(make_run(tmp_path / "b", busy=True)).timings
    assert set(busy["time_standing"]) == {"contended"}
    assert busy["time_standing_why"].str.contains("other processes used").all()
    assert set(busy.loc[busy["label"] == "ref:slow", "speedup_standing"]) == {"contended"}
    both = harness.load_runs([tmp_path / "a", tmp_path / "b"]).timings
    assert {"label", "speedup_standing", "time_standing"} <= set(both.columns)


def test_an_unsteady_cell_and_a_ratio_that_holds_1x_have_their_standing(fake_backends, tmp_path):
    from harness.results.standing import Standing, ratio_standing

    def processes(cell):
        return [0] * 6 + [1] * 6

    path = make_run(tmp_path / "a", processes=processes)
    store = RunStore.open(path)
    for row in store.timings:  # the second process of ref:slow ran 25% slower: its processes disagree
        if row["cell_id"].endswith("|ref:slow"):
            row["process_spread"] = 0.25
    store.save()
    t = harness.load_run(path).timings
    assert set(t.loc[t["label"] == "ref:slow", "time_standing"]) == {"unsteady"}
    assert set(t.loc[t["label"] == "ref:slow", "speedup_standing"]) == {"unsteady"}
    assert ratio_standing(1.02, 0.97, 1.08)[0] == Standing.NOT_SIGNIFICANT
    assert ratio_standing(1.5, 1.2, 1.9, target=0.05)[0] == Standing.IMPRECISE
    assert "wider than its ±5% target" in ratio_standing(1.5, 1.2, 1.9, target=0.05)[1]
    assert ratio_standing(1.5, 1.48, 1.52, target=0.05)[0] == Standing.TRUSTED


# -- the report and the plots of a contended run ----------------------------------------------------------
def test_every_row_of_a_contended_cell_carries_the_mark_in_both_reports_and_the_plot(fake_backends, tmp_path,
                                                                                      monkeypatch):
    from harness.results import plot_speedup
    from harness.results.report import write_report

    path = make_run(tmp_path / "busy", busy=True)
    drawn: dict = {}

    def keep(plt, fig, axes, n, out, **kw):
        drawn.setdefault(Path(out).name, []).append(
            ([t.get_text() for ax in fig.axes for t in ax.texts + [ax.xaxis.label]],
             [line.get_markerfacecolor() for ax in fig.axes for line in ax.lines
              if line.get_marker() not in (None, "None", "", " ", "|", "_")]))
        fig.savefig(out)
        plt.close(fig)
        return out

    monkeypatch.setattr(plot_speedup, "_save", keep)
    write_report(path)
    md = (path / "report.md").read_text()
    rows = _table_rows(md, "Results")
    assert len(rows) == 4 and all("(contended)" in r for r in rows)  # the baseline's own row too
    answer = _table_rows(md, "Answer")
    assert len(answer) == 2 and all("contended" in r for r in answer)
    page = (path / "report.html").read_text()
    results = page.split('id="results"', 1)[1].split("<h2", 1)[0]
    cells = re.findall(r"<tr class=\"st-ok\">(.*?)</tr>", results)
    assert len(cells) == 4 and all("(contended)" in c for c in cells)
    texts, faces = drawn["speedup.png"][0]
    assert any(t.endswith("x (contended)") for t in texts)  # each point's value carries the mark
    assert any("(contended), hollow: timed while" in " ".join(t.split()) for t in texts)  # the axis says what it means
    assert len(faces) == 4 and all(f == "white" for f in faces)  # every point drawn hollow: seen in greyscale


def test_a_quiet_run_s_report_and_plot_carry_no_disturbed_mark(fake_backends, tmp_path):
    from harness.results.report import build_report, to_markdown

    path = make_run(tmp_path / "quiet")
    title, blocks = build_report(path, plots=[])
    md = to_markdown(title, blocks, path)
    assert "(contended)" not in md and "(unsteady)" not in md


# -- harness compare ------------------------------------------------------------------------------
def _slower_b(cell):
    return 1.5 * 1.3 if cell.backend.endswith(":slow") else 1.0  # ref:slow 30% slower in B


def test_compare_against_a_contended_run_names_the_contention_first_and_does_not_exit_1(fake_backends, tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", scale=_slower_b, busy=True)
    result = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert result.exit_code == 3, result.output
    lines = result.output.splitlines()
    first = " ".join(result.output.split("B/A:", 1)[0].split())  # what is said before any figure
    assert "B " in first and "4 contended of 4 timed cells" in first and "quiet machine" in first
    assert "regression(s)" not in result.output
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    data = json.loads(CliRunner().invoke(app, ["compare", str(a), str(b), "--json"]).output)
    assert data["regressions"] == [] and len(data["unfair"]) == 4 and data["exit_code"] == 3
    assert {c["verdict"] for c in data["cells"]} == {"contended"}


def test_compare_judges_and_prints_the_drift_robust_ratio(fake_backends, tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", scale=_slower_b)
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--json"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    slow = [c for c in data["cells"] if c["backend"] == "ref:slow"]
    assert slow and all(c["verdict"] == "regression" and c["judged_on"] == "speedups" for c in slow)
    for c in slow:  # the printed figure is the judged one: B's speedup over its baseline / A's
        assert c["over"] == pytest.approx(c["speedup_b"] / c["speedup_a"])
        assert c["over_hi"] < 1 and c["over"] == pytest.approx(1 / 1.3, rel=0.05)
    text = CliRunner().invoke(app, ["compare", str(a), str(b)]).output
    assert "0.769x [" in text and "regression" in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_runs_of_different_machines_are_said_so_first_and_their_baseline_is_not_judged_on_time(fake_backends,
                                                                                                tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", scale=lambda cell: 1.3 * (1.5 if cell.backend.endswith(":slow") else 1.0))
    meta = json.loads((b / "run.json").read_text())
    meta["machine"]["cpu_model"] = "Another CPU"
    (b / "run.json").write_text(json.dumps(meta))
    result = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert result.exit_code == 0, result.output  # a slower host is no regression of the code
    assert "different machines: A " in result.output.split("B/A:", 1)[0]
    data = json.loads(CliRunner().invoke(app, ["compare", str(a), str(b), "--json"]).output)
    base = [c for c in data["cells"] if c["backend"] == "ref"]
    assert base and all(c["verdict"] == "not judged" and c["judged_on"] is None for c in base)
    assert all(c["ratio"] < 0.85 for c in base)  # the time ratio is there, as context


# -- the multi-run report -----------------------------------------------------------------------------
def test_a_multi_run_report_over_a_quiet_and_a_contended_run_marks_the_contended_run(fake_backends, tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", busy=True)
    result = CliRunner().invoke(app, ["report", str(a), str(b), "--out", str(tmp_path / "both")])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "both" / "report.md").read_text()
    answer = md.split("## Answer", 1)[1].split("\n## ", 1)[0]
    assert "Disturbed runs: B: 4 of 4 timed cells contended" in answer
    runs = _table_rows(md, "Runs")
    assert "4 of 4 timed cells contended" in runs[1] and "| none |" in runs[0]
    cells = _table_rows(md, "Cells by run")
    assert cells and all("(contended)" in r for r in cells)


def test_a_multi_run_report_over_runs_of_different_backends_and_threads_names_each_row_s_run(fake_backends,
                                                                                            tmp_path):
    full = make_run(tmp_path / "full")
    only = make_run(tmp_path / "only", text=CONFIG.replace("backends: [ref, 'ref:slow']", "backends: [ref]")
                    .replace("batch: [2, 4]", "batch: [2, 4]\nthreads: [1, 2]"))
    result = CliRunner().invoke(app, ["report", str(full), str(only), "--out", str(tmp_path / "both")])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "both" / "report.md").read_text()
    side = md.split("## Other cells, side by side", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in side.splitlines() if line.startswith("| train_step")]
    assert rows and {line.split(" | ")[1] for line in rows} == {"A", "B"}
    assert "| run |" in side
    cells = _table_rows(md, "Cells by run")
    assert len(cells) == 2 and all("| ref |" in r for r in cells)  # ref at 1 thread is in both
    fastest = _table_rows(md, "Fastest per group, each run")  # each run's answer, with its lead where it has one
    assert any("| A | ref (" in r and re.search(r"\| 1\.\d+x \[[\d.]+, [\d.]+\] over ref:slow \|", r) for r in fastest)
    assert any("| B | ref (" in r and r.endswith("| ref alone ran | - |") for r in fastest)


# -- winners and ties -------------------------------------------------------------------------------
def test_a_group_within_noise_is_a_tie_with_the_paired_ratio_and_a_clear_one_names_its_winner(fake_backends,
                                                                                              tmp_path):
    from harness.results.report import build_report, to_markdown

    def scale(cell):  # batch 2: ref:slow as fast as ref; batch 4: twice as fast
        if not cell.backend.endswith(":slow"):
            return 1.0
        return 1.0 if cell.problem.batch == 2 else 0.5

    path = make_run(tmp_path / "a", scale=scale)
    title, blocks = build_report(path, plots=[])
    md = to_markdown(title, blocks, path)
    rows = _table_rows(md, "Answer")
    tie = next(r for r in rows if "B=2 " in r)
    won = next(r for r in rows if "B=4 " in r)
    assert "tie: ref and ref:slow" in tie
    value, lo, hi, runner = _lead(tie)
    assert lo <= 1 <= hi and runner in ("ref", "ref:slow")  # the ratio between the two, beside the tie
    assert "ref:slow (" in won
    value, lo, hi, runner = _lead(won)
    assert runner == "ref" and 1.9 < lo <= value <= hi < 2.1
    assert "lead over the runner-up" in md
    assert "a tie (no lead over the runner-up beyond its 95% interval) in 1" in md


# -- the precision mark ----------------------------------------------------------------------------
def test_the_precision_mark_is_named_for_what_it_measures_or_says_no_target(fake_backends, tmp_path):
    from harness.results.report import build_report, to_markdown
    from harness.results.standing import imprecise_name

    path = make_run(tmp_path / "none")
    title, blocks = build_report(path, plots=[])
    md = to_markdown(title, blocks, path)
    assert all(r.split(" | ")[4] == "no precision target" for r in _table_rows(md, "Answer"))
    assert "target not met" not in md
    store = RunStore.open(path)
    for row in store.timings:
        row["speedup_precision"] = 0.05
        if row["cell_id"].endswith("|ref:slow"):
            row["precision_met"] = False
            row["speedup_half_width"] = 0.14
    store.save()
    t = harness.load_run(path).timings
    assert imprecise_name(t) == "interval wider than ±5%"
    title, blocks = build_report(path, plots=[])
    md = to_markdown(title, blocks, path)
    assert "† interval wider than ±5%" in md
    assert all(r.endswith("| 1 | - |") for r in _table_rows(md, "Answer"))


# -- the guard and --fail-on -----------------------------------------------------------------------
def test_the_guard_s_mean_never_exceeds_the_cores_when_a_worker_is_reaped():
    from harness.run import guard

    # 2 cores; a worker's 1.8 CPU seconds move from "ours" to nowhere when it is reaped between two samples
    samples = [guard.Sample(0.0, 1.0, 0.0, 0.0, 0.0, 0.0), guard.Sample(1.0, 1.0, 1.0, 0.0, 2.0, 0.9),
               guard.Sample(2.0, 1.0, 2.0, 0.0, 4.0, 0.1), guard.Sample(3.0, 1.0, 3.0, 0.0, 6.0, 1.0)]
    seen = guard.summarise(samples)
    assert seen["others_cores"] <= 2 and seen["others_cores"] <= seen["others_cores_max"]
    contended, text = guard.judge({**seen, "cores": 2}, threads=1, cores=2)
    used = float(text.split("used ", 1)[1].split(" ", 1)[0])
    assert used <= float(text.split("at most ", 1)[1].split(";", 1)[0])


def test_fail_on_names_the_cells_a_ci_job_cares_about(fake_backends, tmp_path):
    from harness.results.standing import failing

    rows = harness.load_run(make_run(tmp_path / "busy", busy=True)).timings
    assert len(failing(rows, ["contended"])) == 4 and failing(rows, ["mismatch", "failed"]) == []
    mismatch = rows.assign(status=["mismatch"] + ["ok"] * (len(rows) - 1))
    assert failing(mismatch.drop(columns=["time_standing"]), ["mismatch"]) == [f"{rows['cell_id'].iloc[0]}: mismatch"]
    result = CliRunner().invoke(app, ["run", str(tmp_path / "none.yaml"), "--fail-on", "slow"])
    assert result.exit_code == 2 and "--fail-on: unknown 'slow'" in result.output


def test_the_conformance_summary_says_when_every_backend_s_worst_ratio_is_the_same():
    from harness.results.report_sections import _conformance_section
    from harness.results.rows import conformance_entry
    from harness.results.report_blocks import Para, Table

    meta: dict = {}
    for backend, ratios in (("numpy", [0.1209, 0.01, 0.02]), ("torch", [0.1209, 0.05, 0.09])):
        for r in ratios:
            conformance_entry(meta, backend, {"ok": True, "ratio": r, "bound": "rtol 1e-4", "worst": "update of W"})
    assert meta["conformance"]["numpy"]["median_ratio"] == pytest.approx(0.02)
    assert meta["conformance"]["torch"]["median_ratio"] == pytest.approx(0.09)
    blocks = _conformance_section(meta, pd.DataFrame())
    table = next(b for b in blocks if isinstance(b, Table))
    assert "median_ratio" in table.headers and "cell_ratios" not in table.headers
    said = " ".join(b.text for b in blocks if isinstance(b, Para))
    assert "Every backend's worst ratio is the same, 0.1209 (at update of W)" in said


def test_the_pytest_benchmark_export_carries_each_cell_s_label_and_standing(fake_backends, tmp_path):
    pytest.importorskip("pytest_benchmark")
    from harness.results.pytest_benchmark import export_json

    path = make_run(tmp_path / "busy", busy=True)
    out, n, _ = export_json(path, tmp_path / "bench.json")
    info = [b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]]
    assert n == 4 and {i["label"] for i in info} == {"ref", "ref:slow"}
    assert {i["time_standing"] for i in info} == {"contended"}
    assert all("other processes used" in i["time_standing_why"] for i in info)


def test_an_unsteady_run_with_local_load_says_what_the_guard_saw_not_the_host():
    from harness.results.caveats import lines

    seen = ("other processes used 1 of 2 cores while it was timed (at most 1.1; its 1 thread(s) left 1 free), "
            "load average up to 5.00, steal 0.0%")
    rows = [{"cell_id": f"k{i}|numpy", "backend": "numpy", "variant": "default", "workload": "train_step", "batch": 1,
             "status": "ok", "median_s": 1e-3, "process_spread": 0.46, "contended": False, "contention": seen}
            for i in range(4)]
    said = " ".join(lines({}, rows))
    assert "4 of 4 timed cells disagree by more than 10%" in said
    assert "Other processes used up to 1 cores while they were timed" in said and "tenants" not in said
    quiet = [dict(r, contention=seen.replace("used 1 of", "used 0.01 of")) for r in rows]
    assert "tenants" in " ".join(lines({}, quiet))


@pytest.mark.parametrize("name", ["explore_results.ipynb", "compare_backends.ipynb"])
def test_the_shipped_notebooks_plot_load_run_s_label_and_standing_without_a_helper(name):
    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / name).read_text(encoding="utf-8"))
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert 't["label"] = backend_label' not in code  # load_run's own label: torch and torch:fused apart
    assert '"label"' in code and "standing" in code
