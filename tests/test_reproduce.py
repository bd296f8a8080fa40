"""``harness reproduce``: what runs on which machine, in which order, within a budget; resuming."""

import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from harness import reproduce as R

ROOT = Path(__file__).resolve().parents[1]


def _committed(folder: Path, seconds: float, cells: int = 10, cores: int = 2) -> None:
    """A committed run as reproduce reads it: run.json with start, finish, cells and machine."""
    folder.mkdir(parents=True)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    meta = {"started": start.isoformat(), "finished": (start + timedelta(seconds=seconds)).isoformat(),
            "cells": {f"c{i}": "ok" for i in range(cells)}, "machine": {"cores": cores, "gpus": []}}
    (folder / "run.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def shipped():
    return R.experiments(ROOT)


@pytest.fixture
def examples(tmp_path):
    """Synthetic committed runs: every plain experiment a minute, except deepbench (10 minutes)."""
    ex = tmp_path / "examples"
    for stem in ("quick", "wildml_lm", "numpy_vs_theano", "sobel", "frame_diff", "parallel_minibatch", "threads",
                 "threads_lstm", "lstm_cpu_gpu", "inference", "wildml_gru", "versions", "mixed_precision"):
        _committed(ex / stem, 60.0)
    _committed(ex / "deepbench", 600.0)
    return ex


def _by_name(decisions):
    return {d.name: d for d in decisions}


def test_the_page_s_configs_and_hardware_profiles_are_the_experiments(shipped):
    names = {e.name for e in shipped}
    assert {"quick", "quick-gpu", "lstm_gpu", "lstm_cpu_gpu", "lstm_cpu_gpu-gpu", "threads-many-cores",
            "threads_lstm-many-cores", "parallel_minibatch-many-cores", "deepbench", "wildml_lm"} <= names
    assert "deepbench-full" not in names  # only profiles that ask for other hardware
    assert all(e.cells > 0 for e in shipped)


def test_small_cpu_machine_runs_the_cpu_experiments_and_says_why_not_the_rest(shipped, examples, tmp_path):
    plan = R.plan(R.MachineFacts(2), tmp_path / "out", examples, exps=shipped, env_exists=lambda n: True)
    d = _by_name(plan)
    assert not d["quick-gpu"].runs and "needs a GPU" in d["quick-gpu"].why
    assert not d["lstm_gpu"].runs and "needs a GPU" in d["lstm_gpu"].why
    assert not d["threads-many-cores"].runs and "needs >= 8 cores (2 here)" in d["threads-many-cores"].why
    assert d["quick"].runs and d["lstm_cpu_gpu"].runs and d["deepbench"].runs
    assert d["quick"].estimate_s == pytest.approx(60.0) and "committed run" in d["quick"].basis
    # nothing new here: re-measurements, shortest first, and every line says config, verdict, minutes
    runs = [x for x in plan if x.runs]
    assert runs[-1].name == "deepbench" and all(x.tier == 4 for x in runs)
    assert plan.index(runs[-1]) < min(plan.index(x) for x in plan if not x.runs)
    line = d["quick-gpu"].line()
    assert line.startswith("configs/quick.yaml --profile gpu: skipped: needs a GPU") and "min" in line


def test_gpu_and_many_cores_come_first_where_the_machine_has_them(shipped, examples, tmp_path):
    plan = R.plan(R.MachineFacts(16, ("NVIDIA H100",)), tmp_path / "out", examples, exps=shipped,
                  env_exists=lambda n: True)
    order = [d.name for d in plan if d.runs]
    assert all(d.runs for d in plan)
    first = {"quick-gpu", "lstm_gpu", "lstm_cpu_gpu-gpu", "mixed_precision-gpu"}
    assert set(order[:4]) == first
    assert set(order[4:7]) == {"threads-many-cores", "threads_lstm-many-cores", "parallel_minibatch-many-cores"}
    assert set(order[7:9]) == {"lstm_cpu_gpu", "wildml_lm"}  # configs with GPU cells the committed runs lack
    d = _by_name(plan)
    # a profile without a committed run is estimated from its plain run, scaled by cells
    base = next(e for e in shipped if e.name == "threads")
    many = next(e for e in shipped if e.name == "threads-many-cores")
    assert d["threads-many-cores"].estimate_s == pytest.approx(60.0 * many.cells / base.cells)
    assert "no committed run" in d["lstm_gpu"].basis


def test_budget_skips_what_does_not_fit_with_the_reason(shipped, examples, tmp_path):
    plan = R.plan(R.MachineFacts(2), tmp_path / "out", examples, budget_s=5 * 60, exps=shipped,
                  env_exists=lambda n: True)
    runs = [d for d in plan if d.runs]
    assert len(runs) == 5 and sum(d.estimate_s for d in runs) <= 5 * 60
    skipped = [d for d in plan if d.skipped_for_budget]
    assert {d.name for d in skipped} >= {"deepbench"}
    assert "out of budget: needs ~10.0 min, 0.0 min of the budget left" in _by_name(plan)["deepbench"].why
    # a missing isolated environment is part of the estimate
    plan = R.plan(R.MachineFacts(2), tmp_path / "out", examples, exps=shipped, env_exists=lambda n: False)
    assert _by_name(plan)["numpy_vs_theano"].estimate_s == pytest.approx(60.0 + R.ENV_BUILD_S)
    assert "building the theano environment" in _by_name(plan)["numpy_vs_theano"].basis


def _finished(folder: Path, exp) -> None:
    """A finished run of ``exp`` in ``folder``, as ``harness run`` leaves one (no cell is needed)."""
    from harness.results.store import RunStore

    RunStore.create(folder, {"config_fingerprint": exp.fingerprint, "started": "2026-01-01T00:00:00+00:00",
                             "finished": "2026-01-01T00:01:00+00:00", "interrupted": False})


def test_only_and_finished_folders(shipped, examples, tmp_path):
    out = tmp_path / "out"
    _finished(out / "sobel", next(e for e in shipped if e.name == "sobel"))
    plan = R.plan(R.MachineFacts(2), out, examples, only=["sobel", "quick"], exps=shipped, env_exists=lambda n: True)
    d = _by_name(plan)
    assert set(d) == {"sobel", "quick"}  # quick-gpu does not fit here, so --only quick is the plain one
    assert not d["sobel"].runs and d["sobel"].state == "done" and d["sobel"].why.startswith("done")
    with pytest.raises(R.HarnessError, match="--only: no experiment nope"):
        R.plan(R.MachineFacts(2), out, examples, only=["nope"], exps=shipped)


def test_dry_run_cli_lists_every_experiment(shipped):
    from typer.testing import CliRunner

    from harness.cli import app

    result = CliRunner().invoke(app, ["reproduce", "--dry-run", "--budget", "15"])
    assert result.exit_code == 0, result.output
    lines = [l for l in _unwrapped(result.output) if l.startswith("configs/")]
    assert len(lines) == len(shipped)
    assert all(("runs here" in l or "skipped" in l) and " min (" in l for l in lines)


def _unwrapped(output: str) -> list[str]:
    """The plan's lines with their indented continuations joined back."""
    lines: list[str] = []
    for line in output.splitlines():
        if line.startswith("    ") and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


@pytest.mark.parametrize("columns", [40, 80, 100])
def test_the_dry_run_fits_the_terminal_and_80_columns_at_least(shipped, monkeypatch, tmp_path, columns):
    from rich.console import Console
    from typer.testing import CliRunner

    from harness import cli

    monkeypatch.setattr(cli, "console", Console(width=columns))
    out = tmp_path / "a folder whose name is long enough to need a line of its own in a narrow terminal"
    result = CliRunner().invoke(cli.app, ["reproduce", "--dry-run", "--budget", "15", "--out", str(out)])
    assert result.exit_code == 0, result.output
    width = max(columns, 80)
    assert all(len(l) <= width or " " not in l.strip() for l in result.output.splitlines()), result.output
    monkeypatch.setattr(cli, "console", Console(width=1000))
    wide = CliRunner().invoke(cli.app, ["reproduce", "--dry-run", "--budget", "15", "--out", str(out)])
    assert _unwrapped(result.output) == wide.output.splitlines()  # the same plan, only broken between words


CONFIG = """\
name: tiny
seed: 1
dtype: float64
model: {kind: elman, hidden: 4, bias: true, head: mse}
task: {kind: random, input_size: 3, output_size: 2, seq_len: 4, n_sequences: 8}
workloads: [train_step]
batch: [1, 2, 3]
backends: ["gate:plain", "ref:slow"]
baseline: "gate:plain"
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.05, max_time_s: 0.2, timeout_s: 60, passes: 1}
"""


def test_out_of_budget_stops_resumably_and_a_second_call_finishes(fake_backends, monkeypatch, tmp_path):
    # The budget runs out when the test says so, not when the machine gets there: the budget's clock jumps past
    # the budget once a worker of the second group waits at the gate (tests/fake_backends.py GateBackend), so
    # the first group, and only it, is finished when the run is stopped, on a fast or a loaded machine alike.
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("HARNESS_BACKENDS", os.environ["HARNESS_BACKENDS"] + ",gate=fake_backends:GateBackend")
    monkeypatch.setenv("HARNESS_TEST_GATE", str(gate))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    exp = R.Experiment(cfg, None, cells=6, devices=frozenset({"cpu"}))
    out, machine = tmp_path / "out", R.MachineFacts(2)
    said = []
    plan = R.plan(machine, out, tmp_path / "none", exps=[exp], env_exists=lambda n: True)
    plan[0].estimate_s = 1.0  # the estimate fits; the run does not
    budget_s = 8.0

    start = time.monotonic()

    def clock():  # seconds: standing still until the second group is waiting, then past the budget's 10% overrun
        # (not the real time: on a loaded 2-core machine the first group alone once took longer than the budget)
        return start + (budget_s * 2 if (gate / "waiting").exists() else 0.0)

    first = R.run_plan(plan, out, machine, budget_s=budget_s, say=said.append, clock=clock)
    assert [o.status for o in first] == ["stopped"]
    meta = json.loads((out / "tiny" / "run.json").read_text())
    assert meta["interrupted"] and len(meta["cells"]) == 2  # the batch-1 group's two cells
    run_id = meta["run_id"]
    (gate / "open").touch()
    again = R.plan(machine, out, tmp_path / "none", exps=[exp], env_exists=lambda n: True)
    assert again[0].state == "resume" and again[0].runs and "resumes" in again[0].why
    second = R.run_plan(again, out, machine, budget_s=None, say=said.append)
    assert [o.status for o in second] == ["finished"]
    meta = json.loads((out / "tiny" / "run.json").read_text())
    assert meta["run_id"] == run_id and meta["finished"] and len(meta["cells"]) == 6
    record = json.loads((out / R.RECORD).read_text())
    assert len(record["calls"]) == 2 and record["experiments"]["tiny"]["status"] == "finished"
    assert R.plan(machine, out, tmp_path / "none", exps=[exp], env_exists=lambda n: True)[0].state == "done"
