"""The small protocol every backend implements: docs/backends.md is the guide to it, docs/spec.md the network
it computes; and the screening of a backend against a problem. Naming, pins, revisions and environments
are the registry's (:mod:`backends.registration`), inherited, not written by a backend.

A backend never prints, reads config or times itself. Heavy libraries are
imported inside ``availability``/``prepare``, never at module import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backends.registration import Registration
from harness.spec.model import Problem
from harness.spec.status import Status


class Backend(Registration):
    """Base class: one implementation of the spec (docs/spec.md), with optional variants. Its body is what a
    plugin author writes: a name, its variants and devices, the cheap questions, and the work; how the
    registry names, pins and places an instance is :class:`backends.registration.Registration`'s."""

    name: str = ""
    #: the variants this backend understands; the first is the default
    variants: tuple[str, ...] = ("default",)
    #: devices it can run on at all (availability per device is checked at run time)
    devices: tuple[str, ...] = ("cpu",)
    #: the additions to the spec (SPEC_ADDITIONS) this backend's ``supports`` knows of: a problem that uses
    #: one it does not know (a plugin written before that addition) is unsupported without asking it
    knows: frozenset = frozenset()
    #: True when each new graph costs seconds to compile: ``harness check`` runs a
    #: representative subset in CI (``--quick``) and the whole matrix on request
    compile_heavy: bool = False

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        self.problem: Problem | None = None

    # -- cheap questions -------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        """Whether this backend can run here at all, and why not (no heavy import needed)."""
        return True, ""

    def device_availability(self, device: str) -> tuple[bool, str]:
        """Whether ``device`` can be used here; backends with a GPU path override this."""
        return self.supports_device(device)

    def supports(self, problem: Problem) -> tuple[bool, str]:
        """``(True, "")`` or ``(False, "unsupported: <why>")`` for this problem; by default, any problem
        on one of :attr:`devices`. An override starts with ``self.supports_device(problem.device)``."""
        return self.supports_device(problem.device)

    def supports_device(self, device: str) -> tuple[bool, str]:
        """Whether :attr:`devices` lists ``device`` (the one spelling of that refusal)."""
        if device in self.devices:
            return True, ""
        where = "the CPU only" if self.devices == ("cpu",) else f"{', '.join(self.devices)} only"
        return unsupported(f"{self.full_name} runs on {where} (device {device})")

    def tolerance(self, problem: Problem) -> tuple[float, float, str] | None:
        """Looser conformance bounds ``(rtol, atol_of_max, why)``, or None for the spec's (docs/spec.md, "Conformance tolerances")."""
        return None

    @classmethod
    def environment_variables(cls, variant: str, threads: int, device: str, dtype: str) -> dict[str, str]:
        """Variables the worker must set before importing this backend's library, beyond the thread
        counts: the harness sets every thread variable of BLAS and OpenMP (``OMP_NUM_THREADS``,
        ``OPENBLAS_NUM_THREADS``, ...) to the cell's ``threads`` for every backend, and hands the
        count to :meth:`prepare` for libraries that take it at run time."""
        return {}

    def versions(self) -> dict[str, str]:
        """Versions of the libraries this backend runs on (recorded in run.json)."""
        return {"numpy": np.__version__}

    # -- the work -------------------------------------------------------------------
    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        """Take the shared initial parameters and build whatever the step needs. Untimed."""
        raise NotImplementedError(f"{type(self).__name__} does not implement prepare()")

    def warm_up(self, batch: tuple[Any, Any]) -> None:
        """Compile / JIT for inputs shaped like ``batch = (x, y)``; timed as ``compile_s``."""

    def forward(self, x) -> np.ndarray:
        """Inference outputs (T, B, O): softmax probabilities, or the mse head's output."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward()")

    def loss_and_grads(self, x, y) -> tuple[float, dict[str, np.ndarray]]:
        """Reported loss and gradients of the objective, keyed like the parameters."""
        raise NotImplementedError(f"{type(self).__name__} does not implement loss_and_grads()")

    def sgd_step(self, x, y, lr: float):
        """Forward + BPTT + SGD update in place; returns the loss before the update.

        The loss is a float, or a 0-d array that ``float()`` converts: an asynchronous
        backend may hand back its device scalar instead of waiting for the step to finish.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement sgd_step()")

    def sync(self) -> None:
        """Wait for queued device work (block_until_ready, cuda synchronize)."""

    def get_params(self) -> dict[str, np.ndarray]:
        """Current parameters as NumPy arrays."""
        raise NotImplementedError(f"{type(self).__name__} does not implement get_params()")

    def close(self) -> None:
        """Release resources (threads, device memory)."""


