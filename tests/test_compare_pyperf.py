"""benchmarks/compare_pyperf.py's arithmetic: the order of its turns, the agreement it reads from them, its
verdict and its config (the timed comparison itself is run by hand: it takes minutes)."""

import importlib.util
import math
import statistics
from collections import Counter

import pytest

import harness
from harness.spec.errors import HarnessError


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_pyperf", harness.__file__.replace(
        "harness/__init__.py", "benchmarks/compare_pyperf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_turn_times_each_shape_once_by_each_tool_back_to_back_and_each_tool_goes_first_as_often(compare):
    tools = ["harness", "pyperf harness"]
    order = compare.schedule(3, tools, 8)
    assert len(order) == 3 * 2 * 8
    # a shape's tools follow each other directly, one process each
    pairs = [order[i:i + 2] for i in range(0, len(order), 2)]
    assert all(a[:2] == b[:2] and {a[2], b[2]} == set(tools) for a, b in pairs)
    assert [(t, s) for t, s, _ in order[::2]] == [(t, s) for t in range(8) for s in range(3)]
    # over the turns each tool leads as often as it follows, and the order changes between turns
    firsts = Counter(a[2] for a, _ in pairs)
    assert firsts["harness"] == firsts["pyperf harness"] == 12
    assert [a[2] for a, _ in pairs[::3]] == ["harness", "pyperf harness", "pyperf harness", "harness"] * 2
    # with several pyperf environments every one takes a process in every turn, each first in some turn
    three = compare.schedule(1, ["harness", "pyperf plain", "pyperf harness"], 6)
    assert all(sorted(tool for t, _, tool in three if t == turn) == sorted(["harness", "pyperf plain", "pyperf harness"])
               for turn in range(6))
    assert {three[3 * t][2] for t in range(6)} == {"harness", "pyperf plain", "pyperf harness"}


def test_the_agreement_is_read_within_turns_so_the_machines_drift_between_turns_cancels(compare):
    # the host's speed moves by up to 40% from turn to turn; within a turn the harness is 1% slower
    drift = [1.0, 1.4, 0.8, 1.25, 1.05, 1.3, 0.9, 1.1]
    wobble = [0.99, 1.0, 1.01, 1.0, 0.995]
    pyperf = [[600e-6 * d * w for w in wobble] for d in drift]
    near = [[v * 1.01 for v in turn] for turn in pyperf]
    found = compare.agreement(near, pyperf)
    assert found["ratio"] == pytest.approx(1.01)
    assert found["turn_ratios"] == pytest.approx([1.01] * 8)
    assert found["lo"] <= 1.01 <= found["hi"] and found["within"]
    # a 5% gap is not agreement, however the turns drift
    far = [[v * 1.05 for v in turn] for turn in pyperf]
    assert compare.agreement(far, pyperf)["ratio"] == pytest.approx(1.05)
    assert not compare.agreement(far, pyperf)["within"]
    # the pooled medians are printed beside it: where one tool took more values in the slow turns they
    # mislead, and the turns' ratios do not
    slow, counts = [1.0, 1.4, 1.0, 1.4], [3, 9, 3, 9]
    uneven = compare.agreement([[600e-6 * d * 1.01] * n for d, n in zip(slow, counts)], [[600e-6 * d] * 5 for d in slow])
    assert uneven["ratio"] == pytest.approx(1.01) and uneven["within"]
    assert uneven["pooled"] == pytest.approx(1.4 * 1.01 / 1.2)
    # how far a tool's turns lie apart: the drift the turns' ratios cancel
    assert compare.turn_spread(pyperf) == pytest.approx((1.4 - 0.8) / statistics.median(drift))


def test_the_agreements_interval_needs_three_turns_and_every_turn_needs_both_tools(compare):
    two = compare.agreement([[1.0, 1.1], [2.0]], [[1.0], [2.0, 2.1]])
    assert math.isnan(two["lo"]) and math.isnan(two["hi"])
    assert two["turn_ratios"] == pytest.approx([1.05 / 1.0, 2.0 / 2.05])
    with pytest.raises(HarnessError, match="both tools in every turn"):
        compare.agreement([[1.0], []], [[1.0], [1.0]])
    with pytest.raises(HarnessError, match="both tools in every turn"):
        compare.agreement([[1.0]], [[1.0], [1.0]])


def test_the_verdict_is_agreement_within_two_percent_either_way(compare):
    assert compare.within(1.0) and compare.within(1.02) and compare.within(0.98)
    assert not compare.within(1.021) and not compare.within(0.979)


def test_each_turn_of_the_harness_is_one_process_with_rounds_as_long_as_pyperfs_values(compare, tmp_path):
    for setup in compare.SETUPS:
        path = tmp_path / f"{setup}.yaml"
        path.write_text(compare.config_text(setup, values=7))
        cells = compare.cells(str(path))
        assert len(cells) == 3
        for cell in cells:
            t = cell.timing
            assert t.processes_per_pass == 1 and t.pass_count == 1 and t.min_rounds == 7
            assert t.target_round_s == pytest.approx(compare.VALUE_S)
            assert cell.clean_env == (setup == "clean")
