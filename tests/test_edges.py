"""Edges of the CLI: relative paths, settings the harness overrides, markup in user text, damaged
folders, malformed imports, special files. Each case ends in the right result or one error line."""

import errno
import json
import os
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import harness.results.store
import harness.spec.writes
from harness.cli import app
from harness.config import load_config
from harness.spec.errors import HarnessError
from harness.results.store import RunStore, config_fingerprint
from harness.run.runner import Runner, finish_meta, new_run_meta
from harness.results.schema import cell_columns

BASE = """\
name: t
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 5, n_sequences: 16, n_eval: 8}
backends: [ref]
"""
FAST = "timing: {warmup: 1, min_rounds: 3, min_time_s: 0.02, max_time_s: 0.3, timeout_s: 20, verify: false}\n"
TEXT_TASK = """\
name: t
model: {kind: elman, hidden: 8, head: softmax_xent}
task: {kind: lm_text, path: corpus.txt, vocab: 20, seq_len: 5, n_sequences: 16, n_eval: 8}
backends: [ref]
"""
CORPUS = "The cat sat on the mat. The dog sat on the log. A bird sang in the tree, and the cat slept.\n" * 20


def _line(result) -> str:
    return " ".join(result.output.split())


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _refused(path: Path, *args) -> str:
    result = _invoke("run", path, "--out", path.parent / "out", "--no-plots", *args)
    text = _line(result)
    assert result.exit_code == 2, text
    assert text.startswith("error: "), text
    assert "Traceback" not in result.output and result.output.count("error:") == 1, result.output
    assert not (path.parent / "out" / "run.json").exists()
    return text


# -- relative paths ------------------------------------------------------------------------------------------
def test_relative_task_path_is_read_beside_the_config_by_check_and_workers(fake_backends, tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "corpus.txt").write_text(CORPUS)
    (project / "cfg.yaml").write_text(TEXT_TASK + FAST)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = _invoke("run", project / "cfg.yaml", "--out", tmp_path / "run", "--no-plots")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    resolved = str(project / "corpus.txt")
    assert meta["cells"] and set(meta["cells"].values()) == {"ok"}, meta["cells"]
    digest = meta["task_files"][resolved]
    assert len(digest) == 64
    cell_id = next(iter(meta["cells"]))
    assert f"task.path={resolved}" in cell_id and f"task.sha256={digest[:16]}" in cell_id


def test_a_changed_corpus_is_another_cell(fake_backends, tmp_path):
    (tmp_path / "corpus.txt").write_text(CORPUS)
    (tmp_path / "cfg.yaml").write_text(TEXT_TASK)
    before = load_config(tmp_path / "cfg.yaml")
    (tmp_path / "corpus.txt").write_text(CORPUS + "More text here.\n")
    after = load_config(tmp_path / "cfg.yaml")
    assert before.cells()[0].cell_id != after.cells()[0].cell_id
    assert config_fingerprint(before) != config_fingerprint(after)  # --resume refuses the changed corpus


def test_relative_task_path_missing_beside_the_config_is_refused_even_if_the_cwd_has_it(fake_backends, tmp_path,
                                                                                         monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cfg.yaml").write_text(TEXT_TASK)
    (tmp_path / "corpus.txt").write_text(CORPUS)  # in the folder the run starts from, not beside the config
    monkeypatch.chdir(tmp_path)
    msg = _refused(tmp_path / "sub" / "cfg.yaml")
    assert "task.path: no such file" in msg and "/sub/corpus.txt" in msg, msg


# -- settings the harness would override ---------------------------------------------------------------------
@pytest.mark.parametrize("env, says", [
    ({"OMP_NUM_THREADS": "2"}, "OMP_NUM_THREADS is set for every worker from the cell's threads: setting"),
    ({"OPENBLAS_NUM_THREADS": "4"}, "OPENBLAS_NUM_THREADS is set for every worker from the cell's threads:"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES is set for every worker from the cell's device:"),
    ({"LD_PRELOAD": "/tmp/x.so"}, "'LD_PRELOAD' makes the dynamic loader load code into every worker"),
    ({"LD_LIBRARY_PATH": "/tmp"}, "'LD_LIBRARY_PATH' makes the dynamic loader"),
    ({"LD_AUDIT": "/tmp/a.so"}, "'LD_AUDIT' makes the dynamic loader"),
    ({"DYLD_INSERT_LIBRARIES": "/tmp/x.dylib"}, "'DYLD_INSERT_LIBRARIES' makes the dynamic loader"),
    ({"BIG": "x" * (129 * 1024)}, "env: expected a value of at most 127 KB"),
])
def test_env_the_harness_overrides_or_that_loads_code_is_refused(fake_backends, tmp_path, env, says):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + "env: " + json.dumps(env) + "\n")
    msg = _refused(path)
    assert says in msg, msg
    assert len(msg) < 400


def test_env_a_backend_sets_itself_is_recorded_as_overridden(fake_backends, tmp_path, monkeypatch):
    from fake_backends import RefBackend

    monkeypatch.setattr(RefBackend, "environment_variables",
                        classmethod(lambda cls, variant, threads, device, dtype: {"REF_FLAGS": "backend"}))
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + FAST + "env: {REF_FLAGS: config, OTHER: kept}\n")
    result = _invoke("run", path, "--out", tmp_path / "run", "--no-plots")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["worker_env"]["ref"]["REF_FLAGS"] == "backend"
    assert meta["env_overridden"] == {"ref": {"REF_FLAGS": {"config": "config", "worker": "backend"}}}


