"""What deletes or writes under HARNESS_HOME or a results folder checks its target first; what reads a run
takes it as one only when its tables are there and its own; versions name one environment each."""

import json
import os
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import backends
from harness.cli import app
from harness.results.store import RunStore, config_fingerprint, load_run, read_folder
from harness.run import envs
from harness.config import load_config
from harness.run.runner import Runner, finish_meta, new_run_meta
from harness.spec import environments
from harness.spec.errors import HarnessError

BASE = """\
name: t
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 5, n_sequences: 16, n_eval: 8}
backends: [ref]
batch: [1, 2]
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.02, max_time_s: 0.5, timeout_s: 20, verify: false}
"""


def _line(result) -> str:
    """The CLI's output with rich's wrapping undone."""
    return " ".join(result.output.split())


def _one_error(result, code: int = 2) -> str:
    """The text of a refusal: exit ``code``, one ``error:`` line, no traceback."""
    text = _line(result)
    assert result.exit_code == code, result.output
    assert text.startswith("error: ") and text.count("error:") == 1, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, (AttributeError, OSError))
    return text


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` (links not followed) with a file's bytes or a link's target."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            rel = str(p.relative_to(root))
            out[rel] = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


# -- env remove / create: a known environment's folder directly under envs/, nothing else ---------------------
@pytest.fixture
def home(tmp_path, monkeypatch):
    """A HARNESS_HOME deep in tmp_path, a victim folder beside it, an environment and a link in envs/."""
    home = tmp_path / "a" / "b" / "home"
    monkeypatch.setenv("HARNESS_HOME", str(home))
    (home / "envs" / "numpy@1.26.4").mkdir(parents=True)
    (home / "envs" / "numpy@1.26.4" / environments.MARKER).write_text(json.dumps({"name": "numpy@1.26.4"}))
    victim = tmp_path / "victim"
    (victim / "inner").mkdir(parents=True)
    (victim / "inner" / "data.txt").write_text("keep me")
    (home / "envs" / "linked").symlink_to(victim)
    (home / "envs" / "victim").mkdir()  # a folder of the absolute path's name under envs/
    (home / "cache" / "envs").mkdir(parents=True)
    (home / "cache" / "envs" / "numpy@1.26.4").symlink_to(victim)  # a cache that is a link: the link goes
    return home


@pytest.mark.parametrize("command", ["remove", "create"])
@pytest.mark.parametrize("name", ["./../../../victim", "../../../victim", "", ".", "..", "ABS", "linked",
                                  "numpy@1.26.4/../../../../victim", "envs/../.."])
def test_env_commands_refuse_anything_but_a_known_environment_and_touch_nothing(home, tmp_path, command, name):
    name = str(tmp_path / "victim") if name == "ABS" else name
    before = _tree(tmp_path)
    result = CliRunner().invoke(app, ["env", command, name])
    _one_error(result)
    assert _tree(tmp_path) == before  # the victim, its neighbours and the home itself: untouched


def test_env_remove_takes_a_known_environment_and_only_the_link_of_its_cache(home, tmp_path):
    victim = _tree(tmp_path / "victim")
    result = CliRunner().invoke(app, ["env", "remove", "numpy:wildml@01.26.4"])  # a backend name, pins normalised
    assert result.exit_code == 0, result.output
    assert "removed environment numpy@1.26.4" in _line(result)
    assert not (home / "envs" / "numpy@1.26.4").exists()
    assert not (home / "cache" / "envs" / "numpy@1.26.4").is_symlink()
    assert _tree(tmp_path / "victim") == victim
    again = CliRunner().invoke(app, ["env", "remove", "numpy@1.26.4"])
    assert "does not exist" in _one_error(again)


# -- a damaged environment marker: its backends unavailable with the reason, the run goes on --------------------
@pytest.mark.parametrize("marker", ['["x"]', "{broken", '{"packages": ["numpy"]}'])
def test_a_damaged_environment_marker_makes_its_backends_unavailable_and_the_run_goes_on(tmp_path, monkeypatch, marker):
    monkeypatch.setenv("HARNESS_HOME", str(tmp_path / "home"))
    folder = environments.env_dir("numpy@1.26.4")
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)
    (folder / environments.MARKER).write_text(marker)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(BASE.replace("backends: [ref]", "backends: [numpy]").replace("batch: [1, 2]", "batch: [1]"))
    result = CliRunner().invoke(app, ["run", str(cfg), "--backends", "numpy,numpy@1.26.4", "--out",
                                      str(tmp_path / "run"), "--no-plots"])
    assert result.exit_code == 0, result.output
    run = load_run(tmp_path / "run")
    assert run.meta["finished"] and not run.meta["interrupted"]
    status = dict(zip(run.timings["backend"] + "@" + run.timings["pins"].fillna(""), run.timings["status"]))
    assert status == {"numpy@": "ok", "numpy@1.26.4": "unavailable"}
    why = run.timings.loc[run.timings["pins"].notna(), "error"].iloc[0]
    assert "environment 'numpy@1.26.4' is damaged (harness-env.json: " in why
    assert "`harness env create numpy@1.26.4` rebuilds it" in why
    with pytest.raises(HarnessError, match="is damaged"):
        envs.ensure_env("numpy@1.26.4")  # never rebuilt behind the user's back
    assert (folder / environments.MARKER).read_text() == marker
    listed = CliRunner().invoke(app, ["env", "list"], env={"COLUMNS": "300"})
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if "numpy@1.26.4" in line)
    assert "damaged" in row


# -- versions: PEP 440, normalised before they name an environment, bounded ----------------------------------
@pytest.mark.parametrize("name, canonical", [
    ("numpy@01.26.4", "numpy@1.26.4"),
    ("numpy@1.26.4", "numpy@1.26.4"),
    ("jax@0.4.38+JAXLIB@v0.4.038", "jax@0.4.38+jaxlib@0.4.38"),
    ("torch@2.5.1+CPU", "torch@2.5.1+cpu"),
    ("jax@0.5.0-RC.1", "jax@0.5.0rc1"),
    ("numpy@1.26.4-1", "numpy@1.26.4.post1"),
])
def test_versions_are_normalised_before_they_name_an_environment(name, canonical):
    assert backends.validate_name(name) == canonical
    assert backends.environment_of(name) == canonical
    assert envs.environment_name(name) == canonical


@pytest.mark.parametrize("version, says", [
    ("1" * 301, "of at most 64 characters, got 301 characters"),
    ("1." * 50_000 + "1", "of at most 64 characters, got 100001 characters"),
    ("1.26.x", "expected one exact version after 'numpy@' (like 1.26.4, PEP 440), got '1.26.x'"),
    ("1.26.4..", "PEP 440"),
])
def test_a_version_that_is_not_pep_440_or_too_long_is_one_short_line(tmp_path, monkeypatch, version, says):
    monkeypatch.setenv("HARNESS_HOME", str(tmp_path / "home"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(BASE.replace("backends: [ref]", "backends: [numpy]"))
    result = CliRunner().invoke(app, ["run", str(cfg), "--backends", f"numpy,numpy@{version}", "--out",
                                      str(tmp_path / "run")])
    text = _one_error(result)
    assert says in text and len(text) < 400, text
    assert not (tmp_path / "run").exists()
    created = CliRunner().invoke(app, ["env", "create", f"numpy@{version}"])
    assert says in _one_error(created)
    assert not (tmp_path / "home" / "envs").exists() or not list((tmp_path / "home" / "envs").iterdir())


# -- one rule for "this is a run": run.json, its tables there, readable and its own ---------------------------
def _finished_run(folder: Path, config: Path):
    cfg = load_config(config)
    meta = new_run_meta(cfg)
    meta["config_fingerprint"] = config_fingerprint(cfg)
    store = RunStore.create(folder, meta)
    runner = Runner(cfg, store)
    runner.gemm_peaks = {"float32|threads=1": 1.0}
    runner.run()
    finish_meta(store)
    return folder


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A finished run of BASE and one of another config (other cell ids), made once for the module."""
    tests = str(Path(__file__).resolve().parent)
    base = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_BACKENDS", "ref=fake_backends:RefBackend,bad=fake_backends:BadBackend")
        mp.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
        mp.syspath_prepend(tests)
        (base / "t.yaml").write_text(BASE)
        (base / "other.yaml").write_text(BASE.replace("hidden: 8", "hidden: 12"))
        yield _finished_run(base / "good", base / "t.yaml"), _finished_run(base / "other", base / "other.yaml")


def _damage(good: Path, other: Path, dst: Path, how: str) -> Path:
    shutil.copytree(good, dst, ignore=shutil.ignore_patterns(".lock"))
    t = dst / "timings.parquet"
    if how == "no timings":
        t.unlink()
    elif how == "no curves":
        (dst / "curves.parquet").unlink()
    elif how == "empty timings":
        pd.read_parquet(t).iloc[:0].to_parquet(t)
    elif how == "zero-byte timings":
        t.write_bytes(b"")
    elif how == "another run's timings":
        shutil.copy(other / "timings.parquet", t)
    elif how == "a row twice":
        df = pd.read_parquet(t)
        pd.concat([df, df.iloc[:1]]).to_parquet(t)
    return dst


DAMAGES = {"no timings": "timings.parquet: missing", "no curves": "curves.parquet: missing",
           "empty timings": "timings.parquet: no row for 2 of the 2 cells run.json records (an empty table)",
           "zero-byte timings": "timings.parquet: ", "another run's timings": "timings.parquet: 2 row(s) of cells run.json does not record (another run's table?)",
           "a row twice": "timings.parquet: 1 cell(s) with more than one row"}


@pytest.mark.parametrize("how", DAMAGES)
def test_every_reader_of_runs_calls_a_run_without_its_own_tables_damaged(fake_backends, two_runs, tmp_path, how):
    good, other = two_runs
    bad = _damage(good, other, tmp_path / "examples" / "bad", how)
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- table: speedups bad -->\n| problem | ref |\n|---|---|\n| measured | 1 (1 ms) |\n"
                    "<!-- /table -->\n")
    before = page.read_bytes()
    says = f"error: {bad}: damaged ({DAMAGES[how]}"
    commands = {
        "compare": ["compare", str(good), str(bad)],
        "report": ["report", str(bad)],
        "multi-run report": ["report", str(good), str(bad), "--out", str(tmp_path / "multi")],
        "plot": ["plot", str(bad)],
        "export": ["export", str(bad), "--out", str(tmp_path / "x.json")],
        "docs": ["docs", "--page", str(page), "--examples", str(tmp_path / "examples")],
        "docs --check": ["docs", "--check", "--page", str(page), "--examples", str(tmp_path / "examples")],
        "--resume": ["run", str(good.parent / "t.yaml"), "--resume", str(bad)],
    }
    for name, args in commands.items():
        result = CliRunner().invoke(app, args)
        assert says in _one_error(result), (name, result.output)
    assert page.read_bytes() == before  # never rewritten from a damaged run
    assert not (tmp_path / "multi").exists() and not (tmp_path / "x.json").exists()
    with pytest.raises(HarnessError, match=r"damaged \("):
        load_run(bad)


def test_a_run_with_its_own_tables_is_one_for_every_reader(fake_backends, two_runs, tmp_path):
    good, other = two_runs
    # read and compared: 3 where this machine was busy while the run was timed (its cells contended or unsteady)
    assert CliRunner().invoke(app, ["compare", str(good), str(good)]).exit_code in (0, 3)
    result = CliRunner().invoke(app, ["report", str(good), str(other), "--out", str(tmp_path / "multi")])
    assert result.exit_code == 0, result.output
    assert "| `t-" in (tmp_path / "multi" / "report.md").read_text()


