"""How close to the reference a backend must come (docs/spec.md, "Conformance tolerances").

One rule for every comparison, ``harness check`` and the check before a cell is timed:
elementwise, per tensor, with ``m = max|ref|`` over the tensor,

    |got - ref| <= rtol |ref| + atol m + sensitivity |ref_low - ref| + floor

``ref`` is the reference in float64 on the backend's inputs. ``ref_low`` is the same
reference run in the backend's own dtype on the same inputs: where float32 rounding itself
moves the answer (a ReLU pre-activation within rounding of zero takes the other side of the
kink, a sum that cancels), every correct float32 computation moves with it, and the bound
widens there and nowhere else. Whether a given order of operations crosses a kink is a coin
toss, so ``ref_low`` is three runs (the backend's parameters as they are and two copies nudged
up and down by NUDGE = 32 eps, :func:`nudged`) and the bound takes the largest
``|ref_low - ref|`` of them: a backend that crossed where one run of the reference happened
not to is still within it, while an error in the maths moves every element, not a few. ``floor`` is an allowance the caller knows of, like the
rounding of an update applied to a parameter in place (:func:`update_floor`). In float64
``ref_low`` is ``ref``, so the float64 check is SPEC's alone.

Mixed precision (bfloat16, float16) is judged against ``ref_low``, the reference with the
spec's roundings (every product's inputs rounded, float32 elsewhere), and the bound is
derived from it: per tensor,

    |got - ref_low| <= rtol |ref_low| + atol m + floor + SPREAD max|ref_low - ref|

``max|ref_low - ref|`` is how far the spec's own roundings move that tensor from float64 on
these inputs; a backend that rounds at other points too (autocast keeps products' outputs in
bfloat16) moves by errors of that size, not of those values, so the allowance is per tensor
(docs/spec.md, "Conformance tolerances"). That allowance would also pass a backend that
ignores the dtype and computes in float32 (it lands one spread from ``ref_low``), so the
results must also lie nearer the roundings than float64: over all tensors (each scaled by
its largest reference value), the distance to ``ref_low`` at most ``NEARER`` times the
distance to ``ref``; a backend that rounds where the spec does or more lands there, one that
does not round lands near ``ref``, hundreds of times nearer.

Worker-safe: numpy and the reference only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from harness.spec.dtype import DType

# SPEC's bound: |got - ref| <= rtol * |ref| + atol * max|ref|
# (mixed precision: float32's bound for its float32 maths, plus SPREAD below; DType.tolerance)
SPEC_TOLERANCES = {d.value: d.tolerance for d in DType}
# How far a correct low-precision backend may be from float64, in multiples of the reference's
# own low-precision error at the same element: the backend and the reference round the same
# problem in different orders, so their errors share a size, not a value.
SENSITIVITY = 4.0
# Mixed precision: how far a correct backend may be from the reference with the spec's roundings, in
# multiples of how far those roundings move each tensor from float64 (its largest move over the tensor).
SPREAD = 3.4
# Mixed precision, where the bound above is missed: elementwise allowance of this many times how far rounding
# every product's result as well (autocast's way) moves the reference with the spec's roundings.
OUTPUTS_SENSITIVITY = 1.0
# Mixed precision: the results must lie no more than NEARER times farther from the reference with the spec's
# roundings than from float64 (root mean square over all tensors); see the module docstring.
NEARER = 10.0
# Roundings allowed to an update ``after - before`` that is applied to ``p`` at once: one
# rounding of ``p + step`` is at most eps/2 |p|; 4 eps |p| leaves room for a backend that
# forms ``p - lr g`` in two operations.
UPDATE_ROUNDINGS = 4.0

# How far :func:`nudged` moves each parameter, in units of the dtype's epsilon: enough for the move of
# a pre-activation to exceed its rounding noise (a sum of D terms rounds by ~eps sqrt(D) of their
# size, more where a blocked GEMM adds partial sums; the nudge moves it by ~NUDGE eps sqrt(D)), and
# small beside every tolerance (4 NUDGE eps = 1.5e-5 in float32, against rtol 1e-3).
NUDGE = 32.0

Tensors = Mapping[str, tuple[object, object]]  # name -> (got, want)
Lows = Mapping[str, object] | Sequence[Mapping[str, object]]  # one low-precision run per mapping


def nudged(params: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """``params`` as they are, then two copies with every element scaled by ``1 + s NUDGE eps`` and
    ``1 - s NUDGE eps`` (``s`` a fixed random sign per element, ``eps`` the dtype's). The pair is
    antithetic: a pre-activation within rounding of a kink moves by the same amount, larger than
    its rounding noise, once up and once down, so one of the two runs takes the side float64 did
    not, whichever side a backend's own rounding chose."""
    rng = np.random.default_rng(0)
    sign = {k: np.where(rng.random(np.shape(v)) < 0.5, -1.0, 1.0) for k, v in params.items()}
    out = [dict(params)]
    for direction in (1.0, -1.0):
        copy = {}
        for k, v in params.items():
            v = np.asarray(v)
            step = NUDGE * float(np.finfo(v.dtype).eps) if v.dtype.kind == "f" else 0.0
            copy[k] = (v * (1.0 + direction * step * sign[k])).astype(v.dtype)
        out.append(copy)
    return out


@dataclass(frozen=True)
class Tolerance:
    """The bound for one dtype; ``sensitivity`` is 0 where the reference runs at the backend's precision."""

    rtol: float
    atol: float  # times max|ref| over the tensor
    sensitivity: float
    eps: float  # machine epsilon of the parameters' dtype (float32 for the mixed-precision types)
    why: str = ""  # a backend's reason for a looser rtol/atol
    reduced: DType | None = None  # bfloat16 or float16: judged against the reference with its roundings
    spread: float = 0.0  # the mixed-precision allowance, in multiples of max|ref_low - ref| per tensor

    @classmethod
    def of(cls, dtype: str, custom: tuple[float, float, str] | None = None) -> "Tolerance":
        """The bound for ``dtype``; ``custom`` is a backend's own ``(rtol, atol, why)``."""
        dtype = DType.of(dtype)
        rtol, atol = dtype.tolerance
        why = ""
        if custom is not None:
            rtol, atol, why = custom
        eps = float(np.finfo(dtype.master.value).eps)
        if dtype.reduced:
            return cls(rtol, atol, 0.0, eps, why, reduced=dtype, spread=SPREAD)
        return cls(rtol, atol, 0.0 if dtype.double else SENSITIVITY, eps, why)

    @property
    def low_dtype(self) -> DType | None:
        """The dtype the reference must also run in (with that dtype's roundings: ``reference.Precision``),
        or None when float64 is the backend's own."""
        return self.reduced or (DType.FLOAT32 if self.sensitivity else None)

    def describe(self) -> str:
        """The bound as ``harness check`` and run.json show it."""
        if self.reduced:
            low = "ref_" + DType.of(self.reduced).short
            return (f"|got - {low}| <= {self.rtol:g}*|{low}| + {self.atol:g}*max|{low}| + {self.spread:g}*max|{low} - ref| "
                    f"per tensor (+ {OUTPUTS_SENSITIVITY:g}*|{low}_out - {low}| where missed), and RMS(got - {low}) <= "
                    f"{NEARER:g}*RMS(got - ref) ({low}: the reference with {self.reduced}'s roundings, _out: every "
                    f"product's result rounded too; ref: float64)")
        text = f"{self.rtol:g}*|ref| + {self.atol:g}*max|ref|"
        return text + (f" + {self.sensitivity:g}*|ref32 - ref|" if self.sensitivity else "")

    def ratio(self, got, want, want_low=None, floor=0.0) -> float:
        """``max |got - want| / bound`` over the tensor; above 1 is a mismatch."""
        return compare("", got, want, self.rtol, self.atol, floor, want_low, self.sensitivity)[0]

    def starts(self, params: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The parameters the low-precision reference runs from: under mixed precision the given ones
        (that run is the rule's reference); in float32 the given ones and their :func:`nudged` copies
        (that run is an allowance for kinks, whose sides are a coin toss)."""
        return [dict(params)] if self.reduced else nudged(params)

    def judge(self, tensors: Tensors, low: Callable[[], Lows] | None = None,
              floors: Mapping[str, object] | None = None,
              other: Callable[[], Mapping[str, object]] | None = None) -> dict[str, float]:
        """Ratio per tensor name. ``low()`` gives the low-precision reference per name, one run or a list
        of runs (from :meth:`starts`); it is called only when some tensor misses the bound without it, and
        always under mixed precision, whose reference it is (its first run). ``other()`` (mixed precision)
        gives the reference that also rounds every product's result: called only when some tensor misses
        the bound without it."""
        floors = floors or {}
        if self.reduced:
            if low is None:
                raise ValueError("mixed precision is judged against the reference with its roundings: pass low")
            lows = low()
            lows = lows if isinstance(lows, Mapping) else lows[0]

            def one(k, want_other=None):
                got, want = tensors[k]
                return compare_reduced(k, got, want, lows[k], self.rtol, self.atol, self.spread, floors.get(k, 0.0),
                                       want_other, OUTPUTS_SENSITIVITY)

            found = {k: one(k) for k in tensors}
            missed = [k for k, (r, _) in found.items() if 1.0 < r < float("inf")]
            if missed and other is not None:
                others = other()
                found.update({k: one(k, others[k]) for k in missed})
            ratios = {label: r for r, label in found.values()}
            ratios[ROUNDED] = rounded(tensors, lows) / NEARER
            return ratios

        def one(k, want_low=None):
            got, want = tensors[k]
            return compare(k, got, want, self.rtol, self.atol, floors.get(k, 0.0), want_low, self.sensitivity)

        found = {k: one(k) for k in tensors}
        missed = [k for k, (r, _) in found.items() if 1.0 < r < float("inf")]
        if missed and low is not None and self.sensitivity:
            lows = low()
            lows = [lows] if isinstance(lows, Mapping) else list(lows)
            found.update({k: one(k, [run[k] for run in lows]) for k in missed})
        return {label: r for r, label in found.values()}


def compare(name, got, want, rtol, atol_scale, floor=0.0, want_low=None, sensitivity=0.0):
    """``(max |got - want| / bound, label)`` with the bound ``rtol |want| + atol_scale max|want| + floor
    + sensitivity |want_low - want|``, elementwise (``want_low`` one array or a list of runs: the largest
    deviation counts); a ratio above 1 is a mismatch, and a wrong shape or a non-finite value (the
    backend's or the reference's) is ``inf`` with the label saying which."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf"), f"{name}: shape {got.shape} != {want.shape}"
    if not np.all(np.isfinite(got)):
        return float("inf"), f"{name}: non-finite values"
    if not want.size:
        return 0.0, name
    bound = rtol * np.abs(want) + atol_scale * float(np.abs(want).max()) + floor + 1e-300
    if want_low is not None and sensitivity:
        runs = want_low if isinstance(want_low, list) else [want_low]
        spread = np.max([np.abs(np.asarray(run, dtype=np.float64) - want) for run in runs], axis=0)
        bound = bound + sensitivity * spread
    with np.errstate(invalid="ignore"):  # inf/inf where the reference is non-finite: NaN, answered below
        ratio = float((np.abs(got - want) / bound).max())
    if np.isnan(ratio):  # a non-finite reference, or a bound made from one (compare_reduced's float64 run)
        return float("inf"), f"{name}: the reference is non-finite"  # NaN would pass some tests and order arbitrarily
    return ratio, name


def compare_reduced(name, got, want, want_low, rtol, atol_scale, spread, floor=0.0, want_other=None, sensitivity=0.0):
    """``(max |got - want_low| / bound, label)`` with the mixed-precision bound ``rtol |want_low| + atol_scale
    max|want_low| + floor + spread max|want_low - want| (+ sensitivity |want_other - want_low|)``: ``want_low``
    is the reference with the spec's roundings, ``want`` the float64 one, ``want_other`` the reference that
    also rounds every product's result (a shape or non-finite value as :func:`compare`)."""
    low = np.asarray(want_low, dtype=np.float64)
    moved = np.abs(low - np.asarray(want, dtype=np.float64))
    extra = spread * float(moved.max()) if moved.size else 0.0
    return compare(name, got, low, rtol, atol_scale, np.asarray(floor) + extra, want_other, sensitivity)


#: the name of the mixed-precision check that the roundings happened at all (:func:`rounded`)
ROUNDED = "rounding (results nearer float64 than the spec's roundings: computed without them?)"


def rounded(tensors: Tensors, lows: Mapping[str, object]) -> float:
    """``RMS(got - ref_low) / RMS(got - ref)`` over every tensor, each scaled by its ``max|ref|``: about 0
    for a backend that rounds where the spec does, below 1 for one that rounds there and elsewhere too
    (its own errors add to the roundings' move), and large for one that does not round at all."""
    near_low = near_ref = 0.0
    for k, (got, want) in tensors.items():
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if got.shape != want.shape or not np.all(np.isfinite(got)) or not want.size:
            continue  # compare_reduced reports these
        m = float(np.abs(want).max()) or 1.0
        near_low += float(np.mean(((got - np.asarray(lows[k], np.float64)) / m) ** 2))
        near_ref += float(np.mean(((got - want) / m) ** 2))
    return float(np.sqrt(near_low / near_ref)) if near_ref > 0 else (0.0 if near_low == 0 else float("inf"))


def update_floor(tol: Tolerance, problem, before: Mapping[str, np.ndarray], x) -> dict[str, np.ndarray]:
    """What rounding alone may add to each parameter's update ``after - before`` in the backend's dtype.

    A dense update ``p + step`` rounds once or twice at ``|p|``: ``4 eps |p|``. A token-input
    table may be updated one token occurrence at a time (a sparse embedding update adds each
    occurrence's share in place), so row ``v`` rounds once per occurrence of ``v`` in ``x``, each
    time at ``|p|`` rather than at the gradient's size. ``n`` roundings of at most ``eps/2 |p|``
    each stay below ``n eps/2 |p|`` whatever their signs, and they are not independent (a batch
    that repeats a sequence adds the same share again and again), so the allowance is the
    worst case, ``max(4, n_v) eps |p|``.
    """
    floors = {k: UPDATE_ROUNDINGS * tol.eps * np.abs(np.asarray(v, np.float64)) for k, v in before.items()}
    if problem.tokens:
        for table in problem.model.layer_shapes(0, problem.input_size):  # each direction's table
            if table.startswith(problem.model.input_weight):
                counts = np.bincount(np.asarray(x).ravel(), minlength=floors[table].shape[0])
                floors[table] = floors[table] * np.maximum(counts / UPDATE_ROUNDINGS, 1.0)[:, None]
    return floors


def worst(ratios: Mapping[str, float]) -> tuple[str, float]:
    """The tensor furthest past (or closest to) its bound, and its ratio."""
    name = max(ratios, key=ratios.get)
    return name, float(ratios[name])