# -- resume, compare -----------------------------------------------------------------------------------------
def _started_run(tmp_path, text=BASE + "batch: [1, 2]\n" + FAST):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    cfg = load_config(path)
    meta = new_run_meta(cfg)
    meta["config_fingerprint"] = config_fingerprint(cfg)
    store = RunStore.create(tmp_path / "run", meta)
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 1.0}
    runner.run(groups=runner.pending_groups()[:1])
    finish_meta(store, interrupted=True)
    return path


def test_resume_into_a_run_without_a_fingerprint_is_refused(fake_backends, tmp_path):
    _started_run(tmp_path)
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    del meta["config_fingerprint"]
    (tmp_path / "run" / "run.json").write_text(json.dumps(meta))
    other = tmp_path / "other.yaml"
    other.write_text(BASE + "batch: [1, 2]\n" + FAST + "train: {lr: 0.5}\n")
    before = (tmp_path / "run" / "run.json").read_bytes()
    result = _invoke("run", other, "--resume", tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert "records no config fingerprint" in _line(result)
    assert (tmp_path / "run" / "run.json").read_bytes() == before


def test_compare_with_no_cell_timed_in_both_runs_exits_2(fake_backends, tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text(BASE)
    cfg = load_config(path)
    for name in ("a", "b"):
        store = RunStore.create(tmp_path / name, new_run_meta(cfg))
        row = cell_columns(cfg.cells()[0])
        row.update(status="error", error="boom", baseline="ref")
        store.add([row], [])
    result = _invoke("compare", tmp_path / "a", tmp_path / "a")
    assert result.exit_code == 2, result.output
    assert "no cell timed in both runs" in _line(result) and "no regression" not in result.output


# -- config shapes that were silently reinterpreted ----------------------------------------------------------
@pytest.mark.parametrize("text, says", [
    (BASE + 'sweep: {"model.hidden,model.hidden": [[4, 8]]}\n', "model.hidden is swept twice"),
    (BASE + 'sweep: {"model.hidden": [4], "model.hidden,task.seq_len": [[8, 5]]}\n', "model.hidden is swept twice"),
    (BASE.replace("hidden: 8", "hidden: 010"), "'010' is an octal number in YAML 1.1"),
    (BASE + "batch: 1:30\n", "'1:30' is a base-60 number in YAML 1.1"),
    (BASE + "timing: {min_time_s: 1:30.5}\n", "'1:30.5' is a base-60 number"),
    (BASE + "---\nname: other\nbatch: [2]\n", "document 2: name: the first document names the run"),
    (BASE.replace("backends: [ref]", "backends: [ref, bad]") + "---\nbaseline: bad\n",
     "document 2: baseline: its train_step elman"),
    (BASE + "train: {epochs: 3}\n", "train.epochs: applies to workload train only"),
    (BASE + "---\ntrain: {eval_every: 10}\n", "document 2: train.eval_every: applies to workload train only"),
    (BASE + "sweep: {train.patience: [1, 2]}\n", "sweep.train.patience: applies to workload train only"),
    (BASE + "timing: {speedup_precision: 1.0e-300}\n", "timing.speedup_precision: expected greater than or equal"),
])
def test_config_shapes_that_were_reinterpreted_are_refused(fake_backends, tmp_path, text, says):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    msg = _refused(path)
    assert msg.startswith(f"error: {path}: ") and says in msg, msg


def test_the_step_s_own_train_setting_and_a_training_document_s_are_accepted(fake_backends, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + "train: {lr: 0.1}\n---\nworkloads: [train]\ntrain: {epochs: 2}\n")
    cfg = load_config(path)
    assert {c.problem.workload for c in cfg.cells()} == {"train_step", "train"}
    path.write_text(BASE + "hidden_text: '010'\n".replace("hidden_text", "description"))
    assert load_config(path).raw.description == "010"


# -- special files -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "folder", "huge"])
def test_the_config_reader_refuses_special_and_huge_files(fake_backends, tmp_path, kind):
    if kind == "/dev/zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        path = tmp_path / "cfg.yaml"
        os.mkfifo(path)
    elif kind == "folder":
        path = tmp_path / "cfg.yaml"
        path.mkdir()
    else:
        path = tmp_path / "cfg.yaml"
        path.write_text(BASE + "description: '" + "x" * (2 << 20) + "'\n")
    result = _invoke("run", path, "--out", tmp_path / "out", "--no-plots")
    assert result.exit_code == 2, result.output
    says = "expected a config of at most 1 MB" if kind == "huge" else "expected a regular file holding a config"
    assert _line(result).startswith(f"error: {path}: {says}"), result.output


# -- markup in user text -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, shown", [
    (["run", "{cfg}", "--backends", "[/]"], "[/]"),
    (["run", "{cfg}", "--backends", "ref,[red]x"], "[red]x"),
    (["check", "--backends", "[/]"], "[/]"),
    (["compare", "x[/]", "y[red]z"], "x[/]"),
    (["report", "r[/]"], "r[/]"),
    (["plot", "p[bold]q"], "p[bold]q"),
    (["export", "e[/]"], "e[/]"),
])
def test_user_text_with_markup_is_shown_as_typed(fake_backends, tmp_path, args, shown):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(BASE)
    result = _invoke(*[a.replace("{cfg}", str(cfg)) for a in args])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "MarkupError" not in repr(result.exception) and shown in result.output, result.output


