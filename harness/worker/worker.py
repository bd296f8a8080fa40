"""One benchmark cell in its own process: ``python -m harness.worker``.

Serves the requests of :mod:`harness.worker.protocol` (init, warmup, verify, calibrate, rounds,
train, check, gemm_peak, quit): one request per line on stdin, one framed reply per line
on the process's original stdout. Anything a library prints goes to stderr, which the
runner keeps the tail of. Every timed loop goes through :mod:`harness.worker.measure`. Imports
nothing but numpy, this package's numpy-only modules and the backend, so it runs in
isolated environments on numpy 1.23 too. A failed request answers ``status: error`` (or
``diverged``) and the worker stays alive.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import resource
import sys
import traceback
from contextlib import contextmanager
from dataclasses import asdict

from harness.worker import lifeline

# First of all: this process dies with the runner that started it, even one killed with SIGKILL
# while this worker is stopped, compiling or in a long step.
lifeline.die_with_parent()

# A cell with `threads: N` runs on N cores: the runner names them, and they are set before
# any library starts a thread pool (XLA's, for one, sizes its pool from the cores it may
# use and ignores the thread variables).
if os.environ.get("HARNESS_CPUS"):
    os.sched_setaffinity(0, {int(c) for c in os.environ["HARNESS_CPUS"].split(",")})

import numpy as np  # noqa: E402

from harness.worker import measure
from harness.worker import protocol  # noqa: E402
from harness.worker.training import DivergedError, TrainingLoop  # noqa: E402
from harness.spec.status import Status  # noqa: E402


def peak_rss_mb() -> float:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _digest(*parts) -> str:
    """A content hash of arrays, mappings of arrays and plain values (their repr)."""
    h = hashlib.sha256()
    for part in parts:
        items = sorted(part.items()) if isinstance(part, dict) else [("", part)]
        for name, value in items:
            h.update(name.encode() + b"\0")
            if isinstance(value, np.ndarray):
                h.update(f"{value.dtype.str}{value.shape}".encode())
                h.update(np.ascontiguousarray(value).tobytes())
            else:
                h.update(repr(value).encode())
            h.update(b"\0")
    return h.hexdigest()


def memoised(folder: str, compute, *key) -> dict:
    """``compute()`` (a mapping of names to arrays or floats), kept in ``folder`` under a hash of ``key``.

    The cells of one comparison group verify from the same parameters and data, so the reference's
    answer for the first serves the rest (on large models the reference step costs more than a cell's
    timing). A missing, unreadable or half-written entry is computed again; ``folder`` "" keeps nothing."""
    if not folder:
        return compute()
    path = os.path.join(folder, _digest(*key) + ".npz")
    try:
        with np.load(path) as found:
            return {k: (float(v) if v.ndim == 0 else v) for k, v in found.items()}
    except (OSError, ValueError, KeyError, EOFError):
        pass
    value = compute()
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as sink:
            np.savez(sink, **{k: np.asarray(v) for k, v in value.items()})
        os.replace(tmp, path)
    except OSError:
        pass  # nothing kept: the next cell computes it too
    return value


def verify_step(p, b, x, y, lr: float, memo: str = "") -> dict:
    """The next step (or forward pass) of backend ``b`` on problem ``p`` against the reference, on ``x, y``
    (:func:`harness.verify.judge.verify_step`), as the fields of :class:`protocol.VerifyReply`. The backend's
    own calls run with NumPy's huge-page advice on (:func:`hugepage_advice`); ``memo``: a folder keeping
    the reference's answers by their inputs (:func:`memoised`)."""
    from harness.verify import judge

    verdict = judge.verify_step(p, b, x, y, lr, keep=functools.partial(memoised, memo),
                                backend_calls=lambda: hugepage_advice(True))
    return verdict.reply()


@contextmanager
def hugepage_advice(on: bool):
    """NumPy's advice for transparent huge pages (a madvise on every array of 4 MiB or more) on or off inside.

    A verification's float64 reference arrays (and its float64 copies of the parameters) can be
    that large where the step's own are not: at WildML's Elman with vocabulary 2000 and batch 16
    its softmax is 5 MiB. Under the raised ``MALLOC_MMAP_THRESHOLD_`` they lie in the heap, which
    keeps them (``MALLOC_TRIM_THRESHOLD_``) and hands their huge pages on to the step's buffers:
    the timed steps then ran on memory that a plain process of the same step never gets (8 MiB
    of huge pages in the worker, none in the plain process). So the reference's work runs with
    the advice off, and the backend's own calls with it on, as in a plain process."""
    import importlib

    setter = None
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2.x, 1.x
        try:
            setter = importlib.import_module(module)._set_madvise_hugepage
            break
        except (ImportError, AttributeError):
            continue
    before = setter(on) if setter is not None else None
    try:
        yield
    finally:
        if setter is not None:
            setter(before)


