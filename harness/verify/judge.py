"""How a backend's answers are judged against the reference: one rule for ``harness check``'s cases
(:func:`harness.verify.check.run_case`) and for the check of a cell's own next step before it is timed
(:func:`verify_step`, which the worker serves).

:func:`judge` holds what both share: which quantities are compared (every one the reference gives),
the reference in float64 from the backend's starting parameters, the bound of
:mod:`harness.spec.tolerance` with its floors, the second run of the reference in the backend's own
dtype (from :meth:`Tolerance.starts`: as given, and nudged) and, under mixed precision, the run that
also rounds every product's result. Worker-safe: numpy, the spec layer and the backend only; what the
worker adds (a folder keeping the reference's answers, NumPy's huge-page advice around the backend's
own calls) comes in as callables.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Mapping

import numpy as np

from harness.spec import reference
from harness.spec.tolerance import Tolerance, update_floor, worst

#: ``reference(params, precision)``: name -> the reference's answer for every compared quantity, from
#: ``params`` with ``precision``'s roundings
Reference = Callable[[Mapping[str, np.ndarray], reference.Precision], Mapping[str, object]]
#: ``keep(compute, *key)``: ``compute()``, or its answer kept from an earlier call with the same key
Keep = Callable[..., Mapping[str, object]]


@dataclass(frozen=True)
class Verdict:
    """The ratio of every compared quantity to its bound, the worst of them, and the bound in words."""

    ratios: dict[str, float]
    worst: str
    ratio: float
    bound: str

    @property
    def ok(self) -> bool:
        """Every quantity within its bound."""
        return bool(self.ratio <= 1.0)

    def reply(self) -> dict:
        """The fields of the worker's verify reply (``protocol.VerifyReply``)."""
        return {"ok": self.ok, "worst": self.worst, "ratio": self.ratio, "bound": self.bound}


def tolerance(backend, problem) -> Tolerance:
    """The bound for ``backend`` on ``problem``: its dtype's, or the backend's own looser one."""
    return Tolerance.of(problem.dtype, backend.tolerance(problem))


def judge(tol: Tolerance, got: Mapping[str, object], want: Reference, start: Mapping[str, np.ndarray],
          dtype: str, loss_scale: float | None = None, floors: Mapping[str, object] | None = None) -> Verdict:
    """``got`` (name -> the backend's answer) against the reference ``want`` run from ``start`` (the
    parameters the backend started from, in its master dtype), under ``tol``.

    Every quantity ``want`` names is compared. The reference runs in float64 first; in ``dtype`` (with
    ``loss_scale``) only when :meth:`Tolerance.judge` asks for it, from each of :meth:`Tolerance.starts`;
    and, under mixed precision, with every product's result rounded too where a quantity still misses.
    ``floors``: name -> what rounding alone may add (see :func:`harness.spec.tolerance.update_floor`)."""
    low = reference.Precision.of(dtype, loss_scale)
    other = reference.Precision.of(dtype, loss_scale, outputs=True)  # read only under mixed precision
    exact = want(reference.params_like(start, np.float64), reference.EXACT)
    ratios = tol.judge({k: (got[k], exact[k]) for k in exact}, floors=floors,
                       low=lambda: [want(q, low) for q in tol.starts(start)],
                       other=lambda: want(start, other))
    name, ratio = worst(ratios)
    return Verdict(ratios, name, ratio, tol.describe())


def _compute(compute, *key):
    return compute()


def verify_step(p, b, x, y, lr: float, keep: Keep = _compute,
                backend_calls: Callable[[], ContextManager] = nullcontext) -> Verdict:
    """The next step (or forward pass) of backend ``b`` on problem ``p`` against the reference, on ``x, y``.

    For a step, the parameter *change* is compared with the reference's change from the same starting
    parameters, so a wrong gradient cannot hide behind a small learning rate; each change may differ by
    the roundings of applying it in place (:func:`update_floor`). ``keep(compute, *key)`` answers each run
    of the reference (the worker keeps them in a folder, by their inputs); ``backend_calls()`` is the
    context the backend's own calls run in (the worker's huge-page advice)."""
    tol = tolerance(b, p)
    start = reference.params_like(b.get_params(), p.master_dtype)  # a copy: the step may update views in place
    before = reference.params_like(start, np.float64)
    if p.workload == "forward":
        with backend_calls():
            got = {"outputs": b.forward(x)}
            b.sync()

        def outputs(params, precision):
            return keep(lambda: {"outputs": reference.outputs(p.model, params, x, precision=precision)},
                        "outputs", p.model, precision, params, x)

        return judge(tol, got, outputs, start, p.dtype, p.loss_scale)
    with backend_calls():
        loss = float(b.sgd_step(x, y, lr))  # a device scalar converts only through float() (Backend.sgd_step)
        b.sync()
    after = b.get_params()

    def changes(params, precision):  # each update from its own start (a nudged one too)
        def compute():
            base = reference.params_like(params, np.float64)
            want_loss, want = reference.sgd_step(p.model, params, x, y, lr, precision)
            return {"loss": want_loss} | {f"update of {k}": np.asarray(v, np.float64) - base[k] for k, v in want.items()}

        return keep(compute, "step", p.model, precision, lr, params, x, y)

    got = {"loss": loss} | {f"update of {k}": np.asarray(after[k], np.float64) - before[k] for k in before}
    floors = {f"update of {k}": v for k, v in update_floor(tol, p, before, x).items()}
    return judge(tol, got, changes, start, p.dtype, p.loss_scale, floors)
