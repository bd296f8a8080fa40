"""Config validation: every mistake is one line naming the file, the key path and what was expected."""

import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness.config import load_config
from harness.spec.errors import HarnessError

BASE = """
name: t
model: {kind: elman, hidden: 8}
task: {kind: random, vocab: 20, seq_len: 5}
backends: [ref]
"""


def with_keys(patch: str) -> str:
    """BASE with the top-level keys ``patch`` sets replaced (a YAML key may appear once)."""
    keys = {line.split(":", 1)[0] for line in patch.splitlines() if line and not line[0].isspace()}
    kept = [line for line in BASE.splitlines() if line.split(":", 1)[0] not in keys]
    return "\n".join(kept) + "\n" + patch + "\n"


@pytest.mark.parametrize(
    "patch, expected",
    [
        ("model: {kind: elman, hidden: 0}", "model.hidden: expected a positive integer, got 0"),
        ("model: {kind: elman, hidden: -3}", "model.hidden: expected a positive integer, got -3"),
        ("model: {kind: elman, hidden: 8, colour: red}", "model.colour: unknown key; valid keys are"),
        ("model: {kind: rnn, hidden: 8}", "model.kind: expected one of elman, lstm, gru, got 'rnn'"),
        ("model: {kind: gru, hidden: 8, reset_after: 1}", "model.reset_after: expected true or false, got 1"),
        ("model: {kind: lstm, hidden: 8, reset_after: false}", "model.reset_after: reset_after exists only for kind gru"),
        ("model: {kind: gru, activation: relu}", "model.activation: the gru cell has fixed activations"),
        ("model: {kind: gru, bidirectional: true, bptt: {truncated: 4}}",
         "model.bptt: bidirectional layers need bptt full (truncated and tail gradients run along one direction of time), got truncated:4"),
        ("model: {kind: elman, bidirectional: true, bptt: {tail: 3}}", "model.bptt: bidirectional layers need bptt full"),
        ("model: {kind: lstm, bidirectional: yes please}", "model.bidirectional: expected true or false"),
        ("model: {kind: gru, hidden: 8, bidirectional: true}\nsweep: {model.bptt: [full, {truncated: 2}]}",
         "sweep model.bptt={'truncated': 2}: model.bptt: bidirectional layers need bptt full"),
        ("model: {kind: elman, bptt: {truncated: 0}}", "model.bptt.truncated: expected a positive integer, got 0"),
        ("batch: -1", "batch: expected a positive integer or a list of them, got -1"),
        ("batch: [1, 0]", "batch: expected a positive integer or a list of them"),
        ("backends: [nosuch]", "backends[0]: unknown backend 'nosuch'"),
        ("backends: ['ref:fast']", "backends[0]: backend 'ref:fast': unknown variant 'fast'"),
        ("sweep: {model.width: [1, 2]}", "sweep.model.width: no such scalar key to sweep"),
        ("sweep: {optimizer.lr: [1, 2]}", "sweep.optimizer.lr: no such scalar key to sweep"),
        ("sweep: {model.hidden: [4, -1]}", "sweep model.hidden=-1: model.hidden: expected a positive integer, got -1"),
        ("timing: {min_rounds: 1}", "timing.min_rounds:"),
        ("timing: {warmups: 1}", "timing.warmups: unknown key; valid keys are warmup, min_rounds"),
        ("dtype: float8", "dtype: expected one of float32, float64, bfloat16, float16"),
        ("device: tpu", "device: expected cpu or gpu"),
        ("workloads: [backprop]", "workloads[0]:"),
        ("colour: red", "colour: unknown key; valid keys are name, description"),
        ("baseline: jax", "baseline: expected one of the configured backends (ref), got 'jax'"),
        ("task: {kind: lm_markov, seq_len: 5}", "task.vocab: expected a positive integer for task lm_markov"),
        ("task: {kind: sobel, seq_len: 5}", "model.head: task sobel needs mse"),
    ],
)
def test_bad_values_name_file_and_key(fake_backends, write_config, patch, expected):
    path = write_config(with_keys(patch))
    with pytest.raises(HarnessError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: "), msg
    assert expected in msg, msg
    assert "\n" not in msg


def test_gru_and_bidirectional_models_are_accepted(fake_backends, write_config):
    text = with_keys("model: {kind: gru, hidden: 8, reset_after: false, bidirectional: true, layers: 2}")
    (cell,) = load_config(write_config(text)).cells()
    m = cell.problem.model
    assert (m.kind, m.reset_after, m.bidirectional, m.bptt.mode) == ("gru", False, True, "full")
    assert "reset_before" in m.describe() and "bidirectional" in m.describe()
    assert load_config(write_config(with_keys("model: {kind: gru}"))).cells()[0].problem.model.reset_after


def test_cli_reports_bad_config_with_exit_2_and_no_traceback(fake_backends, write_config):
    path = write_config(with_keys("model: {kind: elman, hidden: -3}"))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2
    out = result.output
    assert f"{path}: model.hidden: expected a positive integer, got -3" in " ".join(out.split())
    assert "Traceback" not in out


def test_missing_file_and_bad_yaml(write_config, tmp_path):
    with pytest.raises(HarnessError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(HarnessError, match="not valid YAML"):
        load_config(write_config("name: [unclosed\n"))


def test_sweep_expands_into_groups_with_baseline_first(fake_backends, write_config):
    cfg = load_config(write_config(BASE.replace("[ref]", "['ref:slow', ref]") + "baseline: ref\nbatch: [1, 2]\nsweep: {model.hidden: [4, 8, 16]}\n"))
    cells = cfg.cells()
    assert len(cells) == 3 * 2 * 2
    assert [c.problem.model.hidden for c in cells[::4]] == [4, 8, 16]
    assert cells[0].backend == "ref" and cells[1].backend == "ref:slow"
    assert cells[0].group_key == cells[1].group_key != cells[2].group_key


def test_later_documents_merge_over_the_first(fake_backends, write_config):
    text = BASE + "batch: [1, 2]\n---\nworkloads: [train]\nbatch: [4]\nmodel: {hidden: 16}\ntask: {n_eval: 8}\n"
    cfg = load_config(write_config(text))
    cells = cfg.cells()
    assert [(c.problem.workload, c.problem.batch, c.problem.model.hidden) for c in cells] == [
        ("train_step", 1, 8), ("train_step", 2, 8), ("train", 4, 16)]
    assert cells[2].task.n_eval == 8 and cells[2].task.vocab == 20  # merged, not replaced


def test_a_later_documents_bptt_replaces_the_first_ones(fake_backends, write_config):
    first = BASE.replace("hidden: 8}", "hidden: 8, bptt: {truncated: 4}}")
    text = first + "---\nmodel: {bptt: {tail: 3}}\n---\nmodel: {bptt: full}\n"
    modes = [(c.problem.model.bptt.mode, c.problem.model.bptt.k) for c in load_config(write_config(text)).cells()]
    assert modes == [("truncated", 4), ("tail", 3), ("full", None)]


def test_error_in_a_later_document_names_it(fake_backends, write_config):
    with pytest.raises(HarnessError, match=r"document 2: model.hidden: expected a positive integer, got 0"):
        load_config(write_config(BASE + "---\nmodel: {hidden: 0}\n"))


def test_sweep_may_zip_several_keys_and_is_replaced_by_later_documents(fake_backends, write_config):
    text = with_keys("sweep: {'model.hidden,task.input_size': [[4, 3], [8, 6]]}\ntask: {kind: random, input_size: 2, seq_len: 5}") + "---\nsweep: {model.hidden: [16]}\n"
    cells = load_config(write_config(text)).cells()
    assert [(c.problem.model.hidden, c.problem.input_size) for c in cells] == [(4, 3), (8, 6), (16, 2)]
    with pytest.raises(HarnessError, match="zips them"):
        load_config(write_config(BASE + "sweep: {'model.hidden,task.seq_len': [4, 8]}\n"))


def test_profiles_merge_over_every_document(fake_backends, write_config):
    text = BASE + "profiles: {full: {batch: [1, 2, 3]}}\n---\nworkloads: [forward]\n"
    assert len(load_config(write_config(text)).cells()) == 2
    assert len(load_config(write_config(text), profile="full").cells()) == 6
    with pytest.raises(HarnessError, match="no profile 'huge' \\(known: full\\)"):
        load_config(write_config(text), profile="huge")


def test_a_sweep_cannot_bypass_the_timing_rules(write_config):
    base = "name: s\nbackends: [numpy]\ntiming: {min_time_s: 1.0, max_time_s: 2.0, passes: 2}\n"
    with pytest.raises(HarnessError, match=r"sweep timing\.max_time_s=0\.5: timing\.max_time_s: expected at least "
                                           r"timing\.min_time_s \(1\.0\), got 0\.5"):
        load_config(write_config(base + "sweep: {timing.max_time_s: [3.0, 0.5]}\n"))
    with pytest.raises(HarnessError, match=r"timing\.max_passes: expected at least timing\.passes \(2\), got 1"):
        load_config(write_config(base + "sweep: {timing.max_passes: [1]}\n"))
    load_config(write_config(base + "sweep: {timing.max_time_s: [1.0, 3.0]}\n"))  # at or above the floor: fine
