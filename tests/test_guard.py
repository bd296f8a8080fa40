"""What shaped a run: a busy machine (other processes' CPU, load, steal, the GEMM peak at start and end)
and the variables that steer a numerical library (recorded per worker with their origin, the BLAS
kernel each worker ran, those that force a kernel named first, a clean environment on request)."""

import io
import json
import os
import subprocess
import sys
import time

import pytest
from rich.console import Console

import harness
from harness.config import load_config
from harness.results import caveats
from harness.results.report import build_report, Heading, Para
from harness.results.store import RunStore
from harness.run import guard, roofs
from harness.run.client import CALLER, CONFIG, HARNESS, process_environ, worker_settings
from harness.run.runner import Runner, finish_meta, new_run_meta
from harness.spec import tuning
from harness.worker import blas_probe

STEP = """
name: guarded
seed: 1
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 6, n_sequences: 16, n_eval: 8}
workloads: [train_step]
batch: [2]
threads: [1]
timing: {warmup: 1, min_rounds: 4, min_time_s: 0.05, max_time_s: 1, timeout_s: 60}
"""
SKYLAKEX_CLASS = {"SkylakeX", "Cooperlake", "SapphireRapids", "Zen"}


def _own_openblas_kernels() -> set:
    """The OpenBLAS kernels a fresh NumPy process picks on this CPU with no steering variable set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "GOTO"))}
    code = ("import numpy, threadpoolctl; print(' '.join(sorted({i['architecture'] for i in "
            "threadpoolctl.threadpool_info() if i.get('internal_api') == 'openblas'})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return set(done.stdout.split()) if done.returncode == 0 else set()


def _cpu_flags() -> set:
    try:
        return next(set(line.split(":", 1)[1].split()) for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()


# -- the busy-machine guard --------------------------------------------------------------------------------
def _probe(others_cores: float):
    """A machine on which other processes take ``others_cores`` cores, steadily, and the harness nothing."""
    t0 = time.monotonic()

    def probe():
        t = time.monotonic()
        busy = others_cores * (t - t0)
        return guard.Sample(t, 0.5 + others_cores, busy, 0.0, (os.cpu_count() or 1) * (t - t0) + 1.0, 0.0)

    return probe


def _guarded_run(config_path, out, others_cores: float, peak_start: float, peak_end: float, monkeypatch):
    """A real run of the test backends with the machine's readings and GEMM peaks injected."""
    seen: dict = {}

    def measure(dtype, threads, library, *a, **k):  # each roof's first reading at the start, its second at the end
        seen[dtype, threads, library] = seen.get((dtype, threads, library), 0) + 1
        return peak_start if seen[dtype, threads, library] == 1 else peak_end

    monkeypatch.setattr(roofs, "_measure", measure)
    cfg = load_config(config_path)
    store = RunStore.create(out, new_run_meta(cfg))
    said = io.StringIO()
    Runner(cfg, store, console=Console(file=said, width=300),
           sampler=guard.Sampler(_probe(others_cores), interval_s=0.05)).run()
    finish_meta(store)
    return store, said.getvalue()


def _summary(store) -> str:
    from harness import cli

    out = io.StringIO()
    cli.console, saved = Console(file=out, width=300), cli.console
    try:
        cli._print_summary(store)
    finally:
        cli.console = saved
    return out.getvalue()


def _answer(out) -> list[str]:
    """The report's Answer section, as its paragraphs' texts and the table's fastest column."""
    _, blocks = build_report(out, plots=[])
    start = next(i for i, b in enumerate(blocks) if isinstance(b, Heading) and b.text == "Answer")
    end = next(i for i, b in enumerate(blocks) if i > start and isinstance(b, Heading))
    section = blocks[start + 1:end]
    paras = [b.text for b in section if isinstance(b, Para)]
    table = next(b for b in section if hasattr(b, "rows"))
    return paras, [row[1] for row in table.rows]


