"""The ``harness`` command line. Library code raises HarnessError; only this module
turns it into ``error: ...`` and an exit code."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.cli_help import HelpGroup
from harness.spec.errors import HarnessError
from harness.spec.model import REDUCED_DTYPES
from harness.spec.status import Status

app = typer.Typer(cls=HelpGroup, add_completion=False, no_args_is_help=True, help="Benchmark one RNN spec across backends.")
env_app = typer.Typer(cls=HelpGroup, no_args_is_help=True, help="Isolated environments: Theano's, and one per set of pinned "
                                                  "versions (jax@0.4.38).")
app.add_typer(env_app, name="env")
def _console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    # piped output (CI logs, files) gets a readable width instead of 80 columns
    return probe if probe.is_terminal else Console(stderr=stderr, width=140)


console = _console()
err_console = _console(stderr=True)


def _split_csv(value: str | None, option: str = "--backends") -> list[str] | None:
    if value is None:
        return None
    parts = [v.strip() for v in value.split(",") if v.strip()]
    if not parts:  # "--backends ," must not quietly mean "every backend"
        raise HarnessError(f"{option}: expected a comma-separated list of names, got {value!r}")
    return parts


def _fail(exc: HarnessError, code: int = 2):
    # messages quote what the user typed (file names, backend names): never read as markup
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command("run")
def run_cmd(
    configs: Annotated[list[Path], typer.Argument(help="One or more YAML configs.")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Results folder (default results/<name>-<time>); with several configs, a parent folder.")] = None,
    backends_opt: Annotated[Optional[str], typer.Option("--backends", help="Comma-separated backends overriding the config's list.")] = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Finish an interrupted run in this folder.")] = None,
    profile: Annotated[Optional[str], typer.Option("--profile", help="Apply a named profile from the config's `profiles:` (e.g. full).")] = None,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Skip drawing plots (and the report, which shows them).", metavar="")] = False,
    no_report: Annotated[bool, typer.Option("--no-report", help="Skip writing report.md and report.html beside the plots.", metavar="")] = False,
    executor_opt: Annotated[str, typer.Option("--executor", help="local (default: one group at a time here), dask (an existing cluster, --scheduler) or dask-local (a local cluster, --workers).")] = "local",
    scheduler: Annotated[Optional[str], typer.Option("--scheduler", help="Address of the Dask scheduler for --executor dask.")] = None,
    workers: Annotated[Optional[int], typer.Option("--workers", help="Worker processes of the --executor dask-local cluster (default 2), each on its own cores.")] = None,
    fail_on: Annotated[Optional[str], typer.Option("--fail-on", help="Comma-separated: exit 4 when a cell ends so: mismatch, failed (error, timeout, oom, diverged, mismatch), contended, unsteady. Default: none (failed cells are results).")] = None,
):
    """Run configs: every cell in fresh workers, results and plots in a folder per config.

    Exit code: 0 when every cell ran (failed cells are results); 2 a bad config;
    4 with --fail-on, when a cell ended as it names (the cells are listed)."""
    from harness.results.standing import FAIL_ON

    try:
        reasons = _split_csv(fail_on, "--fail-on") or []
        unknown = [r for r in reasons if r not in FAIL_ON]
        if unknown:
            raise HarnessError(f"--fail-on: unknown {unknown[0]!r}; expected some of {', '.join(FAIL_ON)}")
    except HarnessError as exc:
        _fail(exc, 2)
    from harness.results.launch import open_runs
    from harness.run.client import kill_all_workers, stop_on_signals

    with stop_on_signals() as stopped:
        try:
            try:
                runs = open_runs([_config_path(c) for c in configs], _backend_names(backends_opt), profile, out,
                                 resume, executor_opt, scheduler, workers)
            except HarnessError as exc:
                _fail(exc, 2)
            with runs:
                if runs.ended_workers:  # reopening an interrupted run whose killed runner left them
                    err_console.print(f"{runs.runs[0][1].path}: {len(runs.ended_workers)} worker(s) of the interrupted "
                                      f"runner were still running (pid {', '.join(map(str, runs.ended_workers))}); "
                                      f"ended them", highlight=False)
                failing = []
                for cfg, store in runs:
                    _run_and_show(cfg, store, runs.executor, stopped, (profile, backends_opt), no_plots, no_report)
                    failing += _failing(store, reasons)
            if failing:
                err_console.print(f"[bold red]--fail-on {','.join(reasons)}:[/] {len(failing)} cell(s)", highlight=False)
                for line in failing:
                    err_console.print(f"  {escape(line)}", highlight=False)
                raise typer.Exit(4)
        except KeyboardInterrupt:  # before any cell ran (loading, creating the folder) or while summarising
            kill_all_workers()
            err_console.print(f"interrupted ({stopped.name})", highlight=False)
            raise typer.Exit(stopped.exit_code)


def _failing(store, reasons: list[str]) -> list[str]:
    """The cells of a finished run that ``--fail-on`` fails it on (none without reasons)."""
    from harness.results.standing import failing

    return failing(store.timings, reasons) if reasons and store.timings else []


def _run_and_show(cfg, store, executor, stopped, resume_options: tuple, no_plots: bool, no_report: bool) -> None:
    """Run one config into its open folder under a progress bar (an interrupt says how to resume it), then
    print its summary and draw its plots and report."""
    from harness.results import terminal
    from harness.run.session import resume_command, run_into

    console.print(terminal.header(cfg.name, cfg.groups(), store.path), highlight=False)
    try:
        with terminal.progress(err_console, store) as progress:
            run_into(cfg, store, progress, executor, console=err_console, name_group=terminal.group_name)
    except KeyboardInterrupt:
        err_console.print(f"interrupted ({stopped.name}): finished cells are saved; continue with "
                          f"`{resume_command(cfg.path, store.path, *resume_options)}`", highlight=False, markup=False)
        raise typer.Exit(stopped.exit_code)
    except HarnessError as exc:
        _fail(exc, 1)
    try:
        _print_summary(store)
        if not no_plots:
            _draw(store.path) if no_report else _draw_and_report(store.path)
    except KeyboardInterrupt:  # every cell is saved, the drawing is not: the run says so, and --resume draws it
        from harness.run.runner import finish_meta

        try:
            finish_meta(store, interrupted=True)
        except HarnessError:
            pass
        err_console.print(f"interrupted ({stopped.name}) while drawing the plots and report: every cell is saved; "
                          f"finish with `{resume_command(cfg.path, store.path, *resume_options)}`",
                          highlight=False, markup=False)
        raise typer.Exit(stopped.exit_code)


def _backend_names(backends_opt: Optional[str]) -> list[str] | None:
    """``--backends`` as names, each a registered backend (with a suggestion for a typo: the option's,
    not the config file's)."""
    import backends

    names = _split_csv(backends_opt)
    for name in names or []:
        try:
            backends.ref(name).backend_class()
        except HarnessError as exc:
            if str(exc).startswith("unknown backend"):
                raise HarnessError(f"--backends: {exc}") from None
    return names


def _config_path(given: Path) -> Path:
    """A config argument as a file: the file itself, else a shipped config's name (``quick`` or ``quick.yaml``:
    ``configs/quick.yaml`` of this project); a name of neither is an error naming the nearest shipped ones."""
    import difflib
    import os

    from harness.reproduce import PROJECT_ROOT
    from harness.spec.writes import _cut

    shipped = {p.stem: p for p in sorted((PROJECT_ROOT / "configs").glob("*.yaml"))}
    stem = given.name.removesuffix(".yaml")
    try:
        there = given.exists()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL in it
        raise HarnessError(f"{_cut(given)}: not a usable path ({getattr(exc, 'strerror', None) or exc}); expected "
                           f"a config file or a shipped config's name") from None
    # a folder of a shipped config's name in the working folder does not hide that config
    if there and not (given.is_dir() and given.parent == Path(".") and stem in shipped):
        return given
    if given.parent == Path(".") and stem in shipped:
        found = shipped[stem]
        return Path(os.path.relpath(found)) if found.is_relative_to(Path.cwd()) else found
    near = difflib.get_close_matches(stem, shipped, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(f'configs/{n}.yaml' for n in near)}?" if near else \
        f"the shipped configs are {', '.join(shipped)}"
    raise HarnessError(f"{_cut(given)}: no such config file; {hint} (`harness run NAME` runs the shipped configs/NAME.yaml)")


def _draw_and_report(path: Path) -> None:
    """The run's plots and its report beside them (writing the report draws the plots)."""
    import json

    from harness.results.plots import MANIFEST
    from harness.results.report import write_report

    try:
        made = write_report(path)
    except Exception as exc:  # plots and report are views of saved results: never lose a run over one
        err_console.print(f"warning: the report failed: {type(exc).__name__}: {exc}", markup=False)
        return
    try:
        drawn = json.loads((path / "plots" / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        drawn = []
    for name in drawn:
        if name.endswith(".png"):
            console.print(f"  plot: {path / 'plots' / name}", highlight=False, markup=False)
    for p in made:
        console.print(f"  report: {p}", highlight=False, markup=False)


def _draw(path: Path):
    from harness.results.plots import make_plots

    try:
        made = make_plots(path)
    except HarnessError:
        raise
    except Exception as exc:  # plots are a view of saved results: never lose a run over one
        err_console.print(f"warning: plotting failed: {type(exc).__name__}: {exc}", markup=False)
        return
    for p in made:
        console.print(f"  plot: {p}", highlight=False, markup=False)


def _print_summary(store):
    from harness.results.labels import backend_label
    from harness.results.report import precision_note, spread_warnings
    from harness.results import caveats
    from harness.results.terminal import MISSED_MARK, print_summary
    import pandas as pd

    df = pd.DataFrame(store.timings)
    if df.empty:
        return
    for line in caveats.lines(store.meta, store.timings):  # what shaped the run, before its figures
        console.print(f"[bold yellow]caveat:[/] {escape(line)}", highlight=False)
    print_summary(df, store.meta, console)
    df["label"] = backend_label(df)
    _print_device_ratios(df)
    note = precision_note(df, MISSED_MARK)
    if note:
        err_console.print(f"[yellow]imprecise:[/] {escape(note)}", highlight=False)
    for w in spread_warnings(store.timings):
        err_console.print(f"[yellow]noisy:[/] {escape(w)}", highlight=False)


def _print_device_ratios(timings):
    """A run with CPU and GPU cells: each backend's GPU speedup over its own CPU time, per batch."""
    from harness.results.devices import gpu_over_cpu
    from harness.results.plots import backend_label, group_label

    ratios = gpu_over_cpu(timings)
    if ratios.empty:
        return
    table = Table(title="GPU over CPU, same backend (CPU median / GPU median; above 1 the GPU is faster)")
    for col in ("backend", "problem", "batch", "CPU", "GPU", "GPU speedup"):
        table.add_column(col, justify="left" if col in ("backend", "problem") else "right")
    for label, (_, r) in zip(backend_label(ratios), ratios.iterrows()):
        problem = f"{r['workload']} {group_label(r, omit=('batch', 'threads', 'device'))}"
        table.add_row(escape(label), escape(problem), str(r["batch"]), f"{r['cpu_median_s'] * 1e3:.3g} ms ({r['cpu_threads']} thr)",
                      f"{r['gpu_median_s'] * 1e3:.3g} ms", f"{r['gpu_speedup']:.3g}x")
    console.print(table)


@app.command("reproduce")
def reproduce_cmd(
    budget: Annotated[Optional[float], typer.Option("--budget", help="Minutes: skip, with the reason, what the time left cannot hold; stop an overrun 10% past it (a second call resumes).")] = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Comma-separated experiments (config names, e.g. quick,sobel, or quick-gpu for a profile).")] = None,
    out: Annotated[Path, typer.Option("--out", help="Folder of the runs, one per experiment (results/examples: the committed ones).")] = Path("results/reproduce"),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan, one line per experiment, and run nothing.", metavar="")] = False,
    archive: Annotated[Optional[Path], typer.Option("--archive", help="Afterwards, the finished run folders in one .tgz, named as results/examples names them (harness unpack FILE; harness docs).")] = None,
):
    """Every experiment of docs/experiments.md that fits this machine, within a budget, resumable."""
    from harness import reproduce

    from harness.results.store import read_folder
    from harness.spec import writes

    try:
        if budget is not None and not (math.isfinite(budget) and budget > 0):  # nan is no limit, not a budget
            raise HarnessError(f"--budget: expected a finite positive number of minutes, got {budget}")
        writes.check_folder(out, "--out")
        if archive is not None:  # a device, a link, a run's file or an unwritable place: refused before any run
            writes.check_file(archive, "--archive")
        machine = reproduce.MachineFacts.here()
        decisions = reproduce.plan(machine, out, Path(reproduce.PROJECT_ROOT) / "results" / "examples",
                                   budget * 60 if budget else None, _split_csv(only, "--only"),
                                   read_run=lambda folder: read_folder(folder)[0])  # the one rule for a run
    except HarnessError as exc:
        _fail(exc, 2)
    runs = [d for d in decisions if d.runs]
    skipped = [d for d in decisions if not d.runs]
    plan = [f"this machine: {machine.describe()}; runs into {out}" + (f"; budget {budget:g} min" if budget else "")]
    plan += [d.line() for d in decisions]
    plan.append(f"in all: {len(runs)} to run, ~{sum(d.estimate_s or 0 for d in runs) / 60:.1f} min; {len(skipped)} "
                f"skipped (~{sum(d.estimate_s or 0 for d in skipped) / 60:.1f} min)")
    for line in (part for text in plan for part in reproduce.fit(text, console.width)):  # within the terminal
        console.print(escape(line), highlight=False, soft_wrap=True)
    if dry_run:
        return
    try:
        outcomes = reproduce.run_plan(decisions, out, machine, budget * 60 if budget else None,
                                      say=lambda m: err_console.print(escape(m), highlight=False, soft_wrap=True))
    except KeyboardInterrupt:
        err_console.print("interrupted: finished experiments and cells are saved; the same command resumes", highlight=False)
        raise typer.Exit(130)
    except HarnessError as exc:
        _fail(exc, 1)
    finally:
        if archive is not None and out.is_dir():
            try:
                kept = reproduce.archive(out, archive, note=lambda line: err_console.print(
                    f"archive: {escape(line)}", highlight=False))
                err_console.print(f"archive: {archive} ({', '.join(kept) or 'no finished run'})", highlight=False)
            except HarnessError as exc:
                _fail(exc, 1)
    for o in outcomes:
        console.print(f"{o.name}: {o.status} in {o.seconds / 60:.1f} min", highlight=False)
    skipped = [d for d in decisions if d.skipped_for_budget]
    if skipped:
        console.print(f"out of budget: {', '.join(d.name for d in skipped)}", highlight=False)
    console.print(f"record: {out / reproduce.RECORD}", highlight=False)
    raise typer.Exit(1 if any(o.status == reproduce.ExperimentStatus.FAILED for o in outcomes) else 0)


@app.command("unpack")
def unpack_cmd(
    archive: Annotated[Path, typer.Argument(help="A .tgz of runs that `harness reproduce --archive` wrote.")],
    into: Annotated[Path, typer.Option("--into", help="The folder the runs go into (it must exist), each where nothing is or over a run folder of its name; never over a folder that is not a run.")] = Path("results/examples"),
):
    """Bring archived runs back: regular files and folders only, no absolute or '..' path, no link; each run checked before it replaces its folder."""
    from harness import reproduce

    try:
        runs = reproduce.unpack(archive, into)
    except HarnessError as exc:
        _fail(exc, 2)
    console.print(escape(f"unpacked into {into}: {', '.join(runs)} (`harness docs` fills the page's tables from them)"),
                  highlight=False)


@app.command("docs")
def docs_cmd(
    check: Annotated[bool, typer.Option("--check", help="Change nothing; exit 1 when a table, a plot or a report differs from what its run gives today, or the config reference from the schema.", metavar="")] = False,
    page: Annotated[Path, typer.Option("--page", help="The page whose marked tables are generated.")] = Path("docs/experiments.md"),
    examples: Annotated[Path, typer.Option("--examples", help="The run folders the tables read.")] = Path("results/examples"),
    configs: Annotated[Optional[Path], typer.Option("--configs", help="The page whose config reference is generated from the config schema (default: the project's docs/configs.md).")] = None,
):
    """Regenerate the measured tables of docs/experiments.md, the stale plots and reports of the runs under results/examples/, and the config reference of docs/configs.md."""
    from harness import docs

    configs = configs or docs.config_page()
    try:
        changed = docs.check_page(page, examples) if check else docs.write_page(page, examples)
        reference = docs.check_config_page(configs) if check else docs.write_config_page(configs)
    except HarnessError as exc:
        _fail(exc, 2)
    if reference:
        console.print(escape(f"{configs}: config reference {'differs from the schema' if check else 'rewritten'}"),
                      highlight=False)
    for spec in changed:
        verb = "differs from its runs" if check else "rewritten"
        console.print(escape(f"{page}:{spec.line}: table '{spec.text}' {verb}"), highlight=False)
    # the plots and reports of the committed runs are outputs of the runs too
    stale = docs.stale_drawings(examples) if check else {run: [] for run in docs.redraw(examples)}
    for run, problems in stale.items():
        for problem in problems or [f"{run}: plots and report redrawn"]:
            console.print(escape(problem), highlight=False)
    if check and (changed or stale or reference):
        what = [f"{len(changed)} table(s) of {page}"] * bool(changed) + [f"the plots or report of {len(stale)} run(s)"] * bool(stale)
        said = [f"{' and '.join(what)} disagree with {examples}"] * bool(what) + \
            [f"the config reference of {configs} differs from the schema"] * reference
        err_console.print(f"[bold red]error:[/] {escape('; '.join(said))}; `harness docs` regenerates them", highlight=False)
        raise typer.Exit(1)
    if not changed:
        console.print(f"{page}: every table agrees with its runs", highlight=False)
    if check:
        console.print(f"{examples}: every run's plots and report are today's", highlight=False)
    if not reference:
        console.print(f"{configs}: the config reference is the schema's", highlight=False)


@app.command("plot")
def plot_cmd(run_dir: Annotated[Path, typer.Argument(help="A results folder.")]):
    """(Re)draw the plots of a run."""
    try:
        _draw(run_dir)
    except HarnessError as exc:
        _fail(exc, 2)


@app.command("report")
def report_cmd(
    run_dirs: Annotated[list[Path], typer.Argument(help="A results folder; or several, with --out.")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Folder of a report over several runs (machine column, cross-machine crossover).")] = None,
):
    """Write report.md and a self-contained report.html for a run, or one over several runs (--out)."""
    from harness.results.report import write_report

    try:
        if len(run_dirs) > 1 or out is not None:
            from harness.results.multi import write_multi_report

            if out is None:
                raise HarnessError("a report over several runs needs --out DIR")
            made = write_multi_report(run_dirs, out)
        else:
            made = write_report(run_dirs[0])
    except HarnessError as exc:
        _fail(exc, 2)
    for p in made:
        console.print(f"  wrote {p}", highlight=False, markup=False)


@app.command("compare")
def compare_cmd(
    run_a: Annotated[Path, typer.Argument(help="The reference run (before).")],
    run_b: Annotated[Path, typer.Argument(help="The run to judge (after).")],
    threshold: Annotated[float, typer.Option(help="A significant slowdown of B beyond this factor (1.05: 5% slower than A) is a regression.")] = 1.05,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.", metavar="")] = False,
):
    """Per cell, B's speedup over its baseline against A's, with its interval; the time ratio as context.

    Exit code: 0 no regression; 1 a regression between trusted cells (or a cell newly failing); 3 no
    regression, but some cells were contended or unsteady in a run and could not be compared fairly;
    2 the runs could not be read or have nothing in common."""
    from harness.results.compare import compare_runs, print_comparison

    try:
        result = compare_runs(run_a, run_b, threshold=threshold)
    except HarnessError as exc:
        _fail(exc, 2)
    if json_out:
        typer.echo(result.to_json())
    else:
        print_comparison(result, console)
    raise typer.Exit(result.exit_code)


@app.command("list")
def list_cmd(json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.", metavar="")] = False):
    """Backends, variants, availability and devices."""
    import backends

    rows = backends.list_backends()
    if json_out:
        typer.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    from harness.run.machine import gpu_info

    here = {"cpu"} | ({"gpu"} if gpu_info() else set())
    table = Table(title="backends", caption=None if "gpu" in here else "devices: those of this machine (no GPU here)")
    for col in ("backend", "ok", "devices", "env", "reason"):
        table.add_column(col, overflow="fold")
    said: dict[str, str] = {}  # a reason is printed once; its other backends point at the first
    for r in rows:
        devices = [d for d in r.devices if d in here] or ["-"]
        reason = r.reason
        if reason and reason in said:
            reason = f"as {said[reason]}"
        elif reason:
            said[reason] = r.full_name
        table.add_row(escape(r.full_name), "yes" if r.available else "no", ",".join(devices), r.environment or "main",
                      escape(reason))  # reasons hold install hints like 'rnn-harness[halide]', not markup
    console.print(table)


@app.command("check")
def check_cmd(
    backends_opt: Annotated[Optional[str], typer.Option("--backends", help="Comma-separated name[:variant] list; default every available backend and variant.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A pairwise-covering subset of the matrix (what CI runs for compile-heavy backends).", metavar="")] = False,
    device: Annotated[str, typer.Option(help="cpu or gpu.")] = "cpu",
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per case.", metavar="")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print every case, not only failures.", metavar="")] = False,
    match: Annotated[Optional[str], typer.Option("--match", help="Only the cases whose label contains this text, e.g. 'truncated' or 'lstm-peephole' (--json lists the labels).")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Only the cases of this dtype (float64, float32, bfloat16, float16).")] = None,
):
    """Conformance of backends against the NumPy reference (SPEC.md tolerances)."""
    from harness.run.conformance import run_conformance

    try:
        if device not in ("cpu", "gpu"):
            raise HarnessError(f"--device: expected cpu or gpu, got {device!r}")
        names = _split_csv(backends_opt)
        results = run_conformance(names, quick=quick, device=device,
                                  progress=None if json_out else err_console, match=match, dtype=dtype)
    except HarnessError as exc:
        _fail(exc)
    if json_out:
        for r in results:
            typer.echo(json.dumps(asdict(r)))
    else:
        _print_check(results, verbose)
    bad = [r for r in results if r.status in (Status.FAIL, Status.ERROR)]
    # a check that checked nothing must not pass: no backend available here, or one asked for by name
    checked = {r.backend for r in results if r.status in (Status.PASS, Status.FAIL, Status.ERROR)}
    missing = sorted({r.backend for r in results} - checked) if names else []
    if not checked:
        err_console.print(f"[bold red]error:[/] no backend could be checked on device {escape(device)} "
                          f"(every one is unavailable or unsupported there)", highlight=False)
    elif missing:
        what = f"not checked on device {device}: {', '.join(missing)}"
        err_console.print(f"[bold red]error:[/] {escape(what)}", highlight=False)
    raise typer.Exit(1 if bad or not checked or missing else 0)


def _print_check(results, verbose: bool):
    from collections import Counter, defaultdict

    table = Table(title="conformance against the reference")
    for col in ("backend", "pass", "fail", "error", "unsupported", "unavailable", "worst |err|/bound"):
        table.add_column(col, justify="right" if col != "backend" else "left")
    by_backend = defaultdict(list)
    for r in results:
        by_backend[r.backend].append(r)
    for name, rs in by_backend.items():
        c = Counter(r.status for r in rs)
        worst = max((r.worst_ratio for r in rs if r.status in (Status.PASS, Status.FAIL)), default=0.0)
        table.add_row(escape(name), str(c["pass"]), str(c["fail"]), str(c["error"]), str(c["unsupported"]),
                      str(c["unavailable"]), f"{worst:.3g}")
    console.print(table)
    for name, rs in by_backend.items():
        for r in rs:
            if r.status in (Status.FAIL, Status.ERROR, Status.UNAVAILABLE) or (verbose and r.status == Status.PASS):
                console.print(escape(f"  {r.status:<11} {name}  {r.case} [{r.dtype}]  {r.reason or r.worst}"), highlight=False)
        reasons = Counter(r.reason for r in rs if r.status == Status.UNSUPPORTED)
        for reason, n in sorted(reasons.items()):
            console.print(escape(f"  unsupported {name}  {n} case(s): {reason}"), highlight=False)
        bounds = {r.bound for r in rs if r.status in (Status.PASS, Status.FAIL) and r.reason and r.bound}
        for b in sorted(bounds):
            console.print(escape(f"  note        {name}  used looser bound {b}"), highlight=False)
        # mixed precision is judged by a bound of its own, derived from the reference: always shown
        for dtype in REDUCED_DTYPES:
            judged = [r for r in rs if r.dtype == dtype and r.status in (Status.PASS, Status.FAIL) and r.bound]
            for b in sorted({r.bound for r in judged}):
                worst = max(r.worst_ratio for r in judged if r.bound == b)
                console.print(escape(f"  bound       {name}  [{dtype}] {b}; worst case {worst:.3g} of it"),
                              highlight=False)


@env_app.command("create")
def env_create(name: Annotated[str, typer.Argument(help="Environment name (theano), or a backend name that pins "
                                                     "versions (jax@0.4.38, jax@0.4.38+jaxlib@0.4.38).")],
               force: Annotated[bool, typer.Option("--force", help="Rebuild it even if it exists.", metavar="")] = False):
    """Build (or rebuild) an isolated backend environment."""
    from harness.run import envs

    try:
        name = envs.environment_name(name)
        envs.env_target(name)  # a known environment's folder, before anything is written
    except HarnessError as exc:
        _fail(exc, 2)
    try:
        python = envs.create_env(name, force=force, progress=err_console)
    except HarnessError as exc:
        _fail(exc, 1)
    console.print(f"environment {name} ready: {python}", highlight=False, markup=False)


@env_app.command("list")
def env_list():
    """Known environments, whether they exist, and where."""
    from harness.run import envs

    table = Table(title="isolated environments")
    for col in ("name", "exists", "path", "packages"):
        table.add_column(col)
    for row in envs.list_envs():
        exists = "damaged" if row.get("damaged") else "yes" if row["exists"] else "no"
        table.add_row(escape(row["name"]), exists, escape(str(row["path"])), escape(str(row.get("packages", ""))))
    console.print(table)


@env_app.command("remove")
def env_remove(name: Annotated[str, typer.Argument(help="Environment name, or a backend name that pins versions.")]):
    """Delete an isolated environment."""
    from harness.run import envs

    try:
        name = envs.removal_name(name)
        envs.remove_env(name)
    except HarnessError as exc:
        _fail(exc, 2)
    console.print(f"removed environment {name}", markup=False)


@app.command("import")
def import_cmd(
    json_file: Annotated[Path, typer.Argument(help="A pytest-benchmark JSON file (--benchmark-json, or a saved one).")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Results folder (default results/<file name>-<time>).")] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Backend (benchmark name) speedups are measured against; default the recorded one, else the first of each group.")] = None,
):
    """Turn pytest-benchmark results into a run folder, for plot, report and compare."""
    from harness.results.pytest_benchmark import import_json
    from harness.results.store import check_out_folder

    try:
        if out is not None:
            check_out_folder(out)  # before the file is read: said as every --out says it
        path = import_json(json_file, out, baseline)
    except HarnessError as exc:
        _fail(exc, 2)
    from harness.results.store import RunStore

    store = RunStore.open(path)
    console.print(f"imported {len(store.timings)} benchmarks -> {path}", highlight=False, markup=False)
    console.print(f"  speedup intervals: {store.meta['speedup_interval']}", highlight=False, markup=False)
    _print_summary(store)


@app.command("export")
def export_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A results folder.")],
    fmt: Annotated[str, typer.Option("--format", help="Output format: pytest-benchmark.")] = "pytest-benchmark",
    out: Annotated[Optional[Path], typer.Option("--out", help="Output file (default RUN_DIR/pytest-benchmark.json).")] = None,
):
    """Write a run's timed cells in another tool's format (pytest-benchmark JSON)."""
    from harness.results.pytest_benchmark import FORMAT, export_json

    try:
        if fmt != FORMAT:
            raise HarnessError(f"--format: expected {FORMAT}, got {fmt!r}")
        path, n, left_out = export_json(run_dir, out)
    except HarnessError as exc:
        _fail(exc, 2)
    console.print(f"wrote {n} benchmarks -> {path}", highlight=False, markup=False)
    for why in left_out:
        console.print(escape(f"  left out {why}"), highlight=False)


def main():
    """Console-script entry point."""
    try:
        app()
    except HarnessError as exc:  # anything that slipped past a command's own handling
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
