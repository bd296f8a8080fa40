"""The calibration benchmark's arithmetic (benchmarks/calibration.py): coverage, width against the
run-to-run spread, and the machine's steadiness between runs, on made-up runs."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration.py"


@pytest.fixture(scope="module")
def calibration():
    spec = importlib.util.spec_from_file_location("calibration_benchmark", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs(points, half):
    return [(p, p * (1 - half), p * (1 + half), None, None) for p in points]


def test_an_interval_that_misses_the_other_runs_median_is_counted_and_width_is_set_against_the_spread(calibration):
    cells = {"a": {"label": "x · g", "aa": False, "runs": _runs([1.00, 1.005, 0.995, 1.10], 0.02)}}
    _, overall = calibration.table(cells, 4)
    # the fourth run's +-2% interval about 1.10 misses the others' median 1.00; the other three hold theirs
    assert overall["held"] == 0.75
    spread = 1.959964 * np.std(np.log([1.00, 1.005, 0.995, 1.10]), ddof=1)
    assert overall["median_width_over_needs"] == pytest.approx(np.log(1.02 / 0.98) / 2 / spread, rel=1e-6)


def test_a_machine_whose_cells_move_between_runs_is_said_to_have_moved(calibration):
    steady_line, steady = calibration.steadiness({"numpy · g": [1.00, 1.01, 1.02, 1.00],
                                                  "native · g": [0.50, 0.505, 0.50, 0.502]})
    assert steady["steady"] and "held steady" in steady_line
    assert steady["median_time_spread"] == pytest.approx(0.02 / 2 + 0.01 / 2, rel=1e-6)
    moved_line, moved = calibration.steadiness({"numpy · g": [1.00, 1.30, 1.02, 1.00],
                                                "native · g": [0.50, 0.60, 0.50, 0.52]})
    assert not moved["steady"] and moved["max_spread_cell"] == "numpy · g"
    assert "moved between the runs" in moved_line and "30.0%" in moved_line


def test_one_run_says_nothing_of_steadiness(calibration):
    assert calibration.steadiness({"numpy · g": [1.0]}) == ("", {})


# -- its command line: inputs refused as the CLI refuses them, outputs by the one write rule -----------------
ROOT = _PATH.parents[1]
QUICK = ROOT / "results" / "examples" / "quick"


def _refused(calibration, capsys, argv) -> str:
    assert calibration.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_runs(calibration, monkeypatch):
    monkeypatch.setattr(calibration.subprocess, "run", lambda *a, **k: pytest.fail("no harness run for a refused call"))


@pytest.mark.parametrize("argv, says", [(["--runs", "."], "--runs: expected at least 2 runs"),
                                        (["quick", "--out", "OUT", "-k", "0"], "-k: expected at least 2 runs"),
                                        (["quick", "--out", "OUT", "-k", "-3"], "got -3"),
                                        (["nope-config", "--out", "OUT"], "nope-config: no such config file")])
def test_bad_inputs_are_one_error_line(calibration, capsys, no_runs, tmp_path, argv, says):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert says in _refused(calibration, capsys, argv)
    assert not (tmp_path / "out").exists()


def test_runs_that_are_no_runs_or_one_run_are_refused(calibration, capsys, tmp_path):
    (tmp_path / "plain").mkdir()
    said = _refused(calibration, capsys, ["--runs", str(tmp_path / "plain"), str(QUICK)])
    assert f"--runs {tmp_path / 'plain'}: not a run folder" in said
    assert "expected at least 2 runs" in _refused(calibration, capsys, ["--runs", str(QUICK)])


@pytest.mark.parametrize("aa", [False, True])
def test_out_among_the_project_s_own_files_is_refused_and_nothing_is_written(calibration, capsys, no_runs, aa):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (ROOT / "configs").iterdir())
    said = _refused(calibration, capsys, ["quick", "--out", str(ROOT / "configs"), "-k", "2"] + (["--aa"] if aa else []))
    assert "among the project's own files" in said
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (ROOT / "configs").iterdir()) == before


@pytest.mark.parametrize("link", ["calibration.md", "quick.yaml"])
def test_a_link_where_it_would_write_is_refused_before_any_run(calibration, capsys, no_runs, tmp_path, link):
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not the benchmark's")
    (out / link).symlink_to(elsewhere)
    said = _refused(calibration, capsys, ["quick", "--out", str(out), "-k", "2", "--aa"])
    assert "symbolic link" in said and elsewhere.read_text() == "not the benchmark's"


def test_a_relative_config_and_out_mean_the_caller_s_folder(calibration, capsys, tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text((ROOT / "configs" / "quick.yaml").read_text())
    calls = []

    def run(cmd, **kw):  # harness run, as far as the benchmark sees it: a run in --out
        calls.append((cmd, kw))
        assert "cwd" not in kw and Path(cmd[cmd.index("run") + 1]).is_file()
        shutil.copytree(QUICK, cmd[cmd.index("--out") + 1])
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(calibration.subprocess, "run", run)
    assert calibration.main(["mine.yaml", "--out", "cal", "-k", "2", "--aa"]) == 0
    assert [c[0][c[0].index("run") + 1] for c in calls] == [str(Path("cal") / "mine.yaml")] * 2
    assert "baseline_twice: true" in (tmp_path / "cal" / "mine.yaml").read_text()
    assert (tmp_path / "cal" / "calibration.md").is_file() and (tmp_path / "cal" / "calibration.json").is_file()