@pytest.mark.slow
def test_a_run_under_injected_load_is_marked_contended_and_a_quiet_one_is_not(fake_backends, write_config, tmp_path,
                                                                              monkeypatch):
    path = write_config(STEP + "backends: [ref, 'ref:slow']\n")
    cores = os.cpu_count() or 1
    busy, said = _guarded_run(path, tmp_path / "busy", cores, 100.0, 40.0, monkeypatch)
    assert said.startswith("warning: the machine is busy"), said  # harness run says so before anything runs
    timings = harness.load_run(tmp_path / "busy").timings
    assert timings["contended"].all() and timings["contention"].str.contains(f"used {cores:.2g} of {cores} cores").all()
    assert busy.meta["conditions"]["gemm_peak_gflops_end"] == {"float32|threads=1": 40.0}
    paras, fastest = _answer(tmp_path / "busy")
    assert paras[0].startswith("Contended machine: 2 of 2 timed cells")  # first, before the table's legend
    assert paras[1].startswith("Busy machine: the float32 GEMM peak at 1 thread(s) fell from 100 GFLOP/s")
    assert all(f.startswith("none named") for f in fastest)  # a contended speedup is never the winner
    summary = _summary(busy)
    assert summary.index("caveat: Contended machine") < summary.index("median per call")
    assert "(contended)" in summary

    quiet, said = _guarded_run(path, tmp_path / "quiet", 0.0, 100.0, 98.0, monkeypatch)
    assert "warning" not in said
    timings = harness.load_run(tmp_path / "quiet").timings
    assert not timings["contended"].any() and timings["contention"].str.contains("used 0 of").all()
    paras, fastest = _answer(tmp_path / "quiet")
    assert not any(p.startswith(("Contended", "Busy")) for p in paras)
    assert not any(f.startswith("none named") for f in fastest)
    summary = _summary(quiet)
    assert "Contended" not in summary and "(contended)" not in summary


@pytest.mark.slow
def test_a_group_timed_in_a_dask_task_keeps_the_readings_of_the_host_that_timed_it(fake_backends, write_config,
                                                                                   monkeypatch):
    from harness.run import distributed

    cfg = load_config(write_config(STEP + "backends: [ref, 'ref:slow']\n"))
    group = cfg.groups()[0]
    monkeypatch.setattr(roofs, "_measure", lambda *a, **k: 100.0)
    real, cores = guard.Sampler, os.cpu_count() or 1
    for others, contended in ((float(cores), True), (0.0, False)):
        # the task builds its own sampler on its host: here one with the machine's readings injected
        monkeypatch.setattr(guard, "Sampler", lambda *a, others=others, **k: real(_probe(others), interval_s=0.05))
        result = distributed.run_group_task(cfg, group)
        while result["outcomes"] is None:  # the group's next pass, as the executor asks for it
            result = distributed.run_group_task(cfg, group, result["saved"])
        assert [o.status for o in result["outcomes"]] == ["ok", "ok"]
        for outcome in result["outcomes"]:
            assert outcome.conditions and len(outcome.conditions) == outcome.cell.timing.pass_count
            assert caveats.cell_columns(outcome, cores)["contended"] is contended


def test_a_run_handed_to_an_executor_warns_at_its_start_on_a_busy_machine(fake_backends, write_config, tmp_path):
    class Idle:  # an executor that runs nothing: the warning comes before any group is handed over
        def run(self, runner, groups, progress=None, task_id=None):
            self.groups = groups

    cfg = load_config(write_config(STEP + "backends: [ref]\n"))
    said, executor = io.StringIO(), Idle()
    Runner(cfg, RunStore.create(tmp_path / "r", new_run_meta(cfg)), console=Console(file=said, width=300),
           sampler=guard.Sampler(_probe(float(os.cpu_count() or 1)), interval_s=0.05)).run(executor=executor)
    assert said.getvalue().startswith("warning: the machine is busy") and executor.groups


def test_the_sampler_counts_the_harness_s_own_processes_as_its_own():
    # a child that spins is the harness's work, not another process's: its CPU time is counted as ours
    before = guard.own_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass"])
    child.wait(timeout=60)
    assert guard.own_cpu_s() - before >= 0.25  # reaped: in this process's children's time


def test_judge_needs_more_than_the_free_cores_taken_or_steal():
    quiet = {"others_cores": 0.9, "others_cores_max": 1.0, "steal_share": 0.0, "load_max": 1.2, "cores": 2}
    assert guard.judge(quiet, threads=1)[0] is False  # one core left free by a 1-thread cell
    assert guard.judge(quiet, threads=2)[0] is True  # none left free by a 2-thread cell
    assert guard.judge({**quiet, "others_cores": 0.0, "steal_share": 0.2}, threads=1)[0] is True
    assert guard.judge(None, threads=1) == (None, "")


