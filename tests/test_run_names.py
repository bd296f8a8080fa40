"""`harness run` as a new user types it: a shipped config by its name, a mistyped one with the nearest
shipped names, and the report written beside the plots (``--no-report`` to skip)."""

from pathlib import Path

import pytest

from typer.testing import CliRunner

from harness.cli import app

TINY = """\
name: tiny
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 5, n_sequences: 16, n_eval: 8}
backends: [ref]
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.02, max_time_s: 0.3, timeout_s: 20, verify: false}
"""


def _invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result, " ".join(result.output.split())


def _project(tmp_path, monkeypatch) -> Path:
    """A project whose shipped configs are configs/tiny.yaml and configs/quick.yaml, run from elsewhere."""
    import harness.reproduce

    root = tmp_path / "project"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "tiny.yaml").write_text(TINY)
    (root / "configs" / "quick.yaml").write_text(TINY.replace("name: tiny", "name: quick"))
    monkeypatch.setattr(harness.reproduce, "PROJECT_ROOT", root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return root


@pytest.mark.slow  # a run with workers, plots and a report
def test_a_shipped_config_runs_by_its_name_and_the_run_has_its_report(fake_backends, tmp_path, monkeypatch):
    _project(tmp_path, monkeypatch)
    result, text = _invoke("run", "tiny", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "report.html").stat().st_size > 0 and (tmp_path / "run" / "report.md").exists()
    assert f"report: {tmp_path / 'run' / 'report.html'}" in text and "plot: " in text
    result, _ = _invoke("run", "tiny.yaml", "--out", tmp_path / "bare", "--no-report")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "bare" / "plots" / "plots.json").exists() and not (tmp_path / "bare" / "report.html").exists()


def test_a_missing_config_names_the_nearest_shipped_ones(tmp_path, monkeypatch):
    _project(tmp_path, monkeypatch)
    for given in ("configs/quik.yaml", "quik", "tiney.yaml"):
        result, text = _invoke("run", given)
        assert result.exit_code == 2 and text.startswith(f"error: {given}: no such config file; did you mean"), text
        assert "Traceback" not in result.output
    assert "configs/quick.yaml?" in _invoke("run", "quik")[1] and "configs/tiny.yaml?" in _invoke("run", "tiney")[1]
    _, text = _invoke("run", "nothing/like/it.yaml")
    assert "the shipped configs are quick, tiny" in text


def test_a_folder_of_a_shipped_config_s_name_does_not_hide_it_and_a_long_name_is_one_line(tmp_path, monkeypatch):
    from harness.cli import _config_path

    root = _project(tmp_path, monkeypatch)
    Path("quick").mkdir()  # a folder in the working folder, named like the shipped config
    assert Path(_config_path(Path("quick"))).resolve() == root / "configs" / "quick.yaml"
    result, text = _invoke("run", "a" * 5000)
    assert result.exit_code == 2 and text.startswith("error: aaa") and "(5000 characters)" in text, text
    assert "Traceback" not in result.output and len(text) < 400


@pytest.mark.slow  # two runs with workers, plots and a report
def test_a_run_interrupted_while_drawing_says_so_and_resume_draws_it(fake_backends, tmp_path, monkeypatch):
    import json

    import harness.cli as cli

    _project(tmp_path, monkeypatch)
    real = cli._draw_and_report

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_draw_and_report", interrupted)
    result, text = _invoke("run", "tiny", "--out", tmp_path / "run")
    assert result.exit_code == 130, result.output
    assert "while drawing the plots and report: every cell is saved" in text and "--resume" in text
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["interrupted"] is True and meta["finished"] is None
    monkeypatch.setattr(cli, "_draw_and_report", real)
    result, _ = _invoke("run", "tiny", "--resume", tmp_path / "run")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["interrupted"] is False and meta["finished"] and (tmp_path / "run" / "report.md").exists()