def error_text(exc: BaseException) -> str:
    """An exception in one line, as results show it: ``Type: message``; one raised without a message (a bare
    ``raise NotImplementedError``) names the function, file and line it was raised at instead."""
    text = str(exc)
    if text:
        return f"{type(exc).__name__}: {text}"
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return f"{type(exc).__name__} (no message)"
    last = frames[-1]
    return f"{type(exc).__name__} (no message) raised in {last.name}() at {last.filename}:{last.lineno}"


def unsupported(why: str) -> tuple[bool, str]:
    """The one way to say no: ``(False, "unsupported: <why>")``."""
    return False, f"unsupported: {why}"


# The parts of the spec a backend runs only when it declares them: name -> (what it is, whether a problem
# uses it). A backend lists the names its ``supports`` knows of in ``knows``; a problem that uses one it
# does not list is unsupported without asking it.
SPEC_ADDITIONS = {
    "gru": ("the GRU cell", lambda p: p.model.kind == "gru"),
    "bidirectional": ("bidirectional layers", lambda p: p.model.bidirectional),
    "reduced": ("mixed precision (dtype bfloat16, float16)", lambda p: p.reduced),
}


def supports(backend: Backend, problem: Problem) -> tuple[bool, str]:
    """``backend.supports(problem)``, asked only about what the backend knows: a problem that uses a part of
    the spec (SPEC_ADDITIONS) the backend does not declare in ``knows`` is unsupported (a ``supports`` that
    never looks at ``model.kind`` or ``bidirectional`` could not tell such a problem from one it runs)."""
    for name, (what, used) in SPEC_ADDITIONS.items():
        if name not in backend.knows and used(problem):
            return unsupported(f"{backend.full_name} does not declare {what} (a backend that implements it lists "
                               f"{name!r} in its class's `knows`)")
    return backend.supports(problem)


def screen(backend: Backend, problem: Problem) -> tuple[Status, str]:
    """Whether ``backend`` can run ``problem`` here: ``(Status.OK, "")``, ``(Status.UNAVAILABLE, why)`` when
    this machine lacks it (library, device) or ``(Status.UNSUPPORTED, why)`` when the backend does.

    The one screening, in the order availability -> device -> supports; cheap (no heavy import)."""
    status, why = screen_device(backend, problem.device)
    if status != Status.OK:
        return status, why
    try:
        ok, why = supports(backend, problem)
    except Exception as exc:
        return Status.UNAVAILABLE, f"unavailable: supports() raised {type(exc).__name__}: {exc}"
    if not ok:
        return Status.UNSUPPORTED, why
    return Status.OK, ""


def screen_device(backend: Backend, device: str) -> tuple[Status, str]:
    """The first two steps of :func:`screen`: the backend's availability here, then ``device``:
    ``unsupported`` when the backend has no implementation for it, ``unavailable`` when this machine lacks it."""
    from harness.spec import environments

    try:
        ok, why = environments.reachable(backend.environment_name, backend.environment_recipe, backend.availability)
    except Exception as exc:  # a broken (e.g. third-party) backend is unavailable, never a crash
        return Status.UNAVAILABLE, f"unavailable: availability() raised {type(exc).__name__}: {exc}"
    if not ok:
        return Status.UNAVAILABLE, why
    ok, why = backend.supports_device(device)
    if not ok:
        return Status.UNSUPPORTED, why
    if device != "cpu":
        ok, why = backend.device_availability(device)
        if not ok:
            return Status.UNAVAILABLE, why
    return Status.OK, ""
