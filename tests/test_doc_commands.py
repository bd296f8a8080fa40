"""Every command of the README's and docs/' command blocks works as printed, so they cannot drift.

Each command found in a shell block (```bash, or a plain ``` block of commands) must be listed in
:data:`HOW`, which says how it is held to its text:

- ``run``: executed as printed, from the project's folder;
- ``("small", argv)``: its smallest variant is executed (the same command on fewer cases, a
  scratch folder, ``--help`` of a script that needs a GPU);
- ``parse``: the harness's command line accepts it as printed (options, values, subcommands) and
  the configs and profiles it names load; what it would do takes minutes or a GPU;
- ``ci``: ``.ci/run`` runs this very command; ``pip``: the extras and paths it names exist;
- ``("test", "tests/FILE.py::NAME")``: that test runs it (in a scratch folder); ``("after", COMMAND)``:
  the test of COMMAND runs it next (the pytest-benchmark comparison against the run it saved);
- ``("external", why)``: it needs what a test has not (a cluster, a registry, a GPU machine's visit).

Every path the commands name in the project (configs/, examples/, benchmarks/, notebooks/,
results/examples/) must exist, whatever the kind. A command added to a block fails
:func:`test_every_command_of_the_docs_is_held_to_its_text` until it is listed here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
        "examples/rnn-harness-plugin-example/README.md"]
PROGRAMS = ("harness", "pytest", "python", "python3", "pip", "cd", "mkdir", "tar", "for", ".", "jupyter")
PROJECT_PATHS = ("configs/", "examples/", "benchmarks/", "notebooks/", "results/examples", "docs/")
#: options whose value is a path the command writes (need not exist yet)
OUTPUTS = ("--out", "--archive", "-C", "-d", "--target")
TIMEOUT_S = 300
EXAMPLE_SRC = "examples/rnn-harness-plugin-example/src"
EXAMPLE_ENV = {"HARNESS_BACKENDS": "example=rnn_harness_plugin_example.backend:ExampleElmanBackend",
               "PYTHONPATH": EXAMPLE_SRC}
TINY_BENCH = ["--benchmark-max-time=0.005", "--benchmark-min-rounds=3", "--benchmark-warmup=off", "-p", "no:cacheprovider"]
GPU_VISIT = "the GPU machine's visit without registry access (a registry, a GPU machine, its runs.tgz)"

HOW: dict[str, object] = {
    # README: quick start and tests
    "python3 -m venv .venv": "ci",
    ". .venv/bin/activate": "ci",
    "pip install -e .[all]": "pip",
    "harness run configs/quick.yaml": "parse",
    "pip install -e .[all,dev]": "ci",
    "pytest": "ci",
    # docs/reproducing.md
    "harness reproduce --dry-run": "run",
    "harness reproduce --budget 25 --out results/examples": "parse",
    "harness docs": "parse",  # rewrites committed files: CI runs `harness docs --check`
    "mkdir -p .whl": ("external", GPU_VISIT),
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d "
    ".whl pydantic pydantic-core annotated-types typing-inspection typing-extensions": ("external", GPU_VISIT),
    "python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl": ("external", GPU_VISIT),
    "export PYTHONPATH=/tmp/site": ("external", GPU_VISIT),
    "python3 -m pip install --no-index --no-deps --no-build-isolation -e .": ("external", GPU_VISIT),
    "harness reproduce --budget 8 --out results/reproduce-gpu --archive runs.tgz": "parse",
    "harness unpack runs.tgz": "parse",
    "for run in $(tar tzf runs.tgz | cut -d/ -f1 | sort -u); do harness report results/examples/$run; done":
        ("external", GPU_VISIT),
    # docs/results.md: notebooks
    "pip install -e .[notebooks]": "pip",
    "HARNESS_RUNS=results/examples/quick jupyter lab notebooks/":
        ("external", "starts a JupyterLab server; tests/test_notebooks.py executes both notebooks"),
    # docs/clusters.md
    "harness run configs/deepbench.yaml --executor dask-local --workers 2": "parse",
    "harness run configs/deepbench.yaml --executor dask --scheduler tcp://head:8786": "parse",
    "python cluster.py": ("external", "a Slurm or PBS login node with dask-jobqueue"),
    "harness run configs/deepbench.yaml --profile full --executor dask --scheduler tcp://10.0.0.5:41234": "parse",
    # docs/backends-and-versions.md: the native engine's A/B
    "pip install -e .": "pip",
    "harness run configs/native_ab.yaml": "parse",
    "harness run configs/native_ab.yaml --backends native@rev:4aee8db,native": "parse",
    # docs/plugins.md and docs/backends.md
    "pip install examples/rnn-harness-plugin-example": ("test", "tests/test_plugins.py::installed_example"),
    "(in examples/rnn-harness-plugin-example) pytest":
        ("test", "tests/test_plugins.py::test_plugin_own_tests_pass_through_the_public_helper"),
    "cd examples/rnn-harness-plugin-example": "pip",
    "harness list": ("small", ["harness", "list"], EXAMPLE_ENV),
    "harness check --backends example --quick":
        ("small", ["harness", "check", "--backends", "example", "--quick", "--match", "elman-tanh"], EXAMPLE_ENV),
    "HARNESS_BACKENDS=example=rnn_harness_plugin_example.backend:ExampleElmanBackend "
    "PYTHONPATH=examples/rnn-harness-plugin-example/src harness check --backends example --quick":
        ("small", ["harness", "check", "--backends", "example", "--quick", "--match", "elman-tanh"], EXAMPLE_ENV),
    "harness run configs/quick.yaml --backends numpy,example": "parse",
    # docs/pytest-benchmark.md (the project's addopts apply: -n 2 among them)
    "pytest benchmarks/ --benchmark-only -k numpy --benchmark-json=out.json":
        ("small", ["pytest", "benchmarks/", "--benchmark-only", "-k", "numpy and V64 and B1 and forward",
                   "--benchmark-json={tmp}/out.json", *TINY_BENCH]),
    "pytest benchmarks/ --benchmark-only -k torch and train_step --benchmark-autosave":
        ("small", ["pytest", "benchmarks/", "--benchmark-only", "-k", "torch and train_step and V64 and B1 and not compile",
                   "--benchmark-autosave", "--benchmark-storage={tmp}/saved", *TINY_BENCH]),
    "pytest benchmarks/ --benchmark-only -k torch and train_step --benchmark-compare":
        ("after", "pytest benchmarks/ --benchmark-only -k torch and train_step --benchmark-autosave"),
    # docs/experiments.md
    "harness run configs/<config>.yaml": "parse",
    "harness run configs/lstm_gpu.yaml --profile full": "parse",
    "python benchmarks/measure_cuda.py --out results/kernels-lstm-gpu":
        ("small", ["python", "benchmarks/measure_cuda.py", "--help"]),
}


def _blocks(text: str):
    """(line, language, body) of every fenced block."""
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        yield text[: m.start()].count("\n") + 2, m.group(1), m.group(2)


def _commands_of(body: str) -> list[str] | None:
    """The commands of a block, each as its tokens joined by spaces (``(in DIR) `` after a ``cd DIR``
    of its line); None when the block is no list of commands (an error message, a file tree)."""
    lines = [ln for ln in body.replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        return None
    for line in lines:  # a block of commands: each line starts with a program (after VAR=value settings)
        words = [w for w in line.split() if not re.match(r"^[A-Z_]+=", w)]
        if not words or words[0] not in PROGRAMS:
            return None
    found = []
    for line in lines:
        tokens = shlex.split(line, comments=True)
        if tokens[0] == "for":  # a loop: one command as printed
            found.append(" ".join(tokens))
            continue
        where, current = "", []
        for t in [*tokens, "&&"]:
            if t in ("&&", ";", "&"):
                if current:
                    found.append(where + " ".join(current))
                    if current[0] == "cd":
                        where = f"(in {current[1]}) "
                current = []
            else:
                current.append(t)
    return found


def doc_commands() -> dict[str, list[str]]:
    """Each command of the shell blocks of the README and docs/ -> where it is printed."""
    out: dict[str, list[str]] = {}
    for name in DOCS:
        for line, lang, body in _blocks((ROOT / name).read_text()):
            if lang not in ("", "bash", "sh", "shell"):
                continue
            for cmd in _commands_of(body) or ():
                out.setdefault(cmd, []).append(f"{name}:{line}")
    return out


COMMANDS = doc_commands()


def test_every_command_of_the_docs_is_held_to_its_text():
    missing = sorted(set(COMMANDS) - set(HOW))
    assert not missing, "commands of the docs that this test does not hold (add them to HOW):\n" + "\n".join(
        f"  {c!r} ({', '.join(COMMANDS[c])})" for c in missing)
    stale = sorted(set(HOW) - set(COMMANDS))
    assert not stale, f"HOW lists commands no doc prints any more: {stale}"


def _kind(cmd: str) -> str:
    how = HOW.get(cmd)
    return how if isinstance(how, str) else how[0] if how else "?"


def _of(kind: str) -> list[str]:
    return [c for c in COMMANDS if _kind(c) == kind]


@pytest.mark.parametrize("cmd", sorted(COMMANDS), ids=str)
def test_the_project_paths_a_command_names_exist(cmd):
    tokens = shlex.split(cmd.partition(") ")[2] if cmd.startswith("(in ") else cmd)
    for before, t in zip([None, *tokens], tokens):
        if before in OUTPUTS:
            continue
        value = t.partition("=")[2] if "=" in t and not t.startswith("-") else t
        if value.startswith(PROJECT_PATHS) and not re.search(r"[<$*]", value):
            assert (ROOT / value).exists(), f"{cmd}: {value} does not exist"


def _parse(args: list[str]) -> None:
    """What the harness's command line makes of ``args``, without running it (click raises on an unknown
    command or option, a missing or badly typed value)."""
    import typer

    from harness.cli import app

    command = typer.main.get_command(app)
    ctx = command.make_context("harness", list(args))
    while hasattr(command, "resolve_command"):  # a group (typer's own click types: no isinstance)
        rest = [*ctx._protected_args, *ctx.args]
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx.params


@pytest.mark.parametrize("cmd", _of("parse"), ids=str)
def test_a_command_the_harness_accepts_as_printed(cmd):
    from harness.config import load_config

    tokens = shlex.split(cmd.replace("<config>", "quick"))
    assert tokens[0] == "harness"
    params = _parse(tokens[1:])
    for config in params.get("configs") or []:
        load_config(config, None, params.get("profile"))  # the config, and its profile, load


@pytest.mark.parametrize("cmd", _of("ci"), ids=str)
def test_a_command_ci_runs_as_printed(cmd):
    ci = (ROOT / ".ci" / "run").read_text()
    assert cmd in (_commands_of(ci.replace('"', "")) or []) or any(
        cmd in (_commands_of(ln.replace('"', "")) or []) for ln in ci.splitlines() if ln and not ln.startswith("#")), cmd


@pytest.mark.parametrize("cmd", _of("pip"), ids=str)
def test_a_pip_command_names_extras_and_folders_that_exist(cmd):
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for t in shlex.split(cmd)[1:]:
        target = re.match(r"^([\w./-]+)(\[([\w,-]+)\])?$", t)
        if t.startswith("-") or target is None or t in ("install",):
            continue
        assert (ROOT / target.group(1)).exists(), f"{cmd}: {target.group(1)}"
        assert set(filter(None, (target.group(3) or "").split(","))) <= extras, f"{cmd}: extras {target.group(3)}"


@pytest.mark.parametrize("cmd", _of("test"), ids=str)
def test_a_command_a_test_runs(cmd):
    path, _, name = HOW[cmd][1].partition("::")
    assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), HOW[cmd][1]


@pytest.mark.parametrize("cmd", _of("after"), ids=str)
def test_a_command_run_after_another(cmd):
    first = HOW[HOW[cmd][1]]
    assert first[0] == "small" and "--benchmark-autosave" in first[1] and "--benchmark-compare" in cmd


def _execute(argv: list[str], env_extra: dict | None = None, tmp=None) -> subprocess.CompletedProcess:
    program = {"harness": [sys.executable, "-m", "harness.cli"], "pytest": [sys.executable, "-m", "pytest"],
               "python": [sys.executable], "python3": [sys.executable]}[argv[0]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_BACKENDS"))}
    for k, v in (env_extra or {}).items():
        env[k] = os.pathsep.join([str(ROOT / v), env.get(k, "")]) if k == "PYTHONPATH" else v
    args = [a.replace("{tmp}", str(tmp)) for a in argv[1:]]
    return subprocess.run(program + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", _of("run") + _of("small"), ids=str)
def test_a_command_runs_as_printed_or_in_its_smallest_variant(cmd, tmp_path):
    how = HOW[cmd]
    argv, env = (shlex.split(cmd), None) if how == "run" else (how[1], how[2] if len(how) > 2 else None)
    proc = _execute(argv, env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "--benchmark-json={tmp}/out.json" in argv:
        assert json.loads((tmp_path / "out.json").read_text())["benchmarks"]
    if "--benchmark-autosave" in argv:  # then the page's next command, against what this one saved
        compare = [a for a in argv if a != "--benchmark-autosave"] + ["--benchmark-compare"]
        after = _execute(compare, env, tmp_path)
        assert after.returncode == 0 and "Comparing against benchmarks from" in after.stdout + after.stderr, \
            after.stdout[-3000:] + after.stderr[-3000:]
    if "--help" in argv:
        assert "--out" in proc.stdout
    if argv == ["harness", "list"]:
        assert "example" in proc.stdout
