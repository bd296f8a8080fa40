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
from harness.results.store import RunStore, config_fingerprint, load_run
from harness.run import envs
from harness.run.config import load_config
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
