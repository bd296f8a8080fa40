"""A short time on a GPU machine: the plan of a GPU machine (what comes first, what fits the budget with its compile
time), the GPU check that fits its share and keeps what finished, and the archive that brings the
runs back to ``results/examples``. Synthetic machine facts and processes: no GPU needed."""

import json
import sys
import tarfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from harness import reproduce as R

ROOT = Path(__file__).resolve().parents[1]
H100 = R.MachineFacts(16, ("NVIDIA H100 80GB HBM3",))


@pytest.fixture(scope="module")
def shipped():
    return R.experiments(ROOT)


def _run_folder(folder: Path, seconds: float = 60.0, cells: int = 4, finished: bool = True, gpus=(),
                fingerprint: str | None = None) -> None:
    folder.mkdir(parents=True)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    meta = {"started": start.isoformat(), "cells": {f"c{i}": "ok" for i in range(cells)},
            "machine": {"cores": 2, "gpus": list(gpus)}, "config_fingerprint": fingerprint}
    if finished:
        meta["finished"] = (start + timedelta(seconds=seconds)).isoformat()
    else:
        meta["interrupted"] = True
    (folder / "run.json").write_text(json.dumps(meta))


def test_an_h100_runs_the_seed_s_ablation_first_and_the_gpu_part_fits_eight_minutes(shipped, tmp_path):
    budget = 8 * 60
    plan = R.plan(H100, tmp_path / "out", tmp_path / "no-examples", budget_s=budget, exps=shipped,
                  env_exists=lambda n: True)
    runs = [d for d in plan if d.runs]
    assert runs[0].name == "lstm_gpu"  # the seed's question before any other GPU experiment
    gpu = [d.name for d in plan if d.tier == 0]
    assert gpu[:4] == ["lstm_gpu", "lstm_cpu_gpu-gpu", "mixed_precision-gpu", "quick-gpu"]
    # every cell's worker start (compile and verification included) is in the estimate, and the GPU
    # check's share is kept out of the budget before anything is planned
    lstm_gpu = next(e for e in shipped if e.name == "lstm_gpu")
    assert runs[0].estimate_s >= lstm_gpu.cells * R.CELL_START_S["gpu"]
    assert runs[0].estimate_s <= 4.6 * 60  # the default answers the question in about four minutes
    assert R.GPU_CHECK_S + sum(d.estimate_s for d in runs) <= budget
    # a GPU profile is not estimated from its CPU run's minutes
    cpu_examples = tmp_path / "examples"
    _run_folder(cpu_examples / "quick", seconds=6000.0)
    d = {x.name: x for x in R.plan(H100, tmp_path / "out", cpu_examples, exps=shipped, env_exists=lambda n: True)}
    assert "had no GPU" in d["quick-gpu"].basis and d["quick-gpu"].estimate_s < 6000.0


def test_the_check_s_share_comes_out_of_the_budget_only_where_there_is_a_gpu(shipped, tmp_path):
    def planned(machine, **kw):
        plan = R.plan(machine, tmp_path / "out", tmp_path / "none", budget_s=60 * 60, exps=shipped,
                      env_exists=lambda n: True, **kw)
        return sum(d.estimate_s for d in plan if d.runs)

    assert planned(H100, check_gpu=False) >= planned(H100)
    cpu = R.plan(R.MachineFacts(2), tmp_path / "out", tmp_path / "none", budget_s=10.0, exps=shipped,
                 env_exists=lambda n: True)
    assert all(not d.runs for d in cpu)  # nothing of ten seconds, and no check share makes it negative


