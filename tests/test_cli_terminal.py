"""The terminal: `harness list` (one line per backend, a reason shared by several backends printed once, the
devices of this machine only) and a typo in a command-line option blamed on the option, with a suggestion."""

from typer.testing import CliRunner

from harness.cli import app


def test_a_shared_reason_is_printed_once_and_absent_devices_are_not_listed(monkeypatch):
    import backends
    import harness.run.machine as machine

    why = "unavailable: no NVIDIA GPU here (a long explanation that would otherwise be repeated)"
    rows = [backends.Listing("cuda", v, "cuda", False, why, ("gpu", "cpu"), None) for v in ("graph", "naive", "fused")]
    rows.append(backends.Listing("numpy", "default", "numpy", True, "", ("cpu",), None))
    monkeypatch.setattr(backends, "list_backends", lambda: rows)
    monkeypatch.setattr(machine, "gpu_info", lambda: [])
    out = CliRunner().invoke(app, ["list"], terminal_width=200).output
    assert out.count("a long explanation") == 1 and out.count("as cuda") == 2
    assert "gpu" not in out.replace("no GPU here", "") and "no GPU here" in out
    monkeypatch.setattr(machine, "gpu_info", lambda: ["NVIDIA H100, 580.1, 81559 MiB"])
    out = CliRunner().invoke(app, ["list"], terminal_width=200).output
    assert "gpu,cpu" in out


def test_a_backend_typo_on_the_command_line_is_the_option_s_with_a_suggestion(tmp_path):
    result = CliRunner().invoke(app, ["run", "configs/quick.yaml", "--backends", "numpy,jaxx", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "--backends: unknown backend 'jaxx' (did you mean jax?)" in result.output
    assert "quick.yaml" not in result.output and not (tmp_path / "r").exists()


def test_help_shows_flags_as_flags():
    for command in (["run"], ["check"], ["reproduce"], ["docs"], ["env", "create"]):
        out = CliRunner().invoke(app, command + ["--help"], terminal_width=120).output
        flags = [line for line in out.splitlines() if "<bool>" in line and "--help" not in line]  # typer's own
        assert not flags, (command, flags)


class _Bar:
    """A progress bar that records what the runner tells it."""

    def __init__(self):
        self.total, self.completed, self.moves, self.descriptions = 0, 0, [], []

    def add_task(self, name, total):
        self.total = total
        return 0

    def update(self, task_id, total=None, advance=0, description=None):
        if total is not None:
            self.total = total
        if description is not None:
            self.descriptions.append(description)
        if advance:
            self.advance(task_id, advance)

    def advance(self, task_id, n):
        self.completed += n
        self.moves.append(self.completed)


def test_the_bar_moves_with_every_pass_and_names_backend_and_phase_first(fake_backends, write_config, tmp_path):
    import harness
    from harness.results.store import RunStore
    from harness.config import load_config
    from harness.run.runner import Runner, finish_meta, new_run_meta

    cfg = load_config(write_config("""
name: bar
seed: 1
model: {kind: elman, hidden: 4}
task: {kind: random, input_size: 3, output_size: 2, seq_len: 4, n_sequences: 8}
workloads: [train_step]
batch: [1, 2]
backends: [ref, 'ref:slow']
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.01, max_time_s: 0.5, timeout_s: 30, passes: 2}
"""))
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    bar = _Bar()
    Runner(cfg, store).run(bar)
    finish_meta(store)
    assert bar.total == 8 and bar.completed == 8  # 2 groups x 2 cells x 2 passes
    assert bar.moves == [2, 4, 6, 8]  # each pass of each group, not each group at its end
    assert all(d.startswith(("ref", "round")) for d in bar.descriptions), bar.descriptions[:5]
    assert len(harness.load_run(tmp_path / "run").timings) == 4
