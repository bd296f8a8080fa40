"""The worker protocol: messages round-trip through their JSON form, and replies are framed."""

import io

import pytest

from harness.worker import protocol
from harness.worker.worker import serve


@pytest.mark.parametrize("req", [
    protocol.Init("numpy", {"model": {"kind": "elman"}}, {"kind": "random"}, 3, 0.01),
    protocol.WarmUp(2), protocol.Verify(), protocol.Calibrate(0.05), protocol.Rounds(1, 40),
    protocol.Train(protocol.TrainSettings(2, 50, 3.3, 2, None, False, 7)),
    protocol.Check("theano", "cpu", True, False), protocol.GemmPeak("float32", 256), protocol.Quit(),
])
def test_every_request_round_trips(req):
    assert protocol.decode_request(protocol.encode_request(req)) == req


def test_train_settings_come_from_the_config_without_defaults_of_their_own():
    from harness.config import TrainConfig

    cfg = TrainConfig(epochs=3, patience=4)
    s = protocol.TrainSettings.of(cfg, seed=11)
    assert (s.epochs, s.patience, s.seed) == (3, 4, 11) and not hasattr(s, "lr")  # lr goes once, with init
    assert cfg.patience == 4 and TrainConfig().patience == protocol.TrainSettings.of(TrainConfig(), 0).patience


def test_replies_are_framed_and_other_lines_are_not_replies():
    line = protocol.encode_reply(protocol.Reply("ok", {"inner": 3}, peak_rss_mb=10.0))
    reply = protocol.decode_reply(line)
    assert reply.status == "ok" and reply.body["inner"] == 3 and reply.peak_rss_mb == 10.0
    assert protocol.decode_reply('{"status": "ok", "body": {}}') is None  # unframed JSON is stray output
    assert protocol.decode_reply("hello") is None
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_reply(protocol.REPLY_PREFIX + "{broken")
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_request('{"cmd": "dance"}')


def test_the_server_answers_errors_and_stays_alive():
    inp = io.StringIO("\n".join([protocol.encode_request(protocol.Rounds(1, 1)), '{"cmd": "dance"}',
                                 protocol.encode_request(protocol.GemmPeak("float32", 64)),
                                 protocol.encode_request(protocol.Quit()),
                                 protocol.encode_request(protocol.Verify())]) + "\n")
    out = io.StringIO()
    serve(inp, out)
    replies = [protocol.decode_reply(line) for line in out.getvalue().splitlines()]
    assert [r.status for r in replies] == ["error", "error", "ok", "ok"]  # nothing answered after quit
    assert "before init" in replies[0].error and "not a request" in replies[1].error
    assert replies[2].body["gflops"] > 0 and all(r.peak_rss_mb > 0 for r in replies)


def test_each_document_of_a_config_brings_its_own_seed(write_config):
    from harness.config import load_config

    path = write_config("name: two\nseed: 4\nmodel: {kind: elman, hidden: 4}\ntask: {kind: random, vocab: 5, seq_len: 3}\n"
                        "backends: [numpy]\n---\nseed: 9\nbatch: [2]\n")
    cells = load_config(path).cells()
    assert [(c.problem.batch, c.seed) for c in cells] == [(1, 4), (2, 9)]
    assert cells[0].timing.min_rounds == cells[1].timing.min_rounds and cells[0].train.patience == 2


def test_check_of_an_isolated_backend_runs_in_a_worker(fake_backends, monkeypatch):
    import io
    import sys
    from pathlib import Path

    from rich.console import Console

    from harness.run import conformance
    from harness.run import envs
    from harness.verify.check import representative_cases

    monkeypatch.setattr(envs, "ensure_env", lambda name, progress=None: Path(sys.executable))
    cases = representative_cases()
    out = io.StringIO()
    results = conformance._check_isolated("ref", cases, quick=False, device="cpu",
                                          representative=True, progress=Console(file=out, width=200))
    assert len(results) == len(cases)
    assert {r.status for r in results} == {"pass"} and all(r.backend == "ref" for r in results)
    lines = out.getvalue().splitlines()  # one progress line per case, as each finishes
    assert [ln.split("]")[0].strip() for ln in lines] == [f"[{i}/{len(cases)}" for i in range(1, len(cases) + 1)]
    assert all(c.label in ln and " pass " in ln for c, ln in zip(cases, lines))
    monkeypatch.setattr(conformance, "CASE_TIMEOUT_S", 1e-4)  # a case that outlives its time is stopped
    (late,) = conformance._check_isolated("ref", cases, quick=False, device="cpu",
                                          representative=True)
    assert late.status == "error" and "timeout" in late.reason and late.case == cases[0].label


def test_check_prints_a_line_per_case(fake_backends):
    import io

    from rich.console import Console

    from harness.verify.check import representative_cases
    from harness.run.conformance import run_conformance

    out = io.StringIO()
    results = run_conformance(["ref"], representative=True, progress=Console(file=out, width=200))
    n = len(representative_cases())
    lines = out.getvalue().splitlines()
    assert lines[0] == f"checking ref ({n} cases) ..."
    assert len(lines) == n + 1 and lines[-1].startswith(f"  [{n}/{n}] pass") and len(results) == n


def test_a_request_interrupted_before_its_reply_is_not_answered_by_the_next_one(monkeypatch):
    """Ctrl-C (or SIGTERM, which a run treats as Ctrl-C) between a request and its reply: closing the
    worker must not read that reply as the answer to its quit (a stopped run then lost its record)."""
    import os

    from harness.run import client

    worker = client.WorkerProcess(None, dict(os.environ), "interrupted")
    real_select = client.select.select

    def interrupted(*args):
        monkeypatch.setattr(client.select, "select", real_select)
        raise KeyboardInterrupt

    monkeypatch.setattr(client.select, "select", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.request(protocol.GemmPeak("float64", 8), 60)
    assert worker.in_flight
    worker.close()  # no error: the worker is killed, not asked
    assert worker.proc.poll() is not None and worker not in client.live_workers()


def test_a_reply_whose_body_does_not_fit_its_request_is_a_protocol_error():
    reply = protocol.Reply("ok", {"samples": [1.0]})
    with pytest.raises(protocol.ProtocolError, match="'quit'"):
        protocol.typed(protocol.Quit(), reply)


def test_threads_reach_the_worker_by_its_environment_alone():
    import dataclasses

    from harness.run.client import worker_settings
    from harness.spec.environments import THREAD_VARS, worker_threads

    _, env = worker_settings("numpy", "cpu", "float32", 3, {})
    assert worker_threads(env) == 3 and all(env[v] == "3" for v in THREAD_VARS)
    assert worker_threads({}) == 1
    assert all("threads" not in {f.name for f in dataclasses.fields(r)} for r in (protocol.Init, protocol.GemmPeak))