class _Clock:
    """The check's clock: ``now`` moves only when the test moves it."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


def test_the_gpu_check_runs_backend_by_backend_within_its_share_and_a_second_call_goes_on(tmp_path, monkeypatch):
    clock = _Clock()
    ran = []

    def fake_check(args):  # the check of one backend: one JSON line naming it
        name = args[args.index("--backends") + 1]
        ran.append(name)
        line = json.dumps({"backend": name, "status": "pass"})
        return [sys.executable, "-c", f"print({line!r})"]

    monkeypatch.setattr(R, "_harness", fake_check)
    real_wait = R._wait

    def wait_then_spend(proc, deadline, clock_=None):  # each backend's check spends the whole share's 40%
        result = real_wait(proc, None)
        clock.now += 0.4 * R.GPU_CHECK_S
        return result

    monkeypatch.setattr(R, "_wait", wait_then_spend)
    out = tmp_path / "out"
    out.mkdir()
    names = ["cuda", "torch:fused", "jax", "torch", "torch:compile"]
    record = R.Record(out, H100)
    said = []
    R.gpu_check(out, record, said.append, deadline=None, names=names, clock=clock.monotonic)
    kept = json.loads((out / R.RECORD).read_text())["gpu_check"]
    assert ran == ["cuda", "torch:fused", "jax"]  # the third starts before the share is spent
    assert kept["unchecked"] == ["torch", "torch:compile"] and not kept["finished"]
    assert [json.loads(l)["backend"] for l in (out / R.GPU_CHECK).read_text().splitlines()] == ran
    assert any("not checked: torch, torch:compile" in s for s in said)
    # the next call checks only what is left, and keeps the earlier lines
    clock.now = 1000.0
    R.gpu_check(out, R.Record(out, H100), said.append, deadline=None, names=names, clock=clock.monotonic)
    kept = json.loads((out / R.RECORD).read_text())["gpu_check"]
    assert ran[3:] == ["torch", "torch:compile"] and kept["finished"] and kept["unchecked"] == []
    assert len((out / R.GPU_CHECK).read_text().splitlines()) == 5
    assert set(kept["exit_codes"]) == set(names)


def test_gpu_backends_are_checked_in_the_order_of_what_the_experiments_time(monkeypatch):
    import backends

    class Row:
        def __init__(self, name):
            self.full_name, self.available, self.devices = name, True, ("cpu", "gpu")

    rows = [Row(n) for n in ("torch:compile", "jax:unroll=4", "cuda:naive", "torch", "cuda", "jax", "torch:fused")]
    monkeypatch.setattr(backends, "list_backends", lambda: rows)
    assert R.gpu_backends() == ["cuda", "torch:fused", "jax", "torch", "cuda:naive", "jax:unroll=4", "torch:compile"]


def test_the_archive_holds_the_finished_runs_under_their_example_names(shipped, tmp_path):
    out = tmp_path / "out"
    mine = {e.name: e.fingerprint for e in shipped}
    _run_folder(out / "lstm_gpu", gpus=["NVIDIA H100"], fingerprint=mine["lstm_gpu"])
    _run_folder(out / "lstm_cpu_gpu-gpu", finished=False, fingerprint=mine["lstm_cpu_gpu-gpu"])  # stopped: resumes
    _run_folder(out / "quick-gpu", fingerprint="another config's")  # not this experiment's run: not brought back
    (out / "lstm_gpu" / ".lock").write_text("123\n")
    (out / "lstm_gpu" / "plots").mkdir()
    (out / "lstm_gpu" / "plots" / "speedup.png").write_bytes(b"png")
    path = tmp_path / "runs.tgz"
    assert R.archive(out, path, shipped) == ["lstm_gpu"]
    with tarfile.open(path) as tar:
        names = sorted(tar.getnames())
        assert names == ["lstm_gpu", "lstm_gpu/plots", "lstm_gpu/plots/speedup.png", "lstm_gpu/run.json"]
        examples = tmp_path / "examples"
        tar.extractall(examples, filter="data")
    assert json.loads((examples / "lstm_gpu" / "run.json").read_text())["machine"]["gpus"] == ["NVIDIA H100"]
    with pytest.raises(R.HarnessError, match="--archive"):
        R.archive(out, tmp_path / "runs.tgz" / "below", shipped)


def test_lstm_gpu_default_is_the_ablation_and_a_few_batches_and_full_sweeps(shipped):
    from harness.config import load_config

    default = load_config(ROOT / "configs" / "lstm_gpu.yaml").cells()
    full = load_config(ROOT / "configs" / "lstm_gpu.yaml", None, "full").cells()
    ablation = {c.backend for c in default if c.problem.batch == 64}
    assert {"cuda:naive", "cuda:grouped", "cuda:fused", "cuda:streams", "cuda", "cuda:persistent", "torch:fused",
            "jax"} <= ablation
    assert {c.problem.batch for c in default} == {1, 16, 64}
    assert {c.problem.workload for c in default} == {"forward", "train_step"}
    assert {c.problem.batch for c in full} == {1, 2, 4, 8, 16, 32, 64, 128, 256} and len(full) > 3 * len(default)


def test_the_dry_run_totals_what_it_would_run_and_skip():
    from typer.testing import CliRunner

    from harness.cli import app

    out = CliRunner().invoke(app, ["reproduce", "--dry-run", "--budget", "5"]).output
    total = [l for l in out.splitlines() if l.startswith("in all: ")]
    assert len(total) == 1 and " to run, ~" in total[0] and " skipped (~" in total[0]


def test_two_calls_into_one_folder_keep_both_their_entries(tmp_path):
    out = tmp_path / "out"
    first, second = R.Record(out, H100), R.Record(out, H100)  # both read the folder before either wrote
    first.data["calls"].append({"started": "2026-01-01T00:00:00"})
    first.data["experiments"]["quick"] = {"status": "finished"}
    first.save()
    second.data["calls"].append({"started": "2026-01-01T00:00:05"})
    second.data["experiments"]["sobel"] = {"status": "finished"}
    second.save()
    kept = json.loads((out / R.RECORD).read_text())
    assert [c["started"] for c in kept["calls"]] == ["2026-01-01T00:00:00", "2026-01-01T00:00:05"]
    assert set(kept["experiments"]) == {"quick", "sobel"}
    first.data["experiments"]["quick"] = {"status": "failed"}  # a call's own entries are its to change
    first.save()
    kept = json.loads((out / R.RECORD).read_text())
    assert kept["experiments"]["quick"]["status"] == "failed" and "sobel" in kept["experiments"]
