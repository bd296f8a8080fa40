"""The example backend against the harness's reference, through the public conformance helper."""

import pytest

from harness.testing import ConformanceError, check_backend, check_case, conformance_cases


def test_whole_matrix():
    """Every case of `harness check`'s matrix; the LSTM, stacked and truncated cases are unsupported."""
    results = check_backend("example")
    statuses = {r.status for r in results}
    assert statuses == {"pass", "unsupported"}, statuses


@pytest.mark.parametrize("case", [c for c in conformance_cases(quick=True) if "realistic" not in c.label][:6], ids=str)
def test_one_case_at_a_time(case):
    check_case("example", case)


def test_a_wrong_update_is_caught(monkeypatch):
    """The helper fails loudly when the backend is wrong (here: the learning rate doubled)."""
    from rnn_harness_plugin_example.backend import ExampleElmanBackend

    step = ExampleElmanBackend.sgd_step
    monkeypatch.setattr(ExampleElmanBackend, "sgd_step", lambda self, x, y, lr: step(self, x, y, 2 * lr))
    elman = [c for c in conformance_cases(quick=True) if c.label.startswith("elman")][:2]
    with pytest.raises(ConformanceError, match="after 3 steps|step losses"):
        check_backend("example", cases=elman)
