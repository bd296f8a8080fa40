"""The runner's side of :mod:`harness.worker.protocol`: a worker subprocess, its environment, its failures.

Used by the runner (one worker per cell) and by ``harness check`` of a backend that lives in
an isolated environment, so both get the same timeouts, thread settings and failure statuses.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

from harness.config import memory_limit_mb
from harness.run import envs
# a worker's settings and process environment live with the environments they are built for
from harness.run.envs import CALLER, CONFIG, HARNESS, process_environ, worker_cpus, worker_settings  # noqa: F401
from harness.worker import lifeline, protocol
from harness.spec.status import Status

PROJECT_ROOT = Path(__file__).resolve().parents[2]
OOM_MARKERS = ("MemoryError", "std::bad_alloc", "out of memory", "OutOfMemory", "RESOURCE_EXHAUSTED")
# Plumbing every worker gets; not part of a cell's recorded environment.
PLUMBING_VARS = ("PYTHONUNBUFFERED",)


# Every worker this process started and has not yet ended: an interrupt kills them all, whichever
# phase (start, compile, warm-up, timing) it came in, so none runs on untimed and unsupervised.
_LIVE: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()


def live_workers() -> list["WorkerProcess"]:
    """The workers this process started and has not yet ended (the one registry of them)."""
    return list(_LIVE)


def kill_all_workers() -> int:
    """Kill every worker this process started that is still running; their number."""
    workers = list(_LIVE)
    for worker in workers:
        worker.kill()
        if not worker.stderr.closed:
            worker.stderr.close()
    return len(workers)


class Stop:
    """Which signal stopped a run (SIGINT unless another was caught) and the exit code it gives."""

    def __init__(self):
        self.signum = signal.SIGINT

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


@contextmanager
def stop_on_signals():
    """Within it SIGTERM and SIGHUP end a run as Ctrl-C does (KeyboardInterrupt, so every ``finally``
    runs and kills its workers); the :class:`Stop` it yields tells which signal and the exit code."""
    stop = Stop()

    def handler(signum, frame):
        stop.signum = signum
        raise KeyboardInterrupt

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class WorkerFailure(Exception):
    """A worker that crashed, hung, ran out of memory or reported an error."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def worker_environment(cell_backend: str, device: str, dtype: str, threads: int, extra: dict[str, str],
                       clean: bool = False, fix_kernel: bool = True) -> tuple[str | None, dict]:
    """The isolated environment name and the full process environment for one worker (``clean``: without
    the caller's variables that steer a numerical library, :func:`process_environ`)."""
    environment, settings = worker_settings(cell_backend, device, dtype, threads, extra, fix_kernel, clean)
    return environment, process_environ(environment, settings, extra, clean)[0]


def _oom_kills() -> int | None:
    """The kernel's count of OOM kills in this cgroup (cgroup v2), or None where unknown."""
    try:
        for line in Path("/sys/fs/cgroup/memory.events").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def classify_exit(code: int, tail: str, peak_rss_mb: float | None, limit_mb: float | None,
                  oom_killed: bool = False) -> WorkerFailure:
    """The failure of a worker that exited with ``code`` (negative: killed by that signal).

    ``oom`` only with evidence: an out-of-memory message in its stderr, or SIGKILL (what the
    kernel's OOM killer sends) together with the kernel's OOM-kill count having risen
    (``oom_killed``) or a peak RSS of at least 90% of the memory limit. A SIGKILL without such
    evidence came from someone else (a user, a supervisor) and is reported as such."""
    if any(m in tail for m in OOM_MARKERS):
        return WorkerFailure(Status.OOM, f"worker exited with code {code}; out of memory\n{tail}")
    if code < 0:
        sig = -code
        try:
            signame = signal.Signals(sig).name
        except ValueError:
            signame = f"signal {sig}"
        near_limit = peak_rss_mb is not None and limit_mb is not None and peak_rss_mb >= 0.9 * limit_mb
        if sig == signal.SIGKILL and (oom_killed or near_limit):
            rss = f", peak RSS {peak_rss_mb:.0f} of {limit_mb:.0f} MB" if near_limit else ", the kernel reports an OOM kill"
            return WorkerFailure(Status.OOM, f"worker killed by {signame}{rss}; out of memory\n{tail}")
        return WorkerFailure(Status.ERROR, f"worker killed by signal {sig} ({signame})\n{tail}")
    return WorkerFailure(Status.ERROR, f"worker exited with code {code}\n{tail}")


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (``T``: stopped), None when gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


