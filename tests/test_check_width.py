"""`harness check`'s progress lines stay within the terminal: one line per case, broken between words where
the window is narrower than the line, never run past its edge."""

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from harness import cli


@pytest.mark.parametrize("columns", [80, 60])
def test_the_progress_lines_of_a_quick_check_fit_the_window(monkeypatch, columns):
    seen = io.StringIO()
    monkeypatch.setattr(cli, "err_console", Console(file=seen, width=columns))
    result = CliRunner().invoke(cli.app, ["check", "--backends", "numpy", "--quick", "--match", "gru"])
    assert result.exit_code == 0, result.output + seen.getvalue()
    progress = seen.getvalue().splitlines()
    assert any("[1/" in line for line in progress), progress  # a line per case
    assert all(len(line) <= columns for line in progress), [line for line in progress if len(line) > columns]