def test_reproduce_takes_a_run_as_done_only_when_it_is_the_experiment_s(fake_backends, two_runs, tmp_path):
    from harness import reproduce as R

    good, other = two_runs
    cfg = load_config(good.parent / "t.yaml")
    exp = R.Experiment(good.parent / "t.yaml", None, cells=2, devices=frozenset({"cpu"}),
                       fingerprint=config_fingerprint(cfg))
    out = tmp_path / "out"

    def decide():
        return R.plan(R.MachineFacts(2), out, tmp_path / "none", exps=[exp], env_exists=lambda n: True,
                      read_run=lambda folder: read_folder(folder)[0])[0]

    shutil.copytree(good, out / "t")
    assert decide().state == "done"
    shutil.rmtree(out / "t")
    shutil.copytree(other, out / "t")  # another config's finished run, copied in
    d = decide()
    assert d.state == "foreign" and not d.runs
    assert f"{out / 't'} holds a run of another config (fingerprint " in d.why and "not of " in d.why
    assert "done" not in d.why
    shutil.rmtree(out / "t")
    _damage(good, other, out / "t", "no timings")
    with pytest.raises(HarnessError, match=rf"{out / 't'}: damaged \(timings.parquet: missing\)"):
        decide()
    # the command, over the shipped experiments: another config's run in OUT/sobel is not sobel's
    shutil.copytree(other, out / "sobel")
    result = CliRunner().invoke(app, ["reproduce", "--only", "sobel", "--out", str(out), "--dry-run"])
    assert result.exit_code == 0, result.output
    line = next(l for l in _line(result).split("configs/")[1:] if l.startswith("sobel.yaml"))
    assert f"skipped: {out / 'sobel'} holds a run of another config (fingerprint " in line and "done" not in line
    shutil.rmtree(out / "sobel")
    _damage(good, other, out / "sobel", "empty timings")
    result = CliRunner().invoke(app, ["reproduce", "--only", "sobel", "--out", str(out), "--dry-run"])
    assert f"error: {out / 'sobel'}: damaged (timings.parquet: no row for 2" in _one_error(result)


