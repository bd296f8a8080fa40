"""Bad input, interruptions, broken files and concurrent runs never cost a result or show a traceback."""

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import harness
from harness.cli import app
from harness.config import load_config
from harness.spec.errors import HarnessError
from harness.results.store import RunStore, write_json
from harness.run.runner import Runner, finish_meta, new_run_meta

ROOT = Path(__file__).resolve().parent.parent
BASE = """\
name: t
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 5, n_sequences: 16, n_eval: 8}
backends: [ref]
"""
FAST_TIMING = "timing: {warmup: 1, min_rounds: 3, min_time_s: 0.02, max_time_s: 0.5, timeout_s: 20, verify: false}\n"
BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x, x]"] +
                 [f"{c}: &{c} [{', '.join(['*' + p] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi")])


def _error_line(result) -> str:
    """The CLI's first output line, with rich's wrapping undone."""
    return " ".join(result.output.split())


def _refused(path: Path, *args) -> str:
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(path.parent / "out"), *args])
    text = _error_line(result)
    assert result.exit_code == 2, text
    assert text.startswith(f"error: {path}: "), text
    assert "Traceback" not in result.output and not isinstance(result.exception, (RecursionError, MemoryError))
    assert not (path.parent / "out" / "run.json").exists()
    return text


# -- bad config input: exit 2, `error: FILE: key.path: expected ...`, a short message ---------------------------
BAD_CONFIGS = {
    "duplicate key": (BASE + "batch: 1\nbatch: 2\n", "line 6, column 1: duplicate key 'batch' (first at line 5)"),
    "alias bomb in batch": (BOMB + "\n" + BASE + "batch: *i\n", "expands to more than"),
    "alias bomb in name": (BOMB + "\n" + BASE.replace("name: t", "name: *i"), "expands to more than"),
    "alias bomb in env": (BOMB + "\n" + BASE + "env: {X: *i}\n", "expands to more than"),
    "alias bomb in an unused profile": (BASE + "---\n" + BOMB + "\nprofiles: {big: {batch: *i}}\n", "expands to more than"),
    "self-referencing alias": (BASE + "batch: &b [1, *b]\n", "alias *b refers to the node that contains it"),
    "deep nesting": (BASE + "sweep: " + "[" * 600 + "]" * 600 + "\n", "nested more than"),
    "env name with =": (BASE + "env: {'A=B': '1'}\n", "env: expected variable names without '=' or NUL"),
    "env name with NUL": (BASE + 'env: {"A\\0B": "1"}\n', "env: expected variable names without '=' or NUL"),
    "env value null": (BASE + "env: {A: null}\n", "env: expected text values"),
    "env value list": (BASE + "env: {A: [1, 2]}\n", "env: expected text values"),
    "env replaces the backend registry": (BASE + "env: {HARNESS_BACKENDS: 'ref=os:Nothing'}\n",
                                          "HARNESS_BACKENDS is set by the harness itself"),
    "timeout_s inf": (BASE + "timing: {timeout_s: .inf}\n", "timing.timeout_s: expected a finite number"),
    "round_s inf": (BASE + "timing: {round_s: .inf}\n", "timing.round_s: expected a finite number"),
    "min_time_s inf": (BASE + "timing: {min_time_s: .inf}\n", "timing.min_time_s: expected a finite number"),
    "max_time_s inf": (BASE + "timing: {max_time_s: .inf}\n", "timing.max_time_s: expected a finite number"),
    "lr inf": (BASE + "train: {lr: .inf}\n", "train.lr: expected a finite number"),
    "lr nan": (BASE + "train: {lr: .nan}\n", "train.lr: expected a finite number"),
    "seed 2**63": (BASE + "seed: 9223372036854775808\n", "expected an integer below 2**63"),
    "batch 2**64": (BASE + "batch: 18446744073709551616\n", "expected an integer below 2**63"),
    "negative seed": (BASE + "seed: -1\n", "seed: expected greater than or equal to 0, got -1"),
    "warmup as text": (BASE + "timing: {warmup: '2'}\n", "timing.warmup: expected an integer, got '2'"),
    "verify as text": (BASE + "timing: {verify: 'yes'}\n", "timing.verify: expected true or false, got 'yes'"),
    "epochs as a list": (BASE + "train: {epochs: [true]}\n", "train.epochs: expected an integer, got [True]"),
    "lr as text": (BASE + "train: {lr: '0.1'}\n", "train.lr: expected a number, got '0.1'"),
    "batch as text": (BASE + "batch: '2'\n", "batch: expected a positive integer or a list of them, got '2'"),
    "batch as a bool": (BASE + "batch: true\n", "batch: expected a positive integer"),
    "batch of bools": (BASE + "batch: [true]\n", "batch: expected a positive integer"),
    "threads as text": (BASE + "threads: 'yes'\n", "threads: expected a positive integer"),
    "name a relative path": (BASE.replace("name: t", "name: ../x"), "name: expected a plain folder name"),
    "name an absolute path": (BASE.replace("name: t", "name: /tmp/x"), "name: expected a plain folder name"),
    "sweep key with a leading space": (BASE + "sweep: {' model.hidden': [4, 8]}\n", "expected a key without surrounding spaces"),
    "layers: 10**8": (BASE.replace("hidden: 8}", "hidden: 8, layers: 100000000}"), "expected a problem that fits in memory"),
    "hidden 10**9": (BASE.replace("hidden: 8}", "hidden: 1000000000}"), "needs an estimated"),
    "a runaway sweep": (BASE + "sweep: {model.hidden: [" + ", ".join(map(str, range(1, 201))) + "], task.seq_len: ["
                        + ", ".join(map(str, range(1, 201))) + "]}\n", "sweep: expected at most"),
}


