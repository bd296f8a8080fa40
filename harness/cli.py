"""The ``harness`` command line. Library code raises HarnessError; only this module
turns it into ``error: ...`` and an exit code."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from harness.errors import HarnessError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmark one RNN spec across backends.")
env_app = typer.Typer(no_args_is_help=True, help="Isolated environments for backends that need one (Theano).")
app.add_typer(env_app, name="env")
console = Console()
err_console = Console(stderr=True)


def _split_csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _fail(exc: HarnessError, code: int = 2):
    err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command("list")
def list_cmd(json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False):
    """Backends, variants, availability and devices."""
    import backends

    rows = backends.list_backends()
    if json_out:
        typer.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    table = Table(title="backends")
    for col in ("backend", "available", "devices", "environment", "reason"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.full_name, "yes" if r.available else "no", ",".join(r.devices), r.environment or "main",
                      r.reason)
    console.print(table)


@app.command("check")
def check_cmd(
    backends_opt: Annotated[Optional[str], typer.Option("--backends", help="Comma-separated name[:variant] list; default every available backend and variant.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A pairwise-covering subset of the matrix (what CI runs for compile-heavy backends).")] = False,
    device: Annotated[str, typer.Option(help="cpu or gpu.")] = "cpu",
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per case.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print every case, not only failures.")] = False,
):
    """Conformance of backends against the NumPy reference (SPEC.md tolerances)."""
    from harness.conformance import run_conformance

    try:
        results = run_conformance(_split_csv(backends_opt), quick=quick, device=device,
                                  progress=None if json_out else err_console)
    except HarnessError as exc:
        _fail(exc)
    if json_out:
        for r in results:
            typer.echo(json.dumps(asdict(r)))
    else:
        _print_check(results, verbose)
    bad = [r for r in results if r.status in ("fail", "error")]
    raise typer.Exit(1 if bad else 0)


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
        worst = max((r.worst_ratio for r in rs if r.status in ("pass", "fail")), default=0.0)
        table.add_row(name, str(c["pass"]), str(c["fail"]), str(c["error"]), str(c["unsupported"]),
                      str(c["unavailable"]), f"{worst:.3g}")
    console.print(table)
    for name, rs in by_backend.items():
        for r in rs:
            if r.status in ("fail", "error", "unavailable") or (verbose and r.status == "pass"):
                console.print(f"  {r.status:<11} {name}  {r.case} [{r.dtype}]  {r.reason or r.worst}", highlight=False)
        reasons = Counter(r.reason for r in rs if r.status == "unsupported")
        for reason, n in sorted(reasons.items()):
            console.print(f"  unsupported {name}  {n} case(s): {reason}", highlight=False)
        bounds = {r.bound for r in rs if r.status in ("pass", "fail") and r.reason and r.bound}
        for b in sorted(bounds):
            console.print(f"  note        {name}  used looser bound {b}", highlight=False)


@env_app.command("create")
def env_create(name: Annotated[str, typer.Argument(help="Environment name, e.g. theano.")],
               force: Annotated[bool, typer.Option("--force", help="Rebuild it even if it exists.")] = False):
    """Build (or rebuild) an isolated backend environment."""
    from harness import envs

    try:
        python = envs.create_env(name, force=force, progress=err_console)
    except HarnessError as exc:
        _fail(exc, 1)
    console.print(f"environment {name} ready: {python}", highlight=False)


@env_app.command("list")
def env_list():
    """Known environments, whether they exist, and where."""
    from harness import envs

    table = Table(title="isolated environments")
    for col in ("name", "exists", "path", "packages"):
        table.add_column(col)
    for row in envs.list_envs():
        table.add_row(row["name"], "yes" if row["exists"] else "no", row["path"], row.get("packages", ""))
    console.print(table)


@env_app.command("remove")
def env_remove(name: Annotated[str, typer.Argument(help="Environment name.")]):
    """Delete an isolated environment."""
    from harness import envs

    try:
        envs.remove_env(name)
    except HarnessError as exc:
        _fail(exc, 1)
    console.print(f"removed environment {name}")


def main():
    """Console-script entry point."""
    try:
        app()
    except HarnessError as exc:  # anything that slipped past a command's own handling
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