class WorkerProcess:
    """A worker subprocess, talked to through :mod:`harness.worker.protocol`, with timeouts.

    ``env`` is its whole process environment; ``recorded`` the part of it the run chose
    (see :func:`worker_settings`), kept as ``.env`` for run.json."""

    def __init__(self, environment: str | None, env: dict, label: str, recorded: dict | None = None,
                 record: "lifeline.WorkerRecord | None" = None):
        python = str(envs.ensure_env(environment)) if environment else sys.executable
        self.label = label
        self.stderr = tempfile.TemporaryFile()
        self.stray: list[str] = []  # stdout lines that were not replies (kept for the error tail)
        self.peak_rss_mb: float | None = None
        self.oom_kills = _oom_kills()
        self.proc = subprocess.Popen([python, "-m", "harness.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=lifeline.child_environ(env), cwd=str(PROJECT_ROOT),
                                     start_new_session=True)
        _LIVE.add(self)
        self.record = record  # the run folder's list of live workers, for a --resume after a SIGKILL
        if record is not None:
            record.add(self.proc.pid)
        self.buf = b""
        self.paused = False
        self.in_flight = False  # a request sent whose reply is not read yet
        self.quitting = False  # answered a quit: exiting
        # what the run set for this worker (recorded with the cell), not what it inherited
        self.env = {k: v for k, v in (recorded or {}).items() if k not in PLUMBING_VARS}

    def stderr_tail(self, n: int = 20) -> str:
        """The last ``n`` lines the worker wrote to stderr, after any stray stdout lines."""
        self.stderr.flush()
        self.stderr.seek(0)
        lines = self.stray[-n:] + self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return "\n".join(lines[-n:])

    def request(self, req: protocol.Request, timeout_s: float) -> protocol.Reply:
        """Send one request and wait for its reply; WorkerFailure on an error, a death or a timeout.

        Until the reply is read the channel is out of step (``in_flight``): an interrupt in between
        leaves a reply unread, which :meth:`close` must not take for the answer to its own request."""
        self.in_flight = True
        try:
            self.proc.stdin.write((protocol.encode_request(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" not in self.buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.kill()
                    raise WorkerFailure(Status.TIMEOUT, f"no answer to {req.cmd!r} within {timeout_s:g} s\n{self.stderr_tail()}")
                ready, _, _ = select.select([fd], [], [], remaining)
                if not ready:
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise self._died()
                self.buf += chunk
            line, _, self.buf = self.buf.partition(b"\n")
            text = line.decode("utf-8", "replace")
            try:
                reply = protocol.decode_reply(text)
            except protocol.ProtocolError as exc:  # a broken channel: this cell fails, the run goes on
                self.kill()
                raise WorkerFailure(Status.ERROR, f"{exc}\n{self.stderr_tail()}") from None
            if reply is not None:
                break
            self.stray.append(text)
        self.in_flight = False
        self.peak_rss_mb = reply.peak_rss_mb
        if reply.status == Status.DIVERGED:
            raise WorkerFailure(Status.DIVERGED, reply.error)
        if reply.status != Status.OK:
            status = Status.OOM if any(m in reply.error for m in OOM_MARKERS) else Status.ERROR
            raise WorkerFailure(status, f"{reply.error}\n{reply.traceback}".strip())
        try:
            return protocol.typed(req, reply)
        except protocol.ProtocolError as exc:
            self.kill()
            raise WorkerFailure(Status.ERROR, f"{exc}\n{self.stderr_tail()}") from None

    def _died(self) -> WorkerFailure:
        code = self._reap(10.0)
        if code is None:
            self.kill()
            code = self.proc.returncode
        before, after = self.oom_kills, _oom_kills()
        oom_killed = before is not None and after is not None and after > before
        return classify_exit(code, self.stderr_tail(), self.peak_rss_mb, memory_limit_mb(), oom_killed)

    def _reap(self, timeout_s: float) -> int | None:
        """Wait for the worker's exit and take its peak RSS from the kernel's record of it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            except ChildProcessError:  # already reaped
                return self.proc.poll()
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.peak_rss_mb = max(self.peak_rss_mb or 0.0, usage.ru_maxrss / 1024.0)
                return self.proc.returncode
            time.sleep(0.01)
        return None

    def pause(self) -> None:
        """Stop the worker and everything it started (SIGSTOP to its process group) until :meth:`resume`.

        While another worker of its group is timed, an idle worker's library threads would
        otherwise go on spinning (OpenBLAS waits ~0.1 s of cycles for more work, libgomp ~300k
        spins) on the very cores the timed one needs; a team that meets at barriers stalls
        whenever one of its threads loses its core that way."""
        if self.paused:
            return
        self._signal(signal.SIGSTOP)
        self.paused = True
        # the signal is delivered asynchronously: wait until the kernel has stopped it (microseconds
        # on an idle machine; the stopped process must get a core to take the signal)
        deadline = time.monotonic() + 1.0
        while _process_state(self.proc.pid) not in ("T", "t", None) and time.monotonic() < deadline:
            time.sleep(0.0002)

    def resume(self) -> None:
        """Let a paused worker run again (SIGCONT); a no-op on one that is running."""
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        """Kill the worker and everything it started."""
        _LIVE.discard(self)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()
        if self.record is not None:
            self.record.remove(self.proc.pid)

    def close(self, wait: bool = True) -> None:
        """Ask the worker to quit; kill it when it does not, or when a request's reply is still unread
        (an interrupted request: the worker's next line answers that one, not the quit). With ``wait``
        false the worker is only asked (:func:`close_all`); a later ``close()`` waits for its exit."""
        self.resume()
        if self.proc.poll() is None and not self.in_flight and not self.quitting:
            try:
                self.request(protocol.Quit(), 10)
                self.quitting = True
            except WorkerFailure:
                pass
        if not wait:
            return
        if self.quitting:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.stderr.close()


def close_all(workers: list[WorkerProcess]) -> None:
    """Close several workers with their exits overlapping: every one is asked to quit before any is waited
    for (an interpreter that has loaded PyTorch or JAX takes up to a second to tear down on 2 cores)."""
    try:
        for w in workers:
            w.close(wait=False)
    finally:
        for w in workers:
            w.close()