@pytest.mark.parametrize("text, expected", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_is_one_short_error_line_with_exit_2(fake_backends, tmp_path, text, expected):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    msg = _refused(path)  # the message names the check that refused it, before any expansion or allocation
    assert expected in msg, msg
    assert len(msg) < 400, msg  # a short prefix of a bad value, never the value whole


def test_non_utf8_config_names_the_file_and_line(fake_backends, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(BASE.encode() + b"description: caf\xe9\n")
    assert "line 5: expected UTF-8 text, got byte 0xe9" in _refused(path)


@pytest.mark.parametrize("target", ["folder", "/dev/null", "/dev/zero"])
def test_text_task_path_must_be_a_regular_file(fake_backends, tmp_path, target):
    target = str(tmp_path) if target == "folder" else target
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE.replace("task: {kind: random, vocab: 20,", f"task: {{kind: lm_text, path: '{target}', vocab: 20,")
                    .replace("model: {kind: elman, hidden: 8}", "model: {kind: elman, hidden: 8, head: softmax_xent}"))
    assert "task.path: expected a regular text file" in _refused(path)


def test_worker_reads_text_only_from_a_regular_file(tmp_path):
    from harness.spec.data import read_text_file

    with pytest.raises(HarnessError, match="expected a regular text file"):
        read_text_file(Path("/dev/zero"))
    (tmp_path / "big.txt").write_text("x" * 100)
    with pytest.raises(HarnessError, match="at most"):
        read_text_file(tmp_path / "big.txt", max_bytes=10)
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    assert read_text_file(tmp_path / "latin.txt") == "caf\ufffd"


def test_memory_refusal_shows_the_estimate(fake_backends, tmp_path):
    from harness.config import estimate_bytes

    path = tmp_path / "cfg.yaml"
    path.write_text(BASE.replace("hidden: 8}", "hidden: 4096}") + "batch: 64\n")
    cfg = load_config(path)  # fits this machine
    need = sum(estimate_bytes(c) for c in cfg.cells())
    assert need > 3 * 4096 * 4096 * 4  # parameters, gradients and a copy at least
    with pytest.raises(HarnessError, match=r"needs an estimated .* this machine has 1 MB"):
        cfg.check_memory(limit_mb=1.0)


# -- a cell's identity covers every setting that changes its result; identical cells run once ------------------
def test_cells_differing_only_in_train_or_timing_or_seed_or_env_are_distinct(fake_backends, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + "train: {lr: 0.001}\n---\ntrain: {lr: 0.5}\n---\ntiming: {min_rounds: 7}\n---\nseed: 3\n"
                    "---\nenv: {MY_FLAG: '1'}\n")
    cells = load_config(path).cells()
    assert len({c.cell_id for c in cells}) == len(cells) == 5
    lrs = {c.cell_id: c.train.lr for c in cells}
    assert sorted(lrs.values()) == [0.001] * 4 + [0.5]  # later documents inherit the first one's lr


def test_identical_cells_run_once(fake_backends, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + "sweep: {model.hidden: [4, 4, 8]}\n---\ndescription: the same again\n")
    cells = load_config(path).cells()
    assert [c.problem.model.hidden for c in cells] == [4, 8]


def test_a_group_keeps_its_cells_together_when_documents_add_backends(fake_backends, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE.replace("backends: [ref]", "backends: [ref, 'ref:slow']") + "---\nbackends: [ref, 'bad:crash']\n")
    cells = load_config(path).cells()
    assert [c.backend for c in cells] == ["ref", "ref:slow", "bad"]  # bad:crash is bad's default variant
    assert len({c.group_key for c in cells}) == 1


# -- the results folder: locked, checked on resume, atomic, honest about the disk ---------------------------------
def _config(tmp_path, extra=""):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + "batch: [1, 2]\n" + FAST_TIMING + extra)
    return load_config(path)


