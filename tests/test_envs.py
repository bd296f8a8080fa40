"""Isolated environments: create, find, list, remove, and fail with one clear message."""

import json
import subprocess

import pytest

from harness.run import envs
from harness.spec.errors import HarnessError


@pytest.fixture
def tmp_home(tmp_path, monkeypatch):
    """A private HARNESS_HOME with two throwaway recipes: one that builds, one that cannot."""
    monkeypatch.setenv("HARNESS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(envs, "recipes", lambda: {
        "tiny": envs.Recipe(packages=(), check="import json, sqlite3"),
        # a requirement pip rejects at once, without touching the network
        "broken": envs.Recipe(packages=(str(tmp_path / "no-such-dir" / "missing-0.1-py3-none-any.whl"),)),
    })
    return tmp_path / "home"


class _Lines:
    """Stands in for a rich Console: collects the progress lines."""

    def __init__(self):
        self.lines = []

    def print(self, line, highlight=False, markup=True):
        self.lines.append(line)


def test_create_list_remove(tmp_home):
    assert envs.env_python("tiny") is None
    progress = _Lines()
    py = envs.create_env("tiny", progress=progress)
    assert py == envs.env_dir("tiny") / "bin" / "python" and py.exists()
    assert envs.env_dir("tiny").is_relative_to(tmp_home)
    assert any("creating a virtual environment" in line for line in progress.lines)
    assert all(line.startswith("env tiny: ") for line in progress.lines)
    assert envs.env_python("tiny") == py

    rows = {row["name"]: row for row in envs.list_envs()}
    assert set(rows) == {"tiny", "broken"}
    assert rows["tiny"]["exists"] and rows["tiny"]["path"] == str(envs.env_dir("tiny"))
    assert not rows["broken"]["exists"] and "missing-0.1" in rows["broken"]["packages"]
    assert set(rows["tiny"]) == {"name", "exists", "damaged", "path", "packages"} and rows["tiny"]["damaged"] is None

    marker = json.loads((envs.env_dir("tiny") / envs.MARKER).read_text())
    again = _Lines()
    assert envs.create_env("tiny", progress=again) == py  # reused, not rebuilt
    assert json.loads((envs.env_dir("tiny") / envs.MARKER).read_text()) == marker
    assert "already exists" in again.lines[0]

    envs.remove_env("tiny")
    assert envs.env_python("tiny") is None and not envs.env_dir("tiny").exists()
    assert not {row["name"]: row for row in envs.list_envs()}["tiny"]["exists"]
    with pytest.raises(HarnessError, match="'tiny' does not exist"):
        envs.remove_env("tiny")


def test_worker_environ_runs_the_project_from_source(tmp_home):
    py = envs.ensure_env("tiny")
    code = "import harness.spec.model, harness.run.envs; print(harness.run.envs.home())"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=envs.worker_environ("tiny"),
                         cwd="/", check=True).stdout.strip()
    assert out == str(tmp_home)


def test_an_environment_built_from_an_older_recipe_is_rebuilt(tmp_home):
    envs.create_env("tiny")
    marker_path = envs.env_dir("tiny") / envs.MARKER
    marker = json.loads(marker_path.read_text())
    marker["recipe"] = ["numpy==1.0"]  # as if the recipe's pins had moved on since
    marker_path.write_text(json.dumps(marker))
    progress = _Lines()
    envs.ensure_env("tiny", progress=progress)
    assert any("its recipe changed" in line for line in progress.lines)
    assert json.loads(marker_path.read_text())["recipe"] == []


def test_failed_creation_names_the_environment_and_leaves_nothing(tmp_home):
    with pytest.raises(HarnessError) as info:
        envs.create_env("broken")
    message = str(info.value)
    assert "'broken'" in message and "install" in message
    assert envs.env_python("broken") is None and not envs.env_dir("broken").exists()
    with pytest.raises(HarnessError, match="'broken'"):
        envs.ensure_env("broken")


def test_unknown_environment(tmp_home):
    with pytest.raises(HarnessError, match="no recipe for an isolated environment named 'nope'"):
        envs.ensure_env("nope")
    with pytest.raises(HarnessError, match="'nope'"):
        envs.create_env("nope")


def test_cli_env_commands(tmp_home):
    typer_testing = pytest.importorskip("typer.testing")
    from harness.cli import app

    runner = typer_testing.CliRunner()
    created = runner.invoke(app, ["env", "create", "tiny"])
    assert created.exit_code == 0, created.output
    assert "environment tiny ready" in created.output
    listed = runner.invoke(app, ["env", "list"])
    assert listed.exit_code == 0 and "tiny" in listed.output
    failed = runner.invoke(app, ["env", "create", "broken"])
    assert failed.exit_code == 1 and "broken" in failed.output
    removed = runner.invoke(app, ["env", "remove", "tiny"])
    assert removed.exit_code == 0 and not envs.env_dir("tiny").exists()
