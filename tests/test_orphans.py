"""No process the harness starts outlives it: a runner killed with SIGKILL (which it cannot handle)
takes its workers with it, whatever they were doing (stopped while another was timed, compiling),
for a local run, a ``dask-local`` run and ``harness check`` of an isolated environment's backend.

Every process of a run is found through /proc by a token in its environment, which each process
the runner starts inherits."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.run import envs
from harness.worker import lifeline
from harness.cli import app

ROOT = Path(__file__).resolve().parent.parent
TOKEN_VAR = "HARNESS_TEST_RUN_TOKEN"

# two cells timed side by side: while one takes its rounds the other is stopped (SIGSTOP)
TIMED = """\
name: orphans
model: {kind: elman, hidden: 16, bias: false}
task: {kind: random, vocab: 20, seq_len: 5, n_sequences: 16, n_eval: 8}
workloads: [train_step]
batch: [1]
threads: [1]
backends: [numpy, native]
timing: {warmup: 1, min_rounds: 3, min_time_s: 60, max_time_s: 120, timeout_s: 120, verify: false}
"""

# a JAX backend that says when its compile starts and when it is done
JAX_MARKED = '''
import os
from backends.jax_backend import JaxBackend


class MarkedJax(JaxBackend):
    name = "jaxmarked"

    def _mark(self, what):
        with open(os.path.join(os.environ["ORPHAN_MARKS"], what), "w") as fh:
            fh.write(str(os.getpid()))

    def warm_up(self, batch):
        self._mark("compiling")
        super().warm_up(batch)
        self._mark("compiled")
'''


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _processes(token: str) -> dict[int, str]:
    """Every living process (not a zombie) whose environment carries ``token``: pid -> command line."""
    mark = f"{TOKEN_VAR}={token}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if mark not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if _state(pid) not in (None, "Z"):
            found[pid] = cmdline.strip()
    return found


def _workers(token: str) -> dict[int, str]:
    return {pid: cmd for pid, cmd in _processes(token).items() if "harness.worker" in cmd}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except OSError:
        return []


class Run:
    """A harness command in a subprocess, marked with a token of its own; anything of it still
    alive when the test ends is killed, so a failing test leaves nothing behind either."""

    def __init__(self, tmp_path, args, extra_env=None):
        self.token = uuid.uuid4().hex
        env = {**os.environ, TOKEN_VAR: self.token, **(extra_env or {})}
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], env=env, cwd=tmp_path,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def kill_when(self, ready, timeout_s: float = 90, what: str = "") -> None:
        """SIGKILL the runner as soon as ``ready()`` holds."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                out = self.proc.communicate()[0].decode(errors="replace")
                pytest.fail(f"never saw {what} (exit {self.proc.returncode}):\n{out[-3000:]}")
            time.sleep(0.02)
        self.proc.kill()
        self.proc.wait()

    def left_after(self, seconds: float = 20.0) -> dict[int, str]:
        """The processes of the run still alive ``seconds`` after the runner was killed (they go at once: the
        wait only gives a loaded machine's scheduler time to reap them, and ends as soon as none is left)."""
        deadline = time.monotonic() + seconds
        while (left := _processes(self.token)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in _processes(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.stdout.close()


@pytest.fixture
def start(tmp_path):
    runs = []

    def start(args, extra_env=None):
        runs.append(Run(tmp_path, args, extra_env))
        return runs[-1]

    yield start
    for run in runs:
        run.cleanup()


def test_a_killed_runner_takes_its_stopped_and_timed_workers_with_it(tmp_path, start):
    (tmp_path / "cfg.yaml").write_text(TIMED)
    run = start(["run", "cfg.yaml", "--out", "run", "--no-plots"])
    stopped = lambda: len(_workers(run.token)) == 2 and any(_state(p) == "T" for p in _workers(run.token))
    run.kill_when(stopped, what="a worker stopped while the other is timed")
    assert run.left_after() == {}
    # the run folder named the workers it had running (for a --resume where the kernel does not end them)
    recorded = json.loads((tmp_path / "run" / lifeline.WORKERS_FILE).read_text())["workers"]
    assert len(recorded) == 2
    # a process in the middle of exiting has let go of its environment (so it is not among those left)
    # before it turns zombie: give the scheduler the same time to finish it
    alive = lambda: [r for r in recorded if lifeline.start_ticks(r["pid"]) == r["start_ticks"]]
    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive() == []


def test_a_runner_killed_during_a_jax_compile_leaves_nothing(tmp_path, start):
    pytest.importorskip("jax")
    (tmp_path / "marked_jax.py").write_text(JAX_MARKED)
    (tmp_path / "cfg.yaml").write_text(TIMED.replace("[numpy, native]", "[jaxmarked]")
                                       .replace("kind: elman, hidden: 16", "kind: lstm, hidden: 64, layers: 2"))
    marks = tmp_path / "marks"
    marks.mkdir()
    run = start(["run", "cfg.yaml", "--out", "run", "--no-plots"],
                {"HARNESS_BACKENDS": "jaxmarked=marked_jax:MarkedJax", "ORPHAN_MARKS": str(marks),
                 "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache")})  # a cold cache: a real compile
    run.kill_when(lambda: (marks / "compiling").exists(), what="the JAX compile start")
    assert not (marks / "compiled").exists(), "the compile ended before the runner was killed"
    assert run.left_after() == {}


def test_a_killed_dask_local_run_takes_its_cluster_and_their_workers_with_it(tmp_path, start):
    pytest.importorskip("distributed")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a two-worker local cluster needs two cores")
    (tmp_path / "cfg.yaml").write_text(TIMED)
    run = start(["run", "cfg.yaml", "--out", "run", "--no-plots", "--executor", "dask-local", "--workers", "2"])
    stopped = lambda: any(_state(p) == "T" for p in _workers(run.token))
    run.kill_when(stopped, timeout_s=120, what="a worker stopped on a Dask worker")
    assert run.left_after() == {}


@pytest.mark.heavy  # Theano's environment and a check's scan-graph compiles
def test_a_killed_check_takes_its_isolated_environment_worker_with_it(tmp_path, start):
    if envs.env_python("theano") is None:
        ok, why = envs.can_create("theano")
        if not ok:
            pytest.skip(why)
        try:
            envs.ensure_env("theano")
        except Exception as exc:  # no network here: the environment cannot be built
            if os.environ.get("CI"):
                raise
            pytest.skip(f"the theano environment could not be built here: {exc}")
    run = start(["check", "--backends", "theano"])
    theano_python = str(envs.env_dir("theano"))

    def working():
        """The check's worker is in its environment's Python, well into its cases, and has no compiler
        running (a compiler it started finishes its file on its own)."""
        workers = [p for p, cmd in _workers(run.token).items() if cmd.startswith(theano_python)]
        return bool(workers) and time.monotonic() > seen.setdefault("at", time.monotonic()) + 1.0 \
            and not _children(workers[0])

    seen: dict = {}
    run.kill_when(working, what="the check's worker in the theano environment")
    assert run.left_after() == {}


def test_a_worker_whose_parent_died_before_it_started_exits_at_once(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    env = {**os.environ, lifeline.PARENT_VAR: str(gone.pid),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-m", "harness.worker"], input=b"", env=env, capture_output=True,
                           timeout=60, cwd=tmp_path)
    assert child.returncode == 1, child.stderr.decode()[-2000:]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_resume_ends_a_stale_worker_of_the_killed_run_by_its_recorded_pid(fake_backends, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(TIMED.replace("[numpy, native]", "[ref]").replace("min_time_s: 60, max_time_s: 120", "min_time_s: 0.02, max_time_s: 0.5"))
    first = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path / "run"), "--no-plots"])
    assert first.exit_code == 0, first.output
    assert not (tmp_path / "run" / lifeline.WORKERS_FILE).exists()  # a finished run has none running
    # as a killed runner on a platform without the kernel's guarantee leaves them: one worker still
    # running, and one recorded pid that now names another process (another start time)
    stale, other = _sleeper(), _sleeper()
    try:
        time.sleep(0.2)
        rows = [{"pid": stale.pid, "start_ticks": lifeline.start_ticks(stale.pid)},
                {"pid": other.pid, "start_ticks": lifeline.start_ticks(other.pid) - 1}]
        (tmp_path / "run" / lifeline.WORKERS_FILE).write_text(json.dumps({"runner": 1, "workers": rows}))
        resumed = CliRunner().invoke(app, ["run", str(cfg), "--resume", str(tmp_path / "run"), "--no-plots"])
        assert resumed.exit_code == 0, resumed.output
        text = " ".join(resumed.output.split())
        assert f"1 worker(s) of the interrupted runner were still running (pid {stale.pid}); ended them" in text
        assert stale.wait(timeout=30) == -signal.SIGKILL
        assert other.poll() is None
        assert not (tmp_path / "run" / lifeline.WORKERS_FILE).exists()
    finally:
        for p in (stale, other):
            p.kill()
            p.wait()


WATCHED_CHILD = """
import time
from harness.worker import lifeline
lifeline._kernel_guard = lambda: False  # as on a platform without prctl
assert lifeline.die_with_parent() == "watch"
print("ready", flush=True)
time.sleep(60)
"""
MIDDLE = """
import subprocess, sys, time
from harness.worker import lifeline
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=lifeline.child_environ(), stdout=sys.stdout)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_without_prctl_a_running_child_watches_its_parent_and_quits_with_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, WATCHED_CHILD], env=env, stdout=subprocess.PIPE, cwd=tmp_path)
    child = None
    try:
        child = int(middle.stdout.readline())
        assert middle.stdout.readline().strip() == b"ready"
        middle.kill()
        middle.wait()
        deadline = time.monotonic() + 20  # it looks twice a second; a loaded machine may run it late
        while _state(child) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(child) in (None, "Z")
    finally:
        middle.kill()
        middle.wait()
        middle.stdout.close()
        if child is not None and _state(child) not in (None, "Z"):
            os.kill(child, signal.SIGKILL)