def test_a_locked_folder_refuses_a_second_run(fake_backends, tmp_path):
    cfg = _config(tmp_path)
    first = RunStore.create(tmp_path / "run", new_run_meta(cfg), lock=True)
    with pytest.raises(HarnessError, match="another run is writing to this folder"):
        RunStore.create(tmp_path / "run", new_run_meta(cfg), lock=True)
    with pytest.raises(HarnessError, match="another run is writing to this folder"):
        RunStore.open(tmp_path / "run", lock=True)
    first.close()
    RunStore.open(tmp_path / "run", lock=True).close()  # free again once the first run let go


def test_runs_started_in_the_same_second_get_their_own_ids(fake_backends, tmp_path):
    cfg = _config(tmp_path)
    meta = new_run_meta(cfg)
    a = RunStore.create_unique(tmp_path / "results", dict(meta))
    b = RunStore.create_unique(tmp_path / "results", dict(meta))
    assert a.meta["run_id"] != b.meta["run_id"] and a.path != b.path
    assert json.loads((b.path / "run.json").read_text())["run_id"] == b.meta["run_id"]


def _started_run(tmp_path, cfg):
    from harness.results.store import config_fingerprint

    meta = new_run_meta(cfg)
    meta["config_fingerprint"] = config_fingerprint(cfg)
    store = RunStore.create(tmp_path / "run", meta)
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 1.0}
    runner.run(groups=runner.pending_groups()[:1])  # one group done, then "interrupted"
    finish_meta(store, interrupted=True)
    return store


def test_resume_refuses_another_config(fake_backends, tmp_path):
    cfg = _config(tmp_path)
    _started_run(tmp_path, cfg)
    before = (tmp_path / "run" / "run.json").read_bytes()
    other = tmp_path / "other.yaml"
    other.write_text(BASE + "batch: [1, 2]\n" + FAST_TIMING + "train: {lr: 0.5}\n")
    result = CliRunner().invoke(app, ["run", str(other), "--resume", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "this run was started with another config" in _error_line(result)
    assert (tmp_path / "run" / "run.json").read_bytes() == before


@pytest.mark.parametrize("damaged", ["timings.parquet", "run.json"])
def test_resume_of_a_damaged_run_is_a_clear_error(fake_backends, tmp_path, damaged):
    cfg = _config(tmp_path)
    _started_run(tmp_path, cfg)
    target = tmp_path / "run" / damaged
    target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])
    result = CliRunner().invoke(app, ["run", str(tmp_path / "cfg.yaml"), "--resume", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert _error_line(result).startswith(f"error: {tmp_path / 'run'}: damaged ({damaged}: ")
    assert "cannot resume this run" in _error_line(result)
    assert "Traceback" not in result.output


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_result_files_honour_the_umask(fake_backends, tmp_path, umask):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "run.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "run.json").stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("code, says", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "the file system is read-only"),
                                        (errno.EACCES, "no permission")])