def test_gemm_peaks_tell_a_busy_machine():
    start = {"float32|threads=1": 124.0, "float32|threads=2": 54.0, "bfloat16|threads=1|jax": 9.0}
    said = guard.peak_evidence(start, {"float32|threads=1": 120.0, "float32|threads=2": 200.0})
    assert said == ["the float32 GEMM peak at 2 threads (54 GFLOP/s) was below the one at 1 (124) at the run's start: "
                    "the other cores were busy"]
    assert guard.peak_evidence({"float32|threads=1": 100.0}, {"float32|threads=1": 70.0})[0].startswith(
        "the float32 GEMM peak at 1 thread(s) fell from 100")
    assert guard.peak_evidence({"float32|threads=1": 100.0, "float32|threads=2": 190.0},
                               {"float32|threads=1": 95.0, "float32|threads=2": 185.0}) == []


def test_the_start_warning_names_who_takes_the_cpu():
    state = {"others_cores": 1.7, "others_cores_max": 1.7, "steal_share": 0.0, "load_max": 3.7, "cores": 2,
             "loadavg": [3.7, 2.0, 1.0], "top": [{"name": "make", "pid": 42, "cpu": 0.95}]}
    text = guard.busy_warning(state)
    assert "1.7 of 2 cores" in text and "make (pid 42, 95%)" in text and "3.70" in text
    assert guard.busy_warning({**state, "others_cores": 0.1}) is None


# -- the environment guard -------------------------------------------------------------------------------
CALLERS_OWN = os.environ.get("OPENBLAS_CORETYPE")


def _caller_sets(monkeypatch, **variables):
    """Workers started now inherit ``variables`` as if the caller's environment held them; this process's own
    environment (the machine's, CI's) is left as it is."""
    from harness.run import envs

    inherited = envs.worker_environ
    monkeypatch.setattr(envs, "worker_environ", lambda name: {**inherited(name), **variables})