@pytest.mark.parametrize("name", ["a[/]b.yaml", "c[red]d.yaml"])
def test_config_file_names_with_markup_are_shown_as_typed(fake_backends, tmp_path, name):
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)  # a[/]b.yaml is b.yaml in the folder a[
    path.write_text(BASE + "unknown_key: 1\n")
    msg = _refused(path)
    assert msg.startswith(f"error: {path}: unknown_key: unknown key"), msg
    path.write_text(BASE + FAST)
    result = _invoke("run", path, "--out", tmp_path / "r[/]un", "--no-plots")
    assert result.exit_code == 0, (result.output, result.exception)
    assert str(tmp_path / "r[/]un") in " ".join(result.output.split())


def test_the_dask_install_hint_keeps_its_extra(fake_backends, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)
    monkeypatch.setitem(sys.modules, "dask", None)
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE)
    result = _invoke("run", path, "--executor", "dask-local", "--out", tmp_path / "out", "--no-plots")
    assert result.exit_code == 1, result.output
    assert "'rnn-harness[dask]'" in result.output, result.output


# -- damaged folders -----------------------------------------------------------------------------------------
def _damage(run: Path, how: str) -> None:
    import pandas as pd

    if how == "truncated run.json":
        data = (run / "run.json").read_bytes()
        (run / "run.json").write_bytes(data[: len(data) // 2])
    elif how == "truncated timings":
        data = (run / "timings.parquet").read_bytes()
        (run / "timings.parquet").write_bytes(data[: len(data) // 2])
    elif how == "foreign timings":
        pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}).to_parquet(run / "timings.parquet")
    else:  # the run's columns, the wrong types
        df = pd.read_parquet(run / "timings.parquet")
        df["median_s"] = "fast"
        df["cell_id"] = 7
        df.to_parquet(run / "timings.parquet")


@pytest.fixture
def a_run(fake_backends, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + "batch: [1, 2]\n")
    cfg = load_config(path)
    meta = new_run_meta(cfg)
    meta["config_fingerprint"] = config_fingerprint(cfg)
    store = RunStore.create(tmp_path / "run", meta)
    rows = []
    for cell in cfg.cells():
        row = cell_columns(cell)
        row.update(status="ok", median_s=1e-3, samples_s=[1e-3] * 5, n_samples=5, baseline="ref",
                   speedup=1.0, speedup_lo=1.0, speedup_hi=1.0)
        rows.append(row)
    store.add(rows, [])
    return tmp_path / "run"


@pytest.mark.parametrize("how", ["truncated run.json", "truncated timings", "foreign timings", "wrong types"])
@pytest.mark.parametrize("command", ["compare", "report", "export", "plot", "resume"])
def test_a_damaged_folder_is_one_line_and_exit_2_in_every_reading_command(a_run, command, how):
    _damage(a_run, how)
    args = {"compare": ["compare", a_run, a_run], "report": ["report", a_run], "export": ["export", a_run],
            "plot": ["plot", a_run],
            "resume": ["run", a_run.parent / "cfg.yaml", "--resume", a_run, "--no-plots"]}[command]
    result = _invoke(*args)
    text = _line(result)
    assert result.exit_code == 2, (text, result.exception)
    assert text.startswith(f"error: {a_run}: damaged ("), text
    assert "Traceback" not in result.output and result.output.count("\nerror") == 0


# -- a full disk at the lock ---------------------------------------------------------------------------------
def test_a_full_disk_at_the_folder_lock_is_the_one_line_disk_error(fake_backends, tmp_path, monkeypatch):
    real_open = harness.spec.writes.open_private

    class Full:
        def __init__(self, fh):
            self._fh = fh

        def __getattr__(self, name):
            return getattr(self._fh, name)

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(file, *args, **kwargs):
        fh = real_open(file, *args, **kwargs)
        return Full(fh) if str(file).endswith(".lock") else fh

    monkeypatch.setattr(harness.spec.writes, "open_private", full_open)
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE)
    result = _invoke("run", path, "--out", tmp_path / "run", "--no-plots")
    assert result.exit_code == 2, (result.output, result.exception)
    assert _line(result) == (f"error: {tmp_path / 'run'}: cannot write results: the disk is full "
                             f"(No space left on device); the results saved before are kept")


# -- HARNESS_BACKENDS ----------------------------------------------------------------------------------------
def test_a_backend_swapped_by_harness_backends_is_recorded_and_reported(fake_backends, tmp_path, monkeypatch):
    from harness.results.report import build_report, to_markdown

    monkeypatch.setenv("HARNESS_BACKENDS", "numpy=fake_backends:RefBackend,ref=fake_backends:RefBackend")
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE.replace("backends: [ref]", "backends: [numpy, ref]"))
    cfg = load_config(path)
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    sources = store.meta["backend_sources"]
    assert sources["numpy"] == {"origin": "HARNESS_BACKENDS", "class": "fake_backends:RefBackend",
                                "replaces": "backends.numpy_backend:NumpyBackend"}
    assert sources["ref"] == {"origin": "HARNESS_BACKENDS", "class": "fake_backends:RefBackend"}
    title, blocks = build_report(tmp_path / "run", plots=[])
    md = to_markdown(title, blocks, tmp_path / "run")
    assert "replaces the built-in `backends.numpy_backend:NumpyBackend`" in md