def test_a_full_or_read_only_disk_is_a_clear_error_and_keeps_finished_cells(fake_backends, tmp_path, monkeypatch, code, says):
    import harness.results.store as results

    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + "batch: [1, 2]\n" + FAST_TIMING.replace("verify: false}", "verify: false, passes: 1}"))
    saves = []
    real = results.os.replace

    def replace(src, dst, **at):
        saves.append(dst)
        if str(dst).endswith("timings.parquet") and len([s for s in saves if str(s).endswith("timings.parquet")]) > 2:
            raise OSError(code, os.strerror(code))  # the disk fills up after the first group was saved
        return real(src, dst, **at)

    monkeypatch.setattr(results.os, "replace", replace)
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "run"), "--no-plots"])
    assert result.exit_code == 1, result.output
    text = _error_line(result)
    assert f"error: {tmp_path / 'run' / 'timings.parquet'}: cannot write results: {says}" in text
    assert "Traceback" not in result.output
    kept = pd.read_parquet(tmp_path / "run" / "timings.parquet")
    assert list(kept["status"]) == ["ok"]  # the first group, finished before the disk filled up
    assert not list((tmp_path / "run").glob(".*.tmp"))


def test_a_read_only_output_folder_is_refused_before_the_run(fake_backends, tmp_path, monkeypatch):
    import harness.spec.writes as writes

    def new_temp(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(writes, "_new_temp", new_temp)
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + FAST_TIMING)
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert _error_line(result).startswith(f"error: {tmp_path / 'out'}/timings.parquet: cannot write results: "
                                          f"the file system is read-only")


# -- commands meant for CI fail when they could not check -----------------------------------------------------
@pytest.mark.parametrize("args, says", [(["check", "--device", "tpu"], "--device: expected cpu or gpu, got 'tpu'"),
                                        (["check", "--backends", ","], "--backends: expected a comma-separated list"),
                                        (["check", "--backends", " , "], "--backends: expected a comma-separated list"),
                                        (["check", "--match", "no such case"], "--match: no case label contains 'no such case'"),
                                        (["check", "--dtype", "int8"], "--dtype: expected one of float32, float64, bfloat16, float16, got 'int8'"),
                                        (["check", "--match", "wildml", "--dtype", "float16"],
                                         "--dtype: no float16 case among the --match 'wildml' cases of the whole matrix")])
def test_check_refuses_what_it_cannot_check(fake_backends, args, says):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert says in _error_line(result)


def test_check_match_runs_only_the_cases_it_names(fake_backends):
    import json

    result = CliRunner().invoke(app, ["check", "--backends", "ref", "--match", "lstm-peephole mse truncated:3", "--json"])
    assert result.exit_code == 0, result.output
    cases = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert len(cases) >= 4 and all("lstm-peephole mse truncated:3" in c["case"] for c in cases)
    plain = [c for c in cases if c["dtype"] in ("float32", "float64")]
    assert {c["status"] for c in plain} == {"pass"} and {c["dtype"] for c in plain} == {"float32", "float64"}
    # the test backend declares no mixed precision: its bfloat16/float16 cases are refused, not run
    assert {c["status"] for c in cases if c not in plain} <= {"unsupported"}
    result = CliRunner().invoke(app, ["check", "--backends", "ref", "--match", "lstm-peephole mse truncated:3",
                                      "--dtype", "float32", "--json"])
    assert result.exit_code == 0, result.output
    only = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert {c["dtype"] for c in only} == {"float32"} and len(only) == sum(c["dtype"] == "float32" for c in cases)


