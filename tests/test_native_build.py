"""The native engine at another revision (``native@rev:<commit>``): the name grammar, resolving a revision in
the project's history, the sources a build takes, the build folder and its record, what the runner asks of
a build without loading it (supports from the probe's facts), the probe itself; and, slow, one real build
run beside the installed engine in one harness run."""

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

import backends
from backends import native_build
from backends.base import screen
from harness.results.labels import backend_label
from harness.spec.errors import HarnessError
from harness.spec.model import ModelSpec, Problem

ROOT = Path(__file__).resolve().parents[1]


def git(*args) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def problem(kind="elman", dtype="float32", **model):
    spec = ModelSpec.from_mapping({"kind": kind, "hidden": 8, **model})
    return Problem(spec, 4, 4, False, dtype, 2, 3, "cpu", "train_step")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# -- the grammar -------------------------------------------------------------------------------


def test_a_revision_name_resolves_to_its_commit_and_runs_in_the_main_environment():
    head = git("rev-parse", "HEAD")
    canonical = backends.validate_name("native@rev:HEAD")
    assert canonical == f"native@rev:{head[:native_build.SHORT]}"
    assert backends.validate_name(f"native:sync@rev:{head}") == f"native:sync@rev:{head[:native_build.SHORT]}"
    assert backends.environment_of(canonical) is None  # the main environment: only the engine differs
    r = backends.BackendRef.parse("native:sync@rev:HEAD")
    assert (r.name, r.variant) == ("native", "sync")
    assert backends.revision_of("native:sync@rev:HEAD~1") == "HEAD~1"
    assert backends.revision_of("jax@0.4.38") is None and backends.revision_of("native") is None
    assert backends.pins_of(canonical) == {}
    inst = backends.create("native:sync@rev:HEAD")
    assert inst.revision == head[:native_build.SHORT] and inst.pins == {} and inst.variant == "sync"
    assert inst.full_name == f"native:sync@rev:{head[:native_build.SHORT]}"
    assert backends.create("native").revision is None


@pytest.mark.parametrize("name, message", [
    ("numpy@rev:HEAD", "numpy cannot be built from another revision of its sources"),
    ("native@rev:--output=x", "expected a git revision after 'rev:'"),
    ("native@rev:HEAD..HEAD~2", "expected a git revision after 'rev:'"),
    ("native@rev:no-such-branch-anywhere", "'no-such-branch-anywhere' names no commit"),
    ("native@rev:", "expected a git revision after 'rev:'"),
])
def test_names_that_cannot_be_built_say_why(name, message):
    with pytest.raises(HarnessError, match="^backend ") as err:
        backends.validate_name(name)
    assert message in str(err.value)


def test_a_commit_without_the_engine_is_refused():
    first = git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    has_engine = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{first}:backends/native/module.cpp"],
                                capture_output=True).returncode == 0
    if has_engine:
        pytest.skip("the first commit of this history already has the engine")
    with pytest.raises(HarnessError, match="has no native engine"):
        native_build.resolve(first)


def test_a_revision_is_a_backend_of_its_own_in_tables():
    df = pd.DataFrame({"backend": ["native", "native"], "variant": ["default", "default"],
                       "pins": [None, "rev:4aee8db642ee"], "backend_version": [None, "rev:4aee8db642ee"]})
    assert list(backend_label(df)) == ["native", "native rev:4aee8db642ee"]


# -- sources and the build folder ---------------------------------------------------------------


def test_a_build_takes_the_engine_sources_of_the_commit_and_nothing_else(tmp_path):
    commit = native_build.resolve("HEAD")
    written = native_build.extract(commit, tmp_path)
    expected = git("ls-tree", "-r", "--name-only", commit, "--", "CMakeLists.txt", "backends/native").splitlines()
    assert sorted(written) == sorted(expected) and "backends/native/module.cpp" in written
    for name in expected:  # the commit's bytes, not the working tree's
        assert (tmp_path / name).read_bytes() == subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{commit}:{name}"], capture_output=True, check=True).stdout
    assert not (tmp_path / "backends" / "native_backend.py").exists()  # the wrapper is this checkout's


def test_the_build_folder_names_the_commit_and_this_machine(home):
    commit = native_build.resolve("HEAD")
    folder = native_build.build_dir(commit)
    assert folder.parent == home / "native" and folder.name == f"{commit}-{native_build.build_key()}"
    assert native_build.built(commit) is None
    folder.mkdir(parents=True)
    (folder / native_build.MARKER).write_text(json.dumps({"commit": commit, "module": str(folder / "gone.so")}))
    assert native_build.built(commit) is None  # a record whose module is missing is no build


def _fake_build(home, facts: dict) -> str:
    """A finished build's record for HEAD (the module file exists; nothing loads it here)."""
    commit = native_build.resolve("HEAD")
    folder = native_build.build_dir(commit)
    folder.mkdir(parents=True)
    (folder / "_native.so").write_bytes(b"")
    base = {"kinds": ["elman", "lstm", "gru"], "bidirectional": True, "bf16_gemm": True, "bf16_cpu": True}
    (folder / native_build.MARKER).write_text(json.dumps({"commit": commit, "module": str(folder / "_native.so"),
                                                          "facts": base | facts}))
    return commit