def test_every_worker_variable_that_steers_a_library_is_recorded_with_its_origin(monkeypatch):
    _caller_sets(monkeypatch, OPENBLAS_CORETYPE="Haswell", TF_CLI_CONFIG_FILE="/not/a/library")
    config_env = {"MALLOC_TRIM_THRESHOLD_": "1000000000", "KMP_BLOCKTIME": "0"}
    environment, settings = worker_settings("numpy", "cpu", "float32", 1, config_env)
    env, record = process_environ(environment, settings, config_env)
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and record["OPENBLAS_CORETYPE"] == {"value": "Haswell", "origin": CALLER}
    assert record["KMP_BLOCKTIME"]["origin"] == CONFIG and record["OMP_NUM_THREADS"] == {"value": "1", "origin": HARNESS}
    assert "TF_CLI_CONFIG_FILE" not in record and "PATH" not in record

    env, record = process_environ(environment, settings, config_env, clean=True)
    assert "OPENBLAS_CORETYPE" not in env and env["KMP_BLOCKTIME"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert record["OPENBLAS_CORETYPE"] == {"value": "Haswell", "origin": CALLER, "removed": True}
    assert os.environ.get("OPENBLAS_CORETYPE") == CALLERS_OWN  # this process's environment is as it was


def test_variables_that_force_a_kernel_or_a_cache_size():
    assert tuning.forces("OPENBLAS_CORETYPE", "Haswell") == "OpenBLAS's kernel"
    assert tuning.forces("OPENBLAS_L2_SIZE", "512")
    assert tuning.forces("OPENBLAS_NUM_THREADS", "1") is None
    assert tuning.forces("XLA_FLAGS", "--xla_cpu_max_isa=AVX2") and not tuning.forces("XLA_FLAGS", "--xla_dump_to=/x")


def test_the_kernel_is_read_from_the_loaded_library_where_threadpoolctl_is_missing():
    import numpy as np  # noqa: F401  (loads NumPy's BLAS)

    loaded = [k for k in blas_probe._loaded_openblas() if k["architecture"]]
    told = [k for k in blas_probe.kernels() if k["internal_api"] == "openblas"]
    if not told:
        pytest.skip("NumPy here is not built on OpenBLAS")
    assert {k["architecture"] for k in loaded} == {k["architecture"] for k in told}


def test_clean_env_names_configured_backends(write_config):
    from harness.spec.errors import HarnessError

    with pytest.raises(HarnessError, match="clean_env: expected names of configured backends"):
        load_config(write_config("name: x\nbackends: [numpy]\nclean_env: [jax]\n"))
    cells = load_config(write_config("name: x\nbackends: [numpy, native]\nclean_env: [native]\n")).cells()
    assert {c.backend: c.clean_env for c in cells} == {"numpy": False, "native": True}
    only = load_config(write_config("name: x\nbackends: [numpy, native]\nclean_env: [native]\n", "b.yaml"),
                       backends_override=["numpy"]).cells()
    assert [c.clean_env for c in only] == [False]


@pytest.mark.slow
def test_a_forced_openblas_kernel_is_named_and_the_clean_switch_runs_the_cpu_s_own(fake_backends, write_config, tmp_path):
    # OPENBLAS_CORETYPE=Haswell in the run's own environment only (its process's), not this one's
    path = write_config(STEP + "backends: [ref, 'ref:slow']\nclean_env: ['ref:slow']\n")
    env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell"}
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(path), "--out", str(tmp_path / "r"),
                           "--no-plots"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    run = harness.load_run(tmp_path / "r")
    kernels = {r["variant"]: r["blas_kernel"] for _, r in run.timings.iterrows()}
    if "openblas" not in kernels["plain"]:
        pytest.skip("NumPy here is not built on OpenBLAS")
    assert kernels["plain"].endswith("Haswell")
    assert run.meta["machine"]["steering_env"]["OPENBLAS_CORETYPE"] == "Haswell"  # the caller's, as it was
    record = run.meta["worker_environment"]
    assert record["ref|threads=1"]["variables"]["OPENBLAS_CORETYPE"] == {"value": "Haswell", "origin": "caller"}
    clean = record["ref:slow|threads=1"]
    assert clean["clean"] and clean["variables"]["OPENBLAS_CORETYPE"]["removed"]
    ran = {b["architecture"] for b in clean["blas"] if b.get("internal_api") == "openblas"}
    # the clean worker runs what OpenBLAS picks for this CPU by itself: SkylakeX-class with AVX-512, and on an
    # AVX2 CPU (Haswell to Skylake client, Zen 1-3) Haswell, the very kernel the variable forced
    assert ran and ran == _own_openblas_kernels()
    if "avx512f" in _cpu_flags():
        assert ran <= SKYLAKEX_CLASS
    paras, _ = _answer(tmp_path / "r")
    forced = [p for p in paras if p.startswith("OPENBLAS_CORETYPE=Haswell")]
    assert forced and "inherited from the caller's environment" in forced[0] and "Haswell." in forced[0]
    assert "workers of ref:" in forced[0] and "ref:slow" not in forced[0]
    assert any(p.startswith("Clean environment: the workers of ref:slow") for p in paras)
    summary = done.stdout
    assert "caveat: OPENBLAS_CORETYPE=Haswell" in summary
    assert summary.index("caveat: OPENBLAS_CORETYPE") < summary.index("median per call")


def test_compare_pyperf_gives_both_tools_the_same_steering_variables(monkeypatch, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_pyperf", harness.__file__.replace(
        "harness/__init__.py", "benchmarks/compare_pyperf.py"))
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    _caller_sets(monkeypatch, OPENBLAS_CORETYPE="Haswell")
    for setup in compare.SETUPS:
        path = tmp_path / f"{setup}.yaml"
        path.write_text(compare.config_text(setup))
        assert all(c.clean_env == (setup == "clean") for c in compare.cells(str(path)))
        pyperf_env = compare.environments(str(path), setup)["harness"]
        assert pyperf_env.get("OPENBLAS_CORETYPE") == ("Haswell" if setup == "inherited" else None)
        assert pyperf_env["OMP_NUM_THREADS"] == "1" and pyperf_env["MALLOC_TRIM_THRESHOLD_"]


def test_the_peak_at_the_end_is_read_against_numpys_own_at_the_start_not_the_fma_roof():
    # the plain key holds the best of every library (the engine's FMA kernel here); the end measures NumPy's
    start = {"float32|threads=1": 200.0, "float32|threads=1|numpy": 100.0, "float32|threads=1|fma": 200.0}
    assert guard.peak_evidence(start, {"float32|threads=1": 95.0}) == []
    assert guard.peak_evidence(start, {"float32|threads=1": 60.0})[0].startswith(
        "the float32 GEMM peak at 1 thread(s) fell from 100 GFLOP/s")