def test_check_with_no_backend_available_on_the_device_fails(fake_backends, monkeypatch):
    import harness.run.conformance as conformance
    from harness.verify.check import CaseResult

    monkeypatch.setattr(conformance, "check_backend", lambda full, **k: [
        CaseResult(full, "case", "float32", "unavailable", "no GPU here")])
    result = CliRunner().invoke(app, ["check", "--backends", "ref", "--device", "gpu"])
    assert result.exit_code == 1, result.output
    assert "no backend could be checked on device gpu" in _error_line(result)


def test_run_with_an_empty_backend_list_is_refused(fake_backends, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE)
    result = CliRunner().invoke(app, ["run", str(path), "--backends", ","])
    assert result.exit_code == 2 and "--backends: expected a comma-separated list" in _error_line(result)


def test_compare_of_runs_with_no_cell_in_common_fails(fake_backends, tmp_path):
    from harness.results.schema import cell_columns

    for name, hidden in (("a", 8), ("b", 16)):
        cfg_path = tmp_path / f"{name}.yaml"
        cfg_path.write_text(BASE.replace("hidden: 8", f"hidden: {hidden}"))
        cfg = load_config(cfg_path)
        store = RunStore.create(tmp_path / name, new_run_meta(cfg))
        row = cell_columns(cfg.cells()[0])
        row.update(status="ok", median_s=1e-3, samples_s=[1e-3] * 5, n_samples=5, baseline="ref")
        store.add([row], [])
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    assert "no cell in common" in _error_line(result)


def test_a_save_parted_by_a_kill_between_its_writes_leaves_the_run_as_before_it(fake_backends, tmp_path, monkeypatch):
    """The tables and run.json are three files: a kill after the tables landed and before run.json did must
    leave a run that reads (and resumes) as it was before that save, not one 'damaged' by rows it does not record."""
    from harness.results import store as store_module
    from harness.results.schema import cell_columns
    from harness.results.store import read_folder

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(BASE + "batch: [1, 2]\n")
    cfg = load_config(cfg_path)
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    rows = []
    for cell in cfg.cells()[:2]:
        row = cell_columns(cell)
        row.update(status="ok", median_s=1e-3, samples_s=[1e-3] * 5, n_samples=5, baseline="ref")
        rows.append(row)
    store.add([rows[0]], [])
    written = []
    real_json, real_table = store_module.write_json, store_module.write_table

    def table(path, *a, **k):
        written.append(path.name)
        return real_table(path, *a, **k)

    def killed_after_the_tables(path, data, run=None):
        if written[-1:] == ["curves.parquet"]:  # the tables landed; the kill comes before run.json does
            raise KeyboardInterrupt
        return real_json(path, data, run=run)

    monkeypatch.setattr(store_module, "write_table", table)
    monkeypatch.setattr(store_module, "write_json", killed_after_the_tables)
    with pytest.raises(KeyboardInterrupt):
        store.add([rows[1]], [])
    monkeypatch.setattr(store_module, "write_json", real_json)
    monkeypatch.setattr(store_module, "write_table", real_table)
    meta, timings, _ = read_folder(tmp_path / "run")
    assert list(timings["cell_id"]) == [rows[0]["cell_id"]] and list(meta["cells"]) == [rows[0]["cell_id"]]
    again = RunStore.open(tmp_path / "run")
    assert again.done_cells() == {rows[0]["cell_id"]}
    assert list(pd.read_parquet(tmp_path / "run" / "timings.parquet")["cell_id"]) == [rows[0]["cell_id"]]
    again.add([rows[1]], [])
    assert set(read_folder(tmp_path / "run")[1]["cell_id"]) == {r["cell_id"] for r in rows}


# -- the worker channel ---------------------------------------------------------------------------------------
def test_a_malformed_reply_line_fails_one_cell_not_the_run(fake_backends, tmp_path, monkeypatch):
    from harness.worker import protocol

    site = tmp_path / "site"
    site.mkdir()
    # a library printing something that starts like a reply, before the worker owns its stdout
    (site / "sitecustomize.py").write_text(f"print({protocol.REPLY_PREFIX!r} + '{{broken')\n")
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE + FAST_TIMING)
    cfg = load_config(path)
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 1.0}
    monkeypatch.setenv("PYTHONPATH", str(site) + os.pathsep + os.environ["PYTHONPATH"])
    runner.run()
    finish_meta(store)
    t = harness.load_run(tmp_path / "run").timings
    assert list(t["status"]) == ["error"] and "malformed reply" in t["error"].iloc[0]