# -- a multi-run report names each run once ---------------------------------------------------------------
def test_a_multi_run_report_refuses_a_run_named_twice(fake_backends, two_runs, tmp_path):
    good, other = two_runs
    shutil.copytree(good, tmp_path / "copy", ignore=shutil.ignore_patterns(".lock"))
    for args, says in (([good, good], "the same folder as"), ([good, Path(f"{good}/"), other], "the same folder as"),
                       ([good, tmp_path / "copy"], "the same run (t-")):
        result = CliRunner().invoke(app, ["report", *map(str, args), "--out", str(tmp_path / "multi")])
        text = _one_error(result)
        assert says in text and "named twice; expected each run once" in text
        assert not (tmp_path / "multi").exists()


# -- every --out: a folder (or file) it can write, said the same way by every command ------------------------
@pytest.mark.parametrize("target, says", [("FILE", "--out {out}: expected a folder, got a file"),
                                          ("FILE/sub", "--out {out}: {file} is a file, not a folder")])
@pytest.mark.parametrize("command", ["run", "reproduce", "report", "import"])
def test_every_out_folder_is_checked_before_anything_is_written(fake_backends, two_runs, tmp_path, command, target, says):
    good, other = two_runs
    file = tmp_path / "FILE"
    file.write_text("mine")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"benchmarks": [], "datetime": "2026-01-01T00:00:00", "version": "4.0.0"}))
    out = tmp_path / target
    args = {"run": ["run", str(good.parent / "t.yaml")], "reproduce": ["reproduce", "--dry-run"],
            "report": ["report", str(good), str(other)], "import": ["import", str(bench)]}[command]
    result = CliRunner().invoke(app, args + ["--out", str(out)])
    assert _one_error(result) == "error: " + says.format(out=out, file=file)
    assert file.read_text() == "mine"