def test_an_unsteady_machine_is_said_when_many_cells_processes_disagree_on_a_quiet_machine():
    from harness.results import caveats

    def row(backend, spread, contended=False):
        return {"backend": backend, "variant": "default", "workload": "train_step", "batch": 16, "threads": 1,
                "process_spread": spread, "contended": contended, "contention": "other processes used 0 of 2 cores"}

    steady = [row("numpy", 0.02), row("native", 0.04), row("jax", 0.12), row("torch", 0.01), row("numba", None)]
    assert not any(line.startswith("Unsteady") for line in caveats.lines({}, steady))
    unsteady = [row("numpy", 0.24), row("native", 0.15), row("jax", 0.03), row("torch", 0.05)]
    said = [line for line in caveats.lines({}, unsteady) if line.startswith("Unsteady")]
    assert len(said) == 1 and "2 of 4 timed cells" in said[0] and "(the most, numpy" in said[0] and "train_step batch 16: 24%" in said[0]
    # contended cells are the contention line's to say, not evidence of an unsteady machine
    loaded = [row("numpy", 0.24, True), row("native", 0.15, True), row("jax", 0.03), row("torch", 0.05)]
    assert not any(line.startswith("Unsteady") for line in caveats.lines({}, loaded))


def test_a_worker_reaped_between_two_readings_is_not_read_as_another_process_s_load():
    from harness.run.guard import Sample, summarise

    # one core busy with the harness's own work throughout; at t=1 the harness's own count lost a
    # worker's 3 s for one reading (it was reaped between its parent's reading and its own)
    ours = [0.0, 0.5, -2.0, 1.5, 2.0]
    samples = [Sample(t * 0.5, 1.0, busy_s=t * 0.5, steal_s=0.0, total_s=t, ours_s=o) for t, o in enumerate(ours)]
    seen = summarise(samples)
    assert seen["others_cores"] == 0.0
    assert seen["others_cores_max"] == 0.0


@pytest.mark.parametrize("flags, says", [
    (["avx2", "fma", "avx512f"], "OpenBLAS picks a SkylakeX-class kernel on its own"),
    (["avx2", "fma"], "picks Haswell's kernels on its own: the core type forced here is the one it would run"),
])
def test_a_forced_core_type_is_set_beside_what_openblas_picks_on_this_cpu(flags, says):
    from harness.results import caveats

    meta = {"machine": {"cpu_flags": flags}, "worker_environment": {"numpy|threads=1": {
        "variables": {"OPENBLAS_CORETYPE": {"value": "Haswell", "origin": "caller"}},
        "blas": [{"user_api": "blas", "internal_api": "openblas", "version": "0.3.31", "architecture": "Haswell"}]}}}
    [line] = [p for p in caveats.lines(meta, []) if p.startswith("OPENBLAS_CORETYPE=Haswell")]
    assert says in line and "workers of numpy" in line
    other = "SkylakeX-class" if "avx512f" not in flags else "the one it would run"
    assert other not in line
    # a core type other than the CPU's own is not called harmless on an AVX2 CPU
    meta["worker_environment"]["numpy|threads=1"]["variables"]["OPENBLAS_CORETYPE"]["value"] = "Sandybridge"
    [line] = [p for p in caveats.lines(meta, []) if p.startswith("OPENBLAS_CORETYPE=Sandybridge")]
    assert "the one it would run" not in line


def test_clean_env_names_a_copy_and_a_copy_is_no_baseline(write_config):
    from harness.config import load_config
    from harness.spec.errors import HarnessError

    cells = load_config(write_config("name: x\nbackends: [numpy, 'numpy#2']\nclean_env: ['numpy#2']\n")).cells()
    assert {c.copy: c.clean_env for c in cells} == {1: False, 2: True}  # the copy, and only it
    cells = load_config(write_config("name: x\nbackends: [numpy, 'numpy#2']\nclean_env: [numpy]\n", "b.yaml")).cells()
    assert all(c.clean_env for c in cells)  # a backend's name covers its copies
    with pytest.raises(HarnessError, match=r"baseline: 'numpy#2' is a copy of 'numpy'.*expected 'numpy'") as refused:
        load_config(write_config("name: x\nbackends: [numpy, 'numpy#2']\nbaseline: 'numpy#2'\n", "c.yaml"))
    assert "unknown backend" not in str(refused.value)
