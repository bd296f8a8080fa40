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