# -- signals at every phase: no worker left behind, the run marked interrupted, exit 128 + signal -----------------
SLOW_BACKEND = '''
import os, time
from fake_backends import RefBackend


class SlowBackend(RefBackend):
    """Announces (a file named after the phase, holding its pid) and then lingers in one phase."""

    name = "slow"
    variants = ("init", "warm", "time")

    def _mark(self, phase):
        if phase == self.variant:
            with open(os.path.join(os.environ["SLOW_MARKS"], phase), "w") as fh:
                fh.write(str(os.getpid()))
            time.sleep(60)

    def prepare(self, problem, params, device="cpu", threads=1):
        super().prepare(problem, params, device, threads)
        self._mark("init")

    def warm_up(self, batch):
        self._mark("warm")

    def sgd_step(self, x, y, lr):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 3:
            self._mark("time")
        return super().sgd_step(x, y, lr)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _start_slow_run(tmp_path, phase):
    """``harness run`` in a subprocess with a backend that lingers in ``phase``; returns it and its worker's pid
    once the worker is there."""
    (tmp_path / "slow_backend.py").write_text(SLOW_BACKEND)
    marks = tmp_path / "marks"
    marks.mkdir()
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE.replace("backends: [ref]", f"backends: [ref, 'slow:{phase}']") + FAST_TIMING
                    + f"env: {{SLOW_MARKS: '{marks}'}}\n")
    env = {**os.environ, "HARNESS_BACKENDS": "ref=fake_backends:RefBackend,slow=slow_backend:SlowBackend",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # the run starts as from a terminal, with Ctrl-C's default action: a shell that started pytest in the
    # background passes SIGINT on ignored, and Python keeps an ignored SIGINT ignored
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", str(path), "--out", str(tmp_path / "run"),
                             "--no-plots"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (marks / phase).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not (marks / phase).exists():
        proc.kill()
        pytest.fail(proc.communicate()[0].decode()[-2000:])
    return proc, int((marks / phase).read_text())


@pytest.mark.slow
def test_a_second_run_into_a_busy_folder_is_refused_and_takes_nothing(fake_backends, tmp_path, monkeypatch):
    proc, worker = _start_slow_run(tmp_path, "time")
    monkeypatch.setenv("HARNESS_BACKENDS", "ref=fake_backends:RefBackend,slow=slow_backend:SlowBackend")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        before = (tmp_path / "run" / "run.json").read_bytes()
        result = CliRunner().invoke(app, ["run", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "run"), "--no-plots"])
        assert result.exit_code == 2, result.output
        assert "another run is writing to this folder" in _error_line(result)
        assert (tmp_path / "run" / "run.json").read_bytes() == before
        resumed = CliRunner().invoke(app, ["run", str(tmp_path / "cfg.yaml"), "--resume", str(tmp_path / "run")])
        assert resumed.exit_code == 2 and "another run is writing to this folder" in _error_line(resumed)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM


@pytest.mark.slow
@pytest.mark.parametrize("sig, phase", [(signal.SIGINT, "init"), (signal.SIGTERM, "warm"), (signal.SIGHUP, "time"),
                                        (signal.SIGTERM, "init"), (signal.SIGHUP, "warm"), (signal.SIGINT, "time")],
                         ids=lambda v: v.name if isinstance(v, signal.Signals) else v)
def test_a_signal_at_any_phase_leaves_no_worker_and_marks_the_run(tmp_path, sig, phase):
    proc, worker = _start_slow_run(tmp_path, phase)
    assert _alive(worker)
    proc.send_signal(sig)
    out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 128 + sig, out[-2000:]
    assert "Traceback" not in out
    deadline = time.monotonic() + 30  # a safety net: the loop ends as soon as the worker is gone
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["interrupted"] is True and meta["finished"] is None
