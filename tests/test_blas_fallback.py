"""An isolated environment's OpenBLAS older than the CPU: found once per CPU, fixed with the core type it knows,
said in the Answer, and switched off by the config.

Nothing here depends on this machine's CPU: the CPU and the kernels each build reports are faked.
"""

import json
import sys

import pytest

from harness.config import load_config
from harness.run import client, envs, group, machine
from harness.spec import tuning

PINNED = "numpy@1.26.4"
NUMPY_LIB = "/env/numpy.libs/libopenblas64_p-r0-15028c96.3.21.dev.so"
SCIPY_LIB = "/env/scipy.libs/libopenblasp-r0-41284840.3.18.so"
SAPPHIRE = {"vendor": "GenuineIntel", "family": "6", "model": "207",
            "flags": ["avx", "avx2", "avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl", "fma", "sse3"]}
ZEN3 = {"vendor": "AuthenticAMD", "family": "25", "model": "1", "flags": ["avx", "avx2", "fma", "sse3"]}
OLD = {"vendor": "GenuineIntel", "family": "6", "model": "26", "flags": ["sse3", "sse4_2"]}


def _lib(path, version, core):
    return {"user_api": "blas", "internal_api": "openblas", "architecture": core, "version": version,
            "num_threads": 1, "filepath": path, "source": "loaded libraries"}


