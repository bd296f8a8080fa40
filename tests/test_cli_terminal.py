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
    """Every command's --help, --help itself included: a flag shows no value type, an argument that takes
    several values names the type of one."""
    commands = [[]] + [[c.name or c.callback.__name__] for c in app.registered_commands]
    commands += [["env"], ["env", "create"], ["env", "list"]]
    assert ["docs"] in commands and ["run"] in commands
    for command in commands:
        out = CliRunner().invoke(app, command + ["--help"], terminal_width=120).output
        assert "--help" in out, command
        odd = [line for line in out.splitlines() if "<bool>" in line or "<list[" in line]
        assert not odd, (command, odd)
    out = CliRunner().invoke(app, ["run", "--help"], terminal_width=120).output
    assert "configs...      <path>" in out


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


EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "results" / "examples"


def _render(renderables, width=80):
    from rich.console import Console

    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    for r in renderables:
        console.print(r)
    return console.export_text()


def test_the_summary_fits_80_columns_with_every_interval_on_one_line():
    import re

    import pandas as pd

    from harness.results.terminal import summary_tables

    t = pd.read_parquet(EXAMPLES / "quick" / "timings.parquet")
    text = _render(summary_tables(t, {"name": "quick", "baseline": "numpy"}))
    assert max(len(line) for line in text.splitlines()) <= 80
    rows = "\n".join(line for line in text.splitlines() if not line.startswith("fastest"))  # not the answers
    intervals = re.findall(r"\d[\d.]*x \[[\d.]+, [\d.]+\]", rows)
    timed = t[(t["status"] == "ok") & t["speedup_lo"].notna() & (t["speedup_lo"] != t["speedup_hi"])]
    assert len(intervals) == len(timed)
    # groups named as the tables name them (V= for a token input, T= for the sequence)
    assert "train_step elman V=2000 H=100 T=20 B=1 float32" in text


def test_under_pair_over_the_summary_gives_the_paired_speedup_first():
    import pandas as pd

    from harness.results.terminal import summary_tables

    t = pd.read_parquet(EXAMPLES / "mixed_precision" / "timings.parquet")
    text = _render(summary_tables(t, {"name": "mixed_precision", "baseline": "numpy"}))
    head = next(line for line in text.splitlines() if "backend" in line)
    assert head.index("over float32 [95% CI]") < head.index("speedup [95% CI]")
    native = next(line for line in text.splitlines() if line.strip().startswith("native") and "1.9" in line)
    assert "1.9" in native.split("]")[0]  # bfloat16's speedup over float32 comes before the one over numpy


def test_the_progress_line_puts_count_and_time_left_first_and_cuts_the_name_last():
    from rich.console import Console

    from harness.results.terminal import progress

    console = Console(width=80, record=True, force_terminal=True, color_system=None)
    name = "numpy: compiling / warming up · train_step elman V=2000 H=100 T=20 B=16 float32 · pass 1 of 3"
    with progress(console) as bar:
        task = bar.add_task(name, total=24)
        bar.update(task, advance=3)
        shown = bar.make_tasks_table(bar.tasks)
    lines = [line for line in _render([shown]).splitlines() if line.strip()]
    assert lines and all(len(line) <= 80 for line in lines)
    assert lines[-1].lstrip().startswith("3/24") and "eta" in lines[-1]
    assert "numpy: compiling" in lines[-1] and "…" in lines[-1]


