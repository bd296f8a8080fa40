"""The Dask executor: comparison groups on a cluster give the same run folder as a local run."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from harness.config import load_config
from harness.run.distributed import DaskExecutor, cpu_slices, group_resources, merge_fragment, unmet_need
from harness.spec.errors import HarnessError
from harness.results.store import RunStore, load_run
from harness.run.runner import Runner, new_run_meta

CONFIG = """
name: dask-small
seed: 3
dtype: float32
model: {kind: elman, hidden: 16, bias: false, bptt: full}
task: {kind: lm_markov, vocab: 50, seq_len: 8, n_sequences: 64, n_eval: 16}
workloads: [train_step]
batch: [1, 2, 4]
threads: [1]
backends: [numpy, native]
timing: {warmup: 1, min_rounds: 3, min_time_s: MIN_TIME, max_time_s: 3, timeout_s: 60}
"""


def _config(tmp_path, min_time_s=0.05):
    path = tmp_path / "small.yaml"
    path.write_text(CONFIG.replace("MIN_TIME", str(min_time_s)))
    return load_config(path)


def test_group_resources_ask_for_cores_and_a_gpu_when_needed(tmp_path):
    cfg = _config(tmp_path)
    group = [c for c in cfg.cells() if c.group_key == cfg.cells()[0].group_key]
    assert group_resources(group) == {"cores": 1}
    gpu = [type(c)(**{**c.__dict__, "problem": type(c.problem)(**{**c.problem.__dict__, "device": "gpu"})}) for c in group]
    assert group_resources(gpu) == {"cores": 1, "GPU": 1}


def test_a_group_no_worker_can_take_is_reported_with_what_the_workers_offer():
    assert unmet_need({"cores": 2}, [{"cores": 4}]) is None
    why = unmet_need({"cores": 2, "GPU": 1}, [{"cores": 16}, {"cores": 1, "GPU": 1}])
    assert why.startswith("unavailable: ") and "GPU=1" in why and "cores=16" in why
    assert "no workers" in unmet_need({"cores": 1}, [])


def test_cpu_slices_are_disjoint_and_refuse_more_workers_than_cores():
    cpus = sorted(os.sched_getaffinity(0))
    slices = cpu_slices(len(cpus))
    assert sorted(c for s in slices for c in s) == cpus
    with pytest.raises(HarnessError, match="--workers"):
        cpu_slices(len(cpus) + 1)


def test_fragments_merge_into_run_json_per_host():
    meta = {}
    for host in ("a", "b"):
        merge_fragment(meta, {"host": host, "machine": {"cores": 2}, "gemm_peak_gflops": {"float32|threads=1": 10.0}})
    assert set(meta["hosts"]) == {"a", "b"}
    assert meta["hosts"]["b"]["gemm_peak_gflops"] == {"float32|threads=1": 10.0}


@pytest.mark.slow
def test_dask_local_gives_the_same_run_folder_as_a_local_run(tmp_path, run_config):
    cfg = _config(tmp_path)
    local = run_config(cfg, tmp_path / "local")
    dask = run_config(cfg, tmp_path / "dask", executor=DaskExecutor(n_workers=2))
    assert list(dask.timings.columns) == list(local.timings.columns)
    assert sorted(p.name for p in (tmp_path / "dask").iterdir()) == sorted(p.name for p in (tmp_path / "local").iterdir())
    assert list(dask.timings["cell_id"]) == list(local.timings["cell_id"])  # the config's order
    assert list(dask.timings["status"]) == list(local.timings["status"]) == ["ok"] * 6
    assert dask.timings["host"].notna().all() and set(dask.timings["host"]) <= set(dask.meta["hosts"])
    for host in dask.meta["hosts"].values():
        assert host["machine"]["cores"] and host["gemm_peak_gflops"]
    assert dask.meta["conformance"]["native"]["verified_cells"] == 3


def test_passes_through_dask_are_tasks_of_their_own_behind_every_first_pass(tmp_path, monkeypatch, run_config):
    from harness.run import distributed as dist

    path = tmp_path / "passes.yaml"
    path.write_text(CONFIG.replace("MIN_TIME", "0.05").replace("timeout_s: 60}", "timeout_s: 60, passes: 2}"))
    cfg = load_config(path)
    asked = []  # (group key, pass about to run) of every task submitted, in order
    submit = dist.DaskExecutor.run

    def watched(self, runner, groups, progress=None, task_id=None):
        import distributed

        original = distributed.Client.submit

        def recording(client, fn, *args, **kwargs):
            if fn is dist.run_group_task:
                asked.append((args[1][0].group_key, (args[2] or {}).get("passes_done", 0)))
            return original(client, fn, *args, **kwargs)

        monkeypatch.setattr(distributed.Client, "submit", recording)
        return submit(self, runner, groups, progress, task_id)

    monkeypatch.setattr(dist.DaskExecutor, "run", watched)
    run = run_config(cfg, tmp_path / "dask", executor=DaskExecutor(n_workers=1))
    keys = list(dict.fromkeys(k for k, _ in asked))
    assert len(keys) == 3 and asked[:3] == [(k, 0) for k in keys]  # every group's first pass is asked for first
    assert sorted(asked[3:]) == sorted((k, 1) for k in keys)  # then each one's second, as its first comes back
    assert list(run.timings["status"]) == ["ok"] * 6 and set(run.timings["n_passes"]) == {2}
    assert "unfinished_groups" not in run.meta


@pytest.mark.slow
def test_a_dask_worker_killed_mid_group_never_loses_the_group(tmp_path, run_config):
    import dask
    import distributed

    cfg = _config(tmp_path, min_time_s=1.5)  # groups long enough to be caught running
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                           dashboard_address=None, resources={"cores": 1}, silence_logs=40)
    client = distributed.Client(cluster)
    killed = []

    def kill_one_busy_worker():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [w for w, tasks in client.processing().items() if tasks]
            if busy:
                time.sleep(0.5)  # inside the group: its cell workers are starting or timing
                pid = client.run(os.getpid, workers=[busy[0]])[busy[0]]
                os.kill(pid, signal.SIGKILL)
                killed.append(busy[0])
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one_busy_worker)
    killer.start()
    try:
        run = run_config(cfg, tmp_path / "dask", executor=DaskExecutor(scheduler=cluster.scheduler_address))
    finally:
        killer.join()
        client.close()
        cluster.close()
    assert killed, "no worker was seen running a group"
    assert len(run.timings) == len(cfg.cells())  # every cell recorded
    failed = run.timings[run.timings["status"] != "ok"]
    assert set(run.timings["status"]) <= {"ok", "error"}
    assert all("Dask" in e for e in failed["error"])  # a failure names its cause


@pytest.mark.parametrize("args, message", [
    (["--executor", "dask"], "--executor dask needs --scheduler"),
    (["--executor", "dask-local", "--scheduler", "tcp://x:1"], "starts its own cluster"),
    (["--workers", "2"], "go with --executor dask"),
    (["--executor", "slurm"], "expected local, dask or dask-local"),
])
def test_executor_options_are_checked_before_anything_runs(tmp_path, args, message):
    from typer.testing import CliRunner

    from harness.cli import app

    path = tmp_path / "small.yaml"
    path.write_text(CONFIG.replace("MIN_TIME", "0.05"))
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out"), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_resume_through_dask_redoes_no_finished_group(tmp_path):
    cfg = _config(tmp_path)
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    runner = Runner(cfg, store)
    first = runner.pending_groups()[0]
    runner.run(groups=[first])  # as if the run was interrupted after one group
    before = {r["cell_id"]: list(r["samples_s"]) for r in store.timings}
    resumed = RunStore.open(tmp_path / "run")
    Runner(cfg, resumed).run(None, DaskExecutor(n_workers=2))
    run = load_run(tmp_path / "run")
    assert len(run.timings) == len(cfg.cells())
    for cell_id, samples in before.items():  # the finished group was not run again
        row = run.timings[run.timings["cell_id"] == cell_id].iloc[0]
        assert list(row["samples_s"]) == samples