class FakeBuilds:
    """Stands in for blas_probe --kernels: each build knows some core types and falls back to Prescott on the
    rest (the CPU is newer than it), as an OpenBLAS build does; the environments it was asked with are kept."""

    def __init__(self, known=None):
        self.known = known or {NUMPY_LIB: ("0.3.20", {"SkylakeX", "Haswell", "Zen"}),
                               SCIPY_LIB: ("0.3.18", {"SkylakeX", "Haswell", "Zen"})}
        self.asked = []

    def __call__(self, py, env):
        core = env.get(tuning.CORETYPE)
        self.asked.append(core)
        return [_lib(path, version, core if core in known else "Prescott")
                for path, (version, known) in self.known.items()]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private HARNESS_HOME holding a finished pinned environment, on a faked AVX-512 Intel CPU that its
    OpenBLAS builds do not know."""
    monkeypatch.setenv("HARNESS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(tuning.CORETYPE, raising=False)
    folder = envs.env_dir(PINNED)
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)
    recipe = envs.find_recipe(PINNED)
    (folder / envs.MARKER).write_text(json.dumps({"name": PINNED, "packages": {}, "recipe": list(recipe.packages)}))
    monkeypatch.setattr(machine, "cpu_identity", lambda: dict(SAPPHIRE))
    builds = FakeBuilds()
    monkeypatch.setattr(envs, "_kernels", builds)
    return builds


def test_generic_core_names_and_the_core_types_a_cpu_takes():
    assert all(tuning.is_generic(core) for core in ("Prescott", "CORE2", "nehalem", "Atom", "Katmai"))
    assert not any(tuning.is_generic(core) for core in ("SkylakeX", "Haswell", "Zen", None, ""))
    assert tuning.core_types(SAPPHIRE["flags"], SAPPHIRE["vendor"]) == ["SkylakeX", "Haswell"]
    assert tuning.core_types(ZEN3["flags"], ZEN3["vendor"]) == ["Zen", "Haswell"]
    assert tuning.core_types(OLD["flags"], OLD["vendor"]) == []
    assert tuning.library_text({"version": "OpenBLAS 0.3.20 DYNAMIC_ARCH NO_AFFINITY Prescott"}) == "OpenBLAS 0.3.20"


def test_the_best_core_type_every_fallen_build_knows(home, monkeypatch):
    record = envs.check_kernels(PINNED)
    assert record["core_type"] == "SkylakeX"
    assert [lib["architecture"] for lib in record["alone"]] == ["Prescott", "Prescott"]
    assert [lib["architecture"] for lib in record["with_core_type"]] == ["SkylakeX", "SkylakeX"]
    text = envs.kernels_text(record)
    assert "numpy's OpenBLAS 0.3.20 Prescott (SkylakeX by OPENBLAS_CORETYPE)" in text
    assert "scipy's OpenBLAS 0.3.18 Prescott (SkylakeX by OPENBLAS_CORETYPE)" in text
    home.asked.clear()
    assert envs.core_type(PINNED) == "SkylakeX" and home.asked == []  # kept for this CPU, not asked again

    # a build that predates SkylakeX's kernels: the core type both builds take is Haswell's
    older = FakeBuilds({NUMPY_LIB: ("0.3.20", {"SkylakeX", "Haswell"}), SCIPY_LIB: ("0.2.19", {"Haswell"})})
    monkeypatch.setattr(envs, "_kernels", older)
    assert envs.check_kernels(PINNED)["core_type"] == "Haswell"
    assert older.asked == [None, "SkylakeX", "Haswell"]

    monkeypatch.setattr(machine, "cpu_identity", lambda: dict(ZEN3))  # another CPU: its own record
    assert envs.core_type(PINNED) == "Haswell"  # these builds know no Zen
    monkeypatch.setattr(envs, "_kernels", FakeBuilds())
    assert envs.check_kernels(PINNED)["core_type"] == "Zen"
    monkeypatch.setattr(machine, "cpu_identity", lambda: dict(OLD))  # nothing better than SSE to take
    assert envs.core_type(PINNED) is None

    monkeypatch.setattr(machine, "cpu_identity", lambda: dict(SAPPHIRE))
    asked = []
    monkeypatch.setattr(envs, "_kernels", lambda py, env: asked.append(env.get(tuning.CORETYPE)) or
                        [_lib(NUMPY_LIB, "0.3.27", "SkylakeX")])
    assert envs.check_kernels(PINNED)["core_type"] is None  # a build that knows the CPU is left alone
    assert asked == [None]


def test_workers_get_the_core_type_with_origin_harness(home, monkeypatch):
    environment, settings = client.worker_settings(PINNED, "cpu", "float32", 1, {})
    assert environment == PINNED and settings[tuning.CORETYPE] == "SkylakeX"
    _, record = client.process_environ(environment, settings, {})
    entry = record[tuning.CORETYPE]
    assert entry["origin"] == client.HARNESS and entry["value"] == "SkylakeX"
    assert [lib["version"] for lib in entry["fixes"]] == ["0.3.20", "0.3.18"]

    # the switch off, a core type the config names, one the caller's environment names: none is overridden
    assert tuning.CORETYPE not in client.worker_settings(PINNED, "cpu", "float32", 1, {}, fix_kernel=False)[1]
    assert client.worker_settings(PINNED, "cpu", "float32", 1, {tuning.CORETYPE: "Haswell"})[1][tuning.CORETYPE] \
        == "Haswell"
    monkeypatch.setenv(tuning.CORETYPE, "Haswell")
    assert tuning.CORETYPE not in client.worker_settings(PINNED, "cpu", "float32", 1, {})[1]
    assert client.worker_settings(PINNED, "cpu", "float32", 1, {}, clean=True)[1][tuning.CORETYPE] == "SkylakeX"
    # the main environment's workers are left as they are
    assert tuning.CORETYPE not in client.worker_settings("numpy", "cpu", "float32", 1, {}, clean=True)[1]


class _Worker:
    """Stands in for a worker process: keeps the environment it was started with, and fails its first request."""

    started = []

    def __init__(self, environment, env, label, recorded=None, record=None):
        self.env = dict(recorded or {})
        _Worker.started.append((environment, env))

    def request(self, req, timeout_s):
        raise client.WorkerFailure("error", "not started in this test")

    def close(self, wait=True):
        pass


def _cells(write_config, backends, extra=""):
    path = write_config(f"name: t\nbackends: {backends}\nmodel: {{kind: elman, hidden: 4}}\n"
                        f"task: {{kind: random, input_size: 3, seq_len: 4}}\n{extra}")
    return load_config(path).cells()


@pytest.mark.parametrize("switch", [True, False])
def test_a_run_sets_it_and_the_config_switch_turns_it_off(home, monkeypatch, write_config, switch):
    monkeypatch.setattr(group, "WorkerProcess", _Worker)
    _Worker.started = []
    cells = _cells(write_config, f'[numpy, "{PINNED}"]', "" if switch else "fix_blas_kernel: false\n")
    outcomes = {c.backend: group.GroupRun._start(c, lambda message: None)[1] for c in cells}
    pinned = outcomes[PINNED]
    assert (_Worker.started[1][1].get(tuning.CORETYPE) == "SkylakeX") is switch
    assert (tuning.CORETYPE in (pinned.steering or {})) is switch
    assert tuning.CORETYPE not in (outcomes["numpy"].steering or {})
    if switch:  # the rest of the Answer's input is what the worker reports: its builds then run SkylakeX
        assert pinned.steering[tuning.CORETYPE]["origin"] == "harness"


def _meta(variables, blas, flags=("avx2", "avx512f", "fma")):
    return {"machine": {"cpu_flags": list(flags)},
            "worker_environment": {f"{PINNED}|threads=1": {"clean": False, "variables": variables, "blas": blas}}}


def test_the_answer_says_which_build_does_not_know_the_cpu():
    fixes = [_lib(NUMPY_LIB, "0.3.20", "Prescott")]
    variables = {tuning.CORETYPE: {"value": "SkylakeX", "origin": "harness", "fixes": fixes}}
    meta = _meta(variables, [_lib(NUMPY_LIB, "0.3.20", "SkylakeX")])
    said = tuning.fallback_lines(meta)
    assert said == [f"{PINNED}'s OpenBLAS 0.3.20 does not know this CPU: its workers run SkylakeX by "
                    f"OPENBLAS_CORETYPE."]
    both = dict(variables)
    both[tuning.CORETYPE] = dict(variables[tuning.CORETYPE], fixes=fixes + [_lib(SCIPY_LIB, "0.3.18", "Prescott")])
    assert tuning.fallback_lines(_meta(both, [])) == [
        f"{PINNED}'s OpenBLAS 0.3.20 and 0.3.18 do not know this CPU: its workers run SkylakeX by OPENBLAS_CORETYPE."]


def test_the_answer_names_a_generic_kernel_nothing_fixed():
    meta = _meta({}, [_lib(NUMPY_LIB, "0.3.20", "Prescott"), _lib(SCIPY_LIB, "0.3.18", "Prescott")])
    assert tuning.fallback_lines(meta) == [
        f"{PINNED}'s workers ran a generic kernel (OpenBLAS 0.3.20's Prescott and OpenBLAS 0.3.18's Prescott) on a "
        f"CPU with AVX-512: its times are below what this CPU gives."]
    assert tuning.fallback_lines(_meta({}, [_lib(NUMPY_LIB, "0.3.20", "Prescott")], flags=("avx",))) == []


def test_every_theano_cell_of_the_run_that_builds_the_environment_links_the_chosen_blas(home, monkeypatch,
                                                                                      write_config):
    from backends import blas

    shim = "-L/env/theano/blas -lharness_openblas_shim"
    built = []

    def build(name, progress=None):  # what creating the environment leaves: its BLAS choice, then its marker
        folder = envs.env_dir(name)
        if not built:
            (folder / "bin").mkdir(parents=True)
            (folder / "bin" / "python").symlink_to(sys.executable)
            (folder / blas.CHOICE_FILE).write_text(json.dumps(
                {"by_threads": {"1": {"choice": "openblas", "ldflags": shim}}}))
            (folder / envs.MARKER).write_text(json.dumps({"name": name, "packages": {}, "recipe": []}))
        built.append(name)
        return folder / "bin" / "python"

    monkeypatch.setattr(envs, "ensure_env", build)
    monkeypatch.setattr(group, "WorkerProcess", _Worker)
    _Worker.started = []
    cells = _cells(write_config, "[numpy, theano]", "batch: [1, 2]\n")
    seen = []
    for cell in (c for c in cells if c.backend == "theano"):
        outcome = group.GroupRun._start(cell, lambda message: None)[1]
        seen.append(outcome.worker_env["THEANO_FLAGS"])
    assert built[0] == "theano" and len(seen) == 2
    assert all(f"blas__ldflags={shim}," in flags for flags in seen)  # the first cell's too
    assert [env["THEANO_FLAGS"] for environment, env in _Worker.started if environment == "theano"] == seen
    # the theano environment's builds are faked as not knowing this CPU either: its workers get SkylakeX
    assert all(env[tuning.CORETYPE] == "SkylakeX" for environment, env in _Worker.started if environment == "theano")


def test_env_list_shows_the_kernel_each_library_picks_here(home):
    rows = {row["name"]: row for row in envs.list_envs()}
    text = rows[PINNED]["packages"]
    assert "kernels on this CPU: numpy's OpenBLAS 0.3.20 Prescott (SkylakeX by OPENBLAS_CORETYPE); " \
           "scipy's OpenBLAS 0.3.18 Prescott (SkylakeX by OPENBLAS_CORETYPE)" in text


def test_a_library_in_a_lib_folder_is_named_by_its_package():
    record = {"alone": [_lib("/env/scipy_openblas32/lib/libscipy_openblas.so", "0.3.34", "SkylakeX")],
              "core_type": None, "tried": []}
    assert envs.kernels_text(record) == "scipy_openblas32's OpenBLAS 0.3.34 SkylakeX"
    assert envs.kernels_text(None) == "not checked on this CPU"


def test_the_answer_opens_with_it_through_the_caveats():
    """The run's Answer says the fix (once), not a forced variable beside a kernel picked 'on its own'."""
    from harness.results import caveats

    fixes = [_lib(NUMPY_LIB, "0.3.20", "Prescott")]
    variables = {tuning.CORETYPE: {"value": "SkylakeX", "origin": "harness", "fixes": fixes}}
    said = caveats.lines(_meta(variables, [_lib(NUMPY_LIB, "0.3.20", "SkylakeX")]), [])
    assert f"{PINNED}'s OpenBLAS 0.3.20 does not know this CPU: its workers run SkylakeX by OPENBLAS_CORETYPE." in said
    assert not any("forced" in line for line in said)