# -- harness import ------------------------------------------------------------------------------------------
def _bench(**over):
    stats = {"median": 0.001, "min": 0.0009, "mean": 0.0011, "stddev": 0.0001, "rounds": 5, "iqr": 0.0001,
             "data": [0.001, 0.0011, 0.0009, 0.001, 0.0012]}
    stats.update(over.pop("stats", {}))
    return {"name": "test_a", "fullname": "t.py::test_a", "group": "g", "params": None, "extra_info": {},
            "stats": stats, **over}


MALFORMED = {
    "negative median": ({"benchmarks": [_bench(stats={"median": -1.0})]}, "benchmarks[0].stats.median"),
    "NaN sample": ({"benchmarks": [_bench(stats={"data": [0.001, float("nan"), 0.001]})]}, "benchmarks[0].stats.data"),
    "text in data": ({"benchmarks": [_bench(stats={"data": ["0.001", "x"]})]}, "benchmarks[0].stats.data[0]"),
    "extra_info text": ({"benchmarks": [_bench(extra_info="abc")]}, "benchmarks[0].extra_info"),
    "suite cell without group": ({"benchmarks": [_bench(extra_info={"cell_id": "a|numpy", "backend": "numpy"})]},
                                 "a harness cell needs text group"),
    "group a list": ({"benchmarks": [_bench(group=["a", "b"])]}, "benchmarks[0].group"),
    "machine_info text": ({"benchmarks": [_bench()], "machine_info": "x"}, "machine_info"),
    "commit_info a list": ({"benchmarks": [_bench()], "commit_info": [1]}, "commit_info"),
    "rounds as text": ({"benchmarks": [_bench(stats={"rounds": "5"})]}, "benchmarks[0].stats.rounds"),
}


@pytest.mark.parametrize("doc, says", MALFORMED.values(), ids=MALFORMED.keys())
def test_import_refuses_a_malformed_file_with_one_line(tmp_path, doc, says):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    result = _invoke("import", path, "--out", tmp_path / "out")
    text = _line(result)
    assert result.exit_code == 2, (text, result.exception)
    assert text.startswith(f"error: {path}: ") and says in text, text
    assert not (tmp_path / "out" / "run.json").exists()


def test_import_bootstrap_memory_is_bounded(tmp_path):
    from harness.run.stats import ratio_interval

    rng = np.random.default_rng(0)
    a, b = rng.random(10_000) + 1, rng.random(10_000) + 1
    tracemalloc.start()
    try:
        point, lo, hi = ratio_interval(a, b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lo <= point <= hi
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MB"  # one (2000, n) index array would be 160 MB