class CellState:
    """The state of one cell in its worker: its backend, data and parameters."""

    def __init__(self, req: protocol.Init):
        import backends
        from backends.base import screen
        from harness.spec import reference
        from harness.spec.data import make_dataset
        from harness.spec.environments import worker_threads
        from harness.spec.model import Problem, TaskSpec

        self.problem = Problem.from_mapping(req.problem)
        self.task = TaskSpec.from_mapping(req.task)
        self.lr = float(req.lr)
        self.threads = worker_threads()
        self.backend = backends.create(req.backend)
        status, why = screen(self.backend, self.problem)
        if status != Status.OK:
            raise RuntimeError(why)
        self.data = make_dataset(self.task, self.problem.model, req.seed, self.problem.master_dtype)
        p = self.problem
        params = reference.init_params(p.model, p.input_size, p.output_size, req.seed, p.dtype)
        self.x, self.y = self.data.batch(np.arange(p.batch) % self.data.n_sequences)
        self.backend.prepare(p, params, device=p.device, threads=self.threads)
        self.last_loss = None

    def call(self) -> None:
        """One unit of the workload: an SGD step, or a forward pass."""
        if self.problem.workload == "forward":
            self.backend.forward(self.x)
        else:
            self.last_loss = self.backend.sgd_step(self.x, self.y, self.lr)

    def check_finite(self) -> None:
        """Raise DivergedError when the last step's loss is NaN or infinite."""
        if self.problem.workload != "forward" and self.last_loss is not None:
            loss = float(self.last_loss)
            if not math.isfinite(loss):
                raise DivergedError(f"loss became {loss}")

    def warmup(self, n: int, compile: bool = True) -> protocol.WarmUpReply:
        """Compile (timed as ``compile_s``, unless ``compile`` is false), then ``n`` untimed calls (timed
        together as ``warm_s``)."""
        compile_s = 0.0
        if compile:
            compile_s, _ = measure.time_once(lambda: self.backend.warm_up((self.x, self.y)), self.backend.sync)
        warm_s = measure.time_rounds(self.call, self.backend.sync, 1, n)[0] * n if n else 0.0
        self.check_finite()
        return protocol.WarmUpReply(compile_s, warm_s)

    def verify(self, memo: str = "") -> dict:
        """This cell's own next step (or forward pass) against the reference, on its own data
        (the fields of :class:`protocol.VerifyReply`). The reference's arrays leave no huge pages to the
        timed steps (:func:`hugepage_advice`)."""
        with hugepage_advice(False):
            return verify_step(self.problem, self.backend, self.x, self.y, self.lr, memo)

    def rounds(self, n: int, inner: int) -> list[float]:
        """``n`` rounds of ``inner`` calls each; seconds per call of each round."""
        return measure.time_rounds(self.call, self.backend.sync, n, inner, after_round=self.check_finite)

    def calibrate(self, round_s: float) -> protocol.CalibrateReply:
        """The inner loop count that makes one round last about ``round_s``."""
        one = self.rounds(1, 1)[0]
        return protocol.CalibrateReply(measure.calibrate(one, round_s), one)

    def evaluate(self) -> float:
        """Loss on the fixed evaluation set, in minibatches of the training batch size."""
        from harness.spec.data import eval_loss

        B, n_eval = self.problem.batch, self.data.x_eval.shape[1]
        total, count = 0.0, 0
        for j in range(0, n_eval - B + 1, B):
            x = np.ascontiguousarray(self.data.x_eval[:, j : j + B])
            y = np.ascontiguousarray(self.data.y_eval[:, j : j + B])
            out = np.asarray(self.backend.forward(x))
            total += eval_loss(self.problem.model, out, y) * B
            count += B
        return total / count

    def train(self, cfg: protocol.TrainSettings) -> protocol.TrainReply:
        """SGD epochs from the shared initial parameters (:class:`TrainingLoop`)."""
        return TrainingLoop(self.backend, self.data, self.problem.batch, self.evaluate, self.lr, cfg).run()


def _gemm_rate(req: protocol.GemmPeak) -> float:
    from harness.spec.environments import worker_threads
    from harness.worker.cpu_roofs import gemm_rate

    return gemm_rate(req.dtype, req.library, req.n, threads=worker_threads())


def _gpu_roofs(n: int) -> dict:
    from harness.worker.gpu_roofs import gpu_roofs

    return gpu_roofs(n)