def test_what_an_older_engine_lacks_is_unsupported_from_its_build_record(home):
    _fake_build(home, {"kinds": ["elman", "lstm"], "bidirectional": False, "bf16_gemm": False, "bf16_cpu": False})
    old = backends.create("native@rev:HEAD")
    assert screen(old, problem("elman")) == ("ok", "")
    status, why = screen(old, problem("gru"))
    assert status == "unsupported" and f"the engine at {old.revision} has no gru cell" in why
    status, why = screen(old, problem("lstm", bidirectional=True))
    assert status == "unsupported" and "has no bidirectional layers" in why
    status, why = screen(old, problem("lstm", dtype="bfloat16"))
    assert status == "unsupported" and "has no bfloat16 GEMM" in why


def test_bfloat16_on_a_revision_follows_its_probe_of_the_cpu(home):
    _fake_build(home, {"bf16_cpu": False})
    status, why = screen(backends.create("native@rev:HEAD"), problem("gru", dtype="bfloat16"))
    assert status == "unsupported" and "this CPU has no AVX512-BF16" in why
    inst = backends.create("native@rev:HEAD")
    inst.bf16_kernel = "portable"  # the emulation, accepted anywhere (tests)
    assert screen(inst, problem("gru", dtype="bfloat16")) == ("ok", "")


def test_a_revision_that_cannot_be_built_is_unavailable_with_the_reason(home, monkeypatch):
    monkeypatch.setattr(native_build, "can_build", lambda: (False, "building ... needs cmake"))
    ok, why = backends.create("native@rev:HEAD").availability()
    assert not ok and why.startswith("unavailable: the native engine at ") and "needs cmake" in why


# -- the probe -------------------------------------------------------------------------------------


class _OldEngine:
    """An engine module as one before the GRU, bidirectional layers and bfloat16 answers (ValueError at the
    spec, or at the parameter count once the spec is read; bidirectional ignored)."""

    class Net32:
        def __init__(self, spec, variant, threads, chunk, params):
            if spec["kind"] not in ("elman", "lstm"):
                raise ValueError(f"unknown model kind {spec['kind']}")
            raise ValueError("expected 3 parameter arrays")

    @staticmethod
    def build_info():
        return {"compiler": "gcc 12.2.0"}


def test_the_probe_finds_what_an_engine_accepts():
    old = native_build.probe(_OldEngine)
    assert old == {"kinds": ["elman", "lstm"], "bidirectional": False, "bf16_gemm": False, "bf16_cpu": False,
                   "build_info": {"compiler": "gcc 12.2.0"}}
    from backends.native_backend import _load

    mod = _load()
    now = native_build.probe(mod)
    assert now["kinds"] == ["elman", "lstm", "gru"] and now["bidirectional"] and now["bf16_gemm"]
    assert now["bf16_cpu"] == mod.bf16_cpu()


# -- one real build, run beside the installed engine ----------------------------------------------


@pytest.mark.slow
def test_the_engine_at_head_builds_and_runs_beside_the_installed_one(home, write_config, tmp_path):
    ok, why = native_build.can_build()
    if not ok:
        pytest.skip(why)
    import sys

    import harness

    commit = native_build.resolve("HEAD")
    path = write_config("""
name: ab
seed: 1
model: {kind: gru, hidden: 16, bias: true, head: softmax_xent, bptt: full}
task: {kind: random, input_size: 8, output_size: 8, seq_len: 5, n_sequences: 8}
workloads: [train_step]
batch: [4]
threads: [1]
backends: [native, "native@rev:HEAD"]
baseline: "native@rev:HEAD"
timing: {warmup: 1, min_rounds: 3, min_time_s: 0.05, max_time_s: 1, timeout_s: 300}
""")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(path), "--out", str(out), "--no-plots"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = harness.load_run(out)
    rows = run.timings.set_index(run.timings["pins"].fillna(""))
    assert set(rows["status"]) == {"ok"}, rows[["status", "error"]]
    assert rows.loc[f"rev:{commit[:native_build.SHORT]}", "backend"] == "native"
    assert rows.loc["", "speedup"] > 0  # the A/B: the installed engine against HEAD's
    record = native_build.built(commit)
    assert record is not None and Path(record["module"]).is_file() and record["facts"]["kinds"][-1] == "gru"
    versions = run.meta["versions"][f"native@rev:{commit[:native_build.SHORT]}"]
    assert versions["engine_commit"] == commit


def test_an_installed_engine_older_than_its_sources_says_so(tmp_path):
    """``native`` in an A/B is the installed build: versions() records when the checkout's engine sources
    changed after it was built (the A/B would compare an old build with the last commit)."""
    import os

    from backends.native_backend import sources_newer_than

    (tmp_path / "backends" / "native").mkdir(parents=True)
    for name in ("CMakeLists.txt", "backends/native/rnn.hpp", "backends/native/module.cpp"):
        (tmp_path / name).write_text("x")
        os.utime(tmp_path / name, (1000, 1000))
    module = tmp_path / "_native.so"
    module.write_bytes(b"")
    os.utime(module, (2000, 2000))
    assert sources_newer_than(str(module), str(tmp_path)) == []
    os.utime(tmp_path / "backends/native/rnn.hpp", (3000, 3000))
    assert sources_newer_than(str(module), str(tmp_path)) == ["backends/native/rnn.hpp"]
    assert sources_newer_than(str(tmp_path / "missing.so"), str(tmp_path)) == []
    versions = backends.create("native").versions()
    assert versions["engine_sources"].startswith(("the checkout's", "backends/native", "CMakeLists.txt"))