def test_without_a_terminal_and_a_store_each_move_of_the_bar_is_a_plain_line():
    from rich.console import Console

    from harness.results.terminal import PlainProgress, progress

    console = Console(width=80, record=True, force_terminal=False, color_system=None)
    bar = progress(console)
    assert isinstance(bar, PlainProgress)
    with bar:
        task = bar.add_task("cells", total=4)
        bar.update(task, description="round 3 (numpy, jax) · train_step elman D=3 H=4 T=4 B=1 float32")
        bar.update(task, advance=2)
        bar.advance(task, 2)
    lines = console.export_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[2/4 ") and lines[1].startswith("[4/4 ")
    assert lines[1].endswith("done: train_step elman D=3 H=4 T=4 B=1 float32")  # the group, not its last phase


def test_without_a_terminal_each_finished_cell_is_a_plain_line_with_its_median_and_speedup(
        fake_backends, write_config, tmp_path):
    from rich.console import Console

    from harness.config import load_config
    from harness.results.store import RunStore
    from harness.results.terminal import group_name, progress
    from harness.run.runner import Runner, finish_meta, new_run_meta

    cfg = load_config(write_config("""
name: plain
seed: 1
model: {kind: elman, hidden: 4}
task: {kind: random, input_size: 3, output_size: 2, seq_len: 4, n_sequences: 8}
workloads: [train_step]
batch: [1, 2]
backends: [ref, 'ref:slow']
baseline: ref
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.01, max_time_s: 0.5, timeout_s: 30, passes: 2}
"""))
    store = RunStore.create(tmp_path / "run", new_run_meta(cfg))
    console = Console(width=80, record=True, force_terminal=False, color_system=None)  # a log file, not a TTY
    runner = Runner(cfg, store, name_group=group_name)
    runner.gemm_peaks = {"float32|threads=1": 1.0}  # not measured: no extra worker
    with progress(console, store) as bar:
        runner.run(bar)
    finish_meta(store)
    lines = [line for line in console.export_text().splitlines() if line.startswith("[")]
    # a line per cell (2 groups x 2 backends), not per pass (8 steps), each once its group is done
    assert len(lines) == 4, lines
    # passes go round the groups: the first group is done after its second pass, at 6 of 8 steps
    assert lines[0].startswith("[6/8 ") and lines[-1].startswith("[8/8 ")
    assert not any("pass" in line for line in lines)
    for batch, (base, slow) in zip((1, 2), (lines[:2], lines[2:])):
        name = f"train_step elman D=3 H=4 T=4 B={batch} float32"  # as the summary tables name the group
        assert base.split("] ", 1)[1].startswith(f"{name} · ref: ") and base.endswith(", 1x (the reference)")
        assert slow.split("] ", 1)[1].startswith(f"{name} · ref:slow: ") and ", speedup " in slow
        assert any(unit in slow.split("ref:slow: ", 1)[1] for unit in ("ms", "µs", " s,"))


def test_a_training_group_is_named_a_training_run_not_a_pass(fake_backends, write_config, run_config):
    from harness.results.terminal import group_name

    config = write_config("""
name: trains
seed: 1
model: {kind: elman, hidden: 4}
task: {kind: random, input_size: 3, output_size: 2, seq_len: 4, n_sequences: 8}
workloads: [train]
batch: [2]
backends: [ref]
train: {epochs: 1, eval_every: 8}
timing: {timeout_s: 30, passes: 3}
""")
    bar = _Bar()
    run_config(config, peaks={"float32|threads=1": 1.0}, progress=bar, name_group=group_name)
    named = [d for d in bar.descriptions if " · " in d]
    assert named and all(d.endswith("train elman D=3 H=4 T=4 B=2 float32 · training run") for d in named), named
    assert not any("pass" in d for d in bar.descriptions)


def test_the_header_counts_what_the_bar_counts(fake_backends, write_config, tmp_path):
    from harness.config import load_config
    from harness.results.terminal import group_name, header
    from harness.run.runner import planned_steps

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
    assert planned_steps(cfg.groups()) == 8
    from types import SimpleNamespace as NS

    trains = [NS(problem=NS(workload="train"), timing=NS(passes=3))] * 3
    assert planned_steps([trains]) == 3  # a training group runs once, whatever its passes: the bar ends where it began
    assert "4 cells x passes = 8 steps" in header(cfg.name, cfg.groups(), tmp_path)
    assert group_name(cfg.groups()[0]) == "train_step elman D=3 H=4 T=4 B=1 float32"


def test_the_runner_names_groups_on_the_bar_as_the_tables_do(fake_backends, write_config, run_config):
    from harness.results.terminal import group_name

    config = write_config("""
name: bar
seed: 1
model: {kind: elman, hidden: 4}
task: {kind: random, input_size: 3, output_size: 2, seq_len: 4, n_sequences: 8}
workloads: [train_step]
batch: [2]
backends: [ref]
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.01, max_time_s: 0.5, timeout_s: 30}
""")
    bar = _Bar()
    run_config(config, progress=bar, name_group=group_name)
    named = [d for d in bar.descriptions if " · " in d]
    assert named and all(d.split(" · ", 1)[1].startswith("train_step elman D=3 H=4 T=4 B=2 float32") for d in named)