def check(req: protocol.Check) -> list[dict]:
    """``harness check`` of one backend in this worker's environment: one result per case."""
    from harness.verify.check import case_list, check_backend

    cases = case_list(req.quick, req.representative)
    if req.index is not None:
        cases = cases[req.index: req.index + 1]
    return [asdict(r) for r in check_backend(req.backend, device=req.device, cases=cases)]


def _same_version(a: str, b: str) -> bool:
    """``1.0`` and ``1.0.0`` are one version (as pip's ``==`` reads them); the worker's environment may lack
    ``packaging``."""
    def norm(v: str) -> str:
        release, sep, rest = v.lower().lstrip("v").partition("+")
        while release.endswith(".0"):
            release = release[:-2]
        return release + sep + rest

    return norm(a) == norm(b)


def library_versions(backend) -> dict:
    """What the backend reports about its libraries, with the installed versions of its package and of
    every package its name pins. A pin this environment does not hold is an error: a pinned cell never
    runs, silently, on another version."""
    from importlib import metadata

    out = dict(backend.versions())
    for package in dict.fromkeys(p for p in (backend.package, *backend.pins) if p):
        try:
            got = metadata.version(package)
        except metadata.PackageNotFoundError:
            got = None
        want = backend.pins.get(package)
        if want is not None and (got is None or not _same_version(got, want)):
            raise RuntimeError(f"{backend.full_name} pins {package} {want}, but the worker's environment "
                               f"({sys.prefix}) has {got or 'no ' + package}")
        if got is not None:
            out.setdefault(package, got)
    return out


def _init(cell, req: protocol.Init) -> tuple[CellState, protocol.InitReply]:
    from harness.worker.blas_probe import kernels

    cell = CellState(req)  # its backend prepared: the libraries it calls are loaded
    return cell, protocol.InitReply(library_versions(cell.backend), sys.version.split()[0], cell.data.meta, kernels())


def _gemm_peak(req: protocol.GemmPeak) -> protocol.GemmPeakReply:
    from harness.worker.blas_probe import kernels

    return protocol.GemmPeakReply(_gemm_rate(req), kernels())


def _rounds(cell: CellState, req: protocol.Rounds) -> protocol.RoundsReply:
    samples = cell.rounds(req.n, req.inner)
    return protocol.RoundsReply(samples, None if cell.last_loss is None else float(cell.last_loss))


# requests that need no cell, and requests to the cell: cmd -> what answers it
_SERVICES = {
    "init": _init,
    "quit": lambda cell, req: (cell, protocol.QuitReply()),
    "gemm_peak": lambda cell, req: (cell, _gemm_peak(req)),
    "gpu_roofs": lambda cell, req: (cell, protocol.GpuRoofsReply(_gpu_roofs(req.n))),
    "check": lambda cell, req: (cell, protocol.CheckReply(check(req))),
}
_CELL_REQUESTS = {
    "warmup": lambda cell, req: cell.warmup(req.n, req.compile),
    "verify": lambda cell, req: protocol.VerifyReply(**cell.verify(req.memo)),
    "calibrate": lambda cell, req: cell.calibrate(req.round_s),
    "rounds": _rounds,
    "train": lambda cell, req: cell.train(req.settings),
}


def handle(cell: CellState | None, req: protocol.Request) -> tuple[CellState | None, object]:
    """Carry out one request; the (possibly new) cell state and the reply's body (of ``req.Body``)."""
    if req.cmd in _SERVICES:
        return _SERVICES[req.cmd](cell, req)
    if cell is None:
        raise RuntimeError(f"{req.cmd!r} before init")
    return cell, _CELL_REQUESTS[req.cmd](cell, req)


def serve(inp, out) -> None:
    """Answer requests until ``quit`` or end of input."""
    cell: CellState | None = None
    for line in inp:
        if not line.strip():
            continue
        req: protocol.Request | None = None
        try:
            req = protocol.decode_request(line)
            cell, body = handle(cell, req)
            reply = protocol.Reply(Status.OK, body)
        except DivergedError as exc:
            reply = protocol.Reply(Status.DIVERGED, error=str(exc))
        except Exception as exc:  # reported to the runner, which records the cell as an error
            from backends.base import error_text

            reply = protocol.Reply(Status.ERROR, error=error_text(exc), traceback=traceback.format_exc(limit=8))
        reply.peak_rss_mb = peak_rss_mb()
        out.write(protocol.encode_reply(reply) + "\n")
        out.flush()
        if isinstance(req, protocol.Quit):
            break


def main() -> None:
    """Serve on the original stdout, with file descriptor 1 (where libraries print) pointed at stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, proto)


if __name__ == "__main__":
    main()