@pytest.mark.parametrize("target, says", [("folder", "--out {out}: expected a file, got a folder"),
                                          ("FILE/x.json", "--out {out}: {file} is a file, not a folder")])
def test_export_out_is_checked_as_a_file(fake_backends, two_runs, tmp_path, target, says):
    good, _ = two_runs
    (tmp_path / "folder").mkdir()
    file = tmp_path / "FILE"
    file.write_text("mine")
    out = tmp_path / target
    result = CliRunner().invoke(app, ["export", str(good), "--out", str(out)])
    assert _one_error(result) == "error: " + says.format(out=out, file=file)
    assert file.read_text() == "mine"


# -- smaller edges: the budget, keys that apply to no cell, the interrupt hint --------------------------------
@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "0", "-1"])
def test_reproduce_budget_is_finite_and_positive(budget, tmp_path):
    result = CliRunner().invoke(app, ["reproduce", "--budget", budget, "--dry-run", "--out", str(tmp_path / "o")])
    assert "--budget: expected a finite positive number of minutes" in _one_error(result)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text, says", [
    ("model: {kind: elman, hidden: 8, reset_after: true}\n",
     "model.reset_after: applies to kind gru only, and this document's models are elman; expected no reset_after here"),
    ("model: {kind: lstm, hidden: 8, reset_after: true}\n", "model.reset_after: applies to kind gru only"),
    ("model: {kind: gru, hidden: 8, peephole: false}\n", "model.peephole: applies to kind lstm only"),
    ("sweep: {model.reset_after: [true]}\n", "sweep.model.reset_after: applies to kind gru only"),
    ("train: {loss_scale: 512}\n", "train.loss_scale: applies to dtype float16 only (its static loss scale), and "
                                   "this document runs float32; expected no loss_scale here"),
    ("dtype: [float32, bfloat16]\nsweep: {train.loss_scale: [256, 512]}\n", "sweep.train.loss_scale: applies to dtype float16"),
])
def test_a_key_that_applies_to_no_cell_of_its_document_is_refused(fake_backends, tmp_path, text, says):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE.replace("model: {kind: elman, hidden: 8}\n", "" if text.startswith("model") else
                                 "model: {kind: elman, hidden: 8}\n") + text)
    with pytest.raises(HarnessError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {says}" or str(info.value).startswith(f"{path}: {says}")


@pytest.mark.parametrize("text", [
    "model: {kind: gru, hidden: 8, reset_after: false}\n",
    "model: {kind: elman, hidden: 8}\nsweep: {model.kind: [elman, gru]}\n---\nmodel: {reset_after: true}\n",
    "model: {kind: elman, hidden: 8}\ndtype: [float32, float16]\ntrain: {loss_scale: 512}\n",
    "model: {kind: gru, hidden: 8}\n---\nmodel: {kind: elman}\n",  # the first document's default, not a key here
])
def test_keys_that_apply_to_some_cell_are_kept(fake_backends, tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE.replace("model: {kind: elman, hidden: 8}\n", "") + text)
    assert load_config(path).cells()


def test_the_resume_hint_is_the_command_as_given_with_the_options_the_run_needs():
    from harness.run.session import resume_command as _resume_command

    assert _resume_command("../cfg/x.yaml", Path("out/x"), None, None) == "harness run ../cfg/x.yaml --resume out/x"
    assert (_resume_command("my configs/x.yaml", Path("out/x"), "gpu", "numpy,jax")
            == "harness run 'my configs/x.yaml' --profile gpu --backends numpy,jax --resume out/x")


def test_reproduce_gives_its_runs_absolute_paths_so_their_hints_hold_anywhere(tmp_path, monkeypatch):
    from harness import reproduce as R

    monkeypatch.chdir(tmp_path)
    d = R.Decision("threads", "configs/threads.yaml", None, True, "", 1.0, "", 4, state="resume")
    cmd = R.run_command(d, Path("rel/out"))
    assert cmd[cmd.index("run") + 1] == str(R.PROJECT_ROOT / "configs" / "threads.yaml")
    assert cmd[cmd.index("--resume") + 1] == str(tmp_path / "rel" / "out" / "threads")
