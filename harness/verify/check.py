"""Conformance: every backend against the reference, before anything is timed.

Worker-safe (numpy + the backend only), because backends that live in an
isolated environment are checked there, by a worker that runs this module's
:func:`check_backend` (:mod:`harness.run.conformance`).
"""

from __future__ import annotations

import dataclasses
import itertools
import traceback
from dataclasses import dataclass, field

import numpy as np

from backends.base import error_text, supports
from harness.spec import reference as ref
from harness.spec.model import REDUCED_DTYPES, ModelSpec, Problem, master_dtype
from harness.spec.status import Status
from harness.spec.tolerance import SPEC_TOLERANCES as TOLERANCES, Tolerance, compare, worst  # noqa: F401  (re-exported)
from harness.verify.judge import judge, tolerance

LR = 0.1
N_STEPS = 3

CELLS = {
    "elman-tanh": {"kind": "elman", "activation": "tanh"},
    "elman-relu": {"kind": "elman", "activation": "relu"},
    "elman-sigmoid": {"kind": "elman", "activation": "sigmoid"},
    "lstm": {"kind": "lstm"},
    "lstm-peephole": {"kind": "lstm", "peephole": True},
    "gru": {"kind": "gru"},
    "gru-before": {"kind": "gru", "reset_after": False},
    # bidirectional layers (full BPTT only)
    "elman-tanh-bi": {"kind": "elman", "activation": "tanh", "bidirectional": True},
    "lstm-bi": {"kind": "lstm", "bidirectional": True},
    "lstm-peephole-bi": {"kind": "lstm", "peephole": True, "bidirectional": True},
    "gru-bi": {"kind": "gru", "bidirectional": True},
    "gru-before-bi": {"kind": "gru", "reset_after": False, "bidirectional": True},
}
#: the cells of the matrix before GRU and bidirectional layers: the quick matrix covers their pairs of factor
#: values; of the newer cells it takes each cell with each bptt mode and every other value once, so it stays small
FIRST_CELLS = ("elman-tanh", "elman-relu", "elman-sigmoid", "lstm", "lstm-peephole")
HEADS = {
    "softmax": {"head": "softmax_xent"},
    "mse": {"head": "mse", "output_act": "linear"},
    "mse-tanh": {"head": "mse", "output_act": "tanh"},
}
BPTTS = {"full": "full", "truncated:3": {"truncated": 3}, "tail:3": {"tail": 3}}
#: the mixed-precision cases of the quick matrix: (cell, head, bptt, tokens, dtype); the whole matrix has one
#: bfloat16 case per cell, head and bptt mode, and one float16 case per cell and bptt mode
QUICK_REDUCED = (("lstm", "softmax", "full", False, "bfloat16"), ("gru", "mse", "truncated:3", True, "bfloat16"),
                 ("elman-tanh", "mse-tanh", "full", False, "float16"))


@dataclass(frozen=True)
class Case:
    """One conformance problem: a model, its data shape and dtype, and the factors of the matrix it was
    built from, which its :attr:`label` names.

    A case of the matrix has a ``head`` and ``bptt`` (keys of HEADS and BPTTS) and its cell (a key of
    CELLS) as its ``name``; a realistic case's ``name`` is its model's; any other case's ``name`` is its
    label."""

    name: str
    model: ModelSpec
    tokens: bool
    input_size: int
    output_size: int
    seq_len: int
    batch: int
    dtype: str
    seed: int = 0
    loss_scale: float | None = None  # float16 only (None: the default)
    head: str | None = None  # a case of the matrix: a key of HEADS
    bptt: str | None = None  # a case of the matrix: a key of BPTTS
    realistic: bool = False  # one of the realistic shapes of :func:`_realistic`

    @property
    def label(self) -> str:
        """The case in words, as ``harness check`` and its results name it."""
        if self.realistic:
            text = f"realistic {self.name} {self._shape()}"
        elif self.head is not None:
            text = f"{self.name} {self.head} {self.bptt} {'tokens' if self.tokens else 'dense'} B={self.batch}"
            text += "" if self.model.bias else " nobias"
            text += f" L={self.model.layers}" if self.model.layers > 1 else ""
            text += f" clip={self.model.clip:g}" if self.model.clip else ""
        else:
            text = self.name
        return text + (f" scale={self.loss_scale:g}" if self.loss_scale is not None else "")

    @property
    def cell(self) -> str | None:
        """A case of the matrix: its cell (a key of CELLS); None for any other."""
        return self.name if self.head is not None else None

    def _shape(self) -> str:
        """A realistic case's sizes: a token model's as WildML's tutorial gives them (vocabulary x hidden,
        sequence length, BPTT), a dense one's with its layers and batch."""
        m = self.model
        if self.tokens:
            return f"{self.input_size}x{m.hidden} T={self.seq_len} {m.bptt}"
        layers = f"L={m.layers} " if m.layers > 1 else ""
        return f"{layers}D={self.input_size} H={m.hidden} T={self.seq_len} B={self.batch}"

    def problem(self, workload: str = "train_step", device: str = "cpu") -> Problem:
        return Problem(self.model, self.input_size, self.output_size, self.tokens, self.dtype,
                       self.batch, self.seq_len, device, workload, self.loss_scale)


@dataclass
class CaseResult:
    backend: str
    case: str
    dtype: str
    status: Status  # pass | fail | unsupported | error | unavailable
    reason: str = ""
    worst: str = ""  # the tensor closest to (or furthest past) its bound
    worst_ratio: float = 0.0  # max |got-ref| / bound over all tensors; <= 1 passes
    bound: str = ""
    details: dict = field(default_factory=dict)

    def __post_init__(self):
        self.status = Status(self.status)  # a word read back from JSON becomes the member


def _small(cell, head, bptt, tokens, dtype, batch, i) -> Case:
    """A case at the small shape, its options (biases, two layers, clipping) alternating with ``i``."""
    return _case(cell, head, bptt, tokens, dtype, batch, i, i % 3 != 2, 2 if i % 4 == 3 else 1, 0.5 if i % 5 == 4 else None)


def _case(cell, head, bptt, tokens, dtype, batch, seed, bias, layers, clip) -> Case:
    model = {**CELLS[cell], **HEADS[head], "hidden": 4, "bptt": BPTTS[bptt], "bias": bias, "layers": layers, "clip": clip}
    return Case(cell, ModelSpec.from_mapping(model), tokens, 5, 6, 7, batch, dtype, seed=seed, head=head, bptt=bptt)


def _variants(cases: list[Case]) -> list[Case]:
    """What the alternation of :func:`_small` leaves out: for each cell and input kind, a one-layer full-BPTT
    case in each of float64 and float32 with and without biases, where ``cases`` has none (its options follow
    the product's order, so dense float32 cases, for one, all have two layers). A backend that runs one layer
    of a cell with full BPTT is then checked in both dtypes, with and without biases."""
    have = {(c.cell, c.tokens, c.dtype, c.model.bias) for c in cases if c.bptt == "full" and c.model.layers == 1}
    out = []
    for k, (cell, tokens, dtype, bias) in enumerate(
        itertools.product(CELLS, (True, False), ("float64", "float32"), (True, False))
    ):
        if (cell, tokens, dtype, bias) not in have:
            out.append(_case(cell, list(HEADS)[k % len(HEADS)], "full", tokens, dtype, 3, 4000 + k, bias, 1, None))
    return out


def _realistic(dtype: str) -> list[Case]:
    wildml = ModelSpec.from_mapping({"kind": "elman", "hidden": 100, "bias": False, "bptt": {"truncated": 4}})
    wildml_full = ModelSpec.from_mapping({"kind": "elman", "hidden": 100, "bias": False})
    lstm = ModelSpec.from_mapping({"kind": "lstm", "hidden": 64, "head": "softmax_xent"})
    gru = ModelSpec.from_mapping({"kind": "gru", "hidden": 64, "head": "softmax_xent"})
    bigru = ModelSpec.from_mapping({"kind": "gru", "reset_after": False, "hidden": 64, "head": "mse",
                                    "bidirectional": True, "layers": 2})
    return [
        Case("wildml", wildml, True, 8000, 8000, 20, 1, dtype, seed=101, realistic=True),
        Case("wildml", wildml_full, True, 8000, 8000, 20, 1, dtype, seed=102, realistic=True),
        Case("lstm", lstm, False, 32, 50, 25, 16, dtype, seed=103, realistic=True),
        Case("gru", gru, False, 32, 50, 25, 16, dtype, seed=104, realistic=True),
        Case("gru-before-bi", bigru, False, 32, 32, 25, 16, dtype, seed=105, realistic=True),
    ]


def all_cases(quick: bool = False) -> list[Case]:
    """The conformance matrix; ``quick`` picks a pairwise-covering subset of it."""
    cases: list[Case] = []
    for i, (cell, head, bptt, tokens, dtype) in enumerate(
        itertools.product(CELLS, HEADS, BPTTS, (True, False), ("float64", "float32"))
    ):
        if _valid(cell, bptt):
            cases.append(_small(cell, head, bptt, tokens, dtype, 3, i))
    for j, (cell, head, bptt, dtype) in enumerate(itertools.product(CELLS, HEADS, BPTTS, ("float64", "float32"))):
        if _valid(cell, bptt):
            cases.append(_small(cell, head, bptt, True, dtype, 1, 1000 + j))
    if quick:
        first = [c for c in cases if c.cell in FIRST_CELLS]
        cases = _pairwise_subset(first) + _cell_bptt_subset([c for c in cases if c not in first])
    else:
        cases += _variants(cases)
    cases += _reduced(quick)
    for dtype in ("float64", "float32"):
        cases += _realistic(dtype)
    if not quick:
        for dtype in REDUCED_DTYPES:
            cases += [c for c in _realistic(dtype) if c.model.kind in ("lstm", "gru") and not c.model.bidirectional]
    return cases


def _reduced(quick: bool) -> list[Case]:
    """The mixed-precision cases at the small shape: QUICK_REDUCED, or one bfloat16 case per cell, head and
    bptt mode and one float16 case per cell and bptt mode (input kinds, and the options of :func:`_small`,
    alternating)."""
    if quick:
        # seeds 2001, 2004, 2007: with biases, one with clipping (the GRU), one with two layers (the Elman)
        return [_small(cell, head, bptt, tokens, dtype, 3, 2001 + 3 * i)
                for i, (cell, head, bptt, tokens, dtype) in enumerate(QUICK_REDUCED)]
    cases = []
    for i, (cell, head, bptt) in enumerate(itertools.product(CELLS, HEADS, BPTTS)):
        if _valid(cell, bptt):
            cases.append(_small(cell, head, bptt, i % 2 == 0, "bfloat16", 3, 2000 + i))
    for i, (cell, bptt) in enumerate(itertools.product(CELLS, BPTTS)):
        if _valid(cell, bptt):
            head = list(HEADS)[i % len(HEADS)]
            case = _small(cell, head, bptt, i % 2 == 1, "float16", 3, 3000 + i)
            # every other one with a loss scale of its own: train.loss_scale must reach the backend
            cases.append(case if i % 2 else with_loss_scale(case, FLOAT16_OTHER_SCALE))
    return cases


#: the loss scale of half the float16 cases of the whole matrix (the others have the default, 1024)
FLOAT16_OTHER_SCALE = 128.0


def with_loss_scale(case: Case, scale: float) -> Case:
    """``case`` with its own loss scale (float16), which its label then says."""
    return dataclasses.replace(case, loss_scale=scale)


def gru_or_bidirectional(case: Case) -> bool:
    """A GRU or bidirectional case (the backends that implement neither refuse these with their reason)."""
    return case.model.kind == "gru" or case.model.bidirectional


def one_direction_elman_lstm(cases: list[Case]) -> list[Case]:
    """The cases without a GRU or a bidirectional layer."""
    return [c for c in cases if not gru_or_bidirectional(c)]


def _valid(cell: str, bptt: str) -> bool:
    """A bidirectional layer needs full BPTT (SPEC.md)."""
    return bptt == "full" or not CELLS[cell].get("bidirectional")


def representative_cases() -> list[Case]:
    """A handful of cases covering every cell, head, bptt mode, input kind and dtype at least once
    (with no pairs): what CI runs for backends whose every case costs a compile. float32 and float64
    only: every compile-heavy backend refuses mixed precision (which tests/test_mixed_precision.py checks)."""
    cases = [c for c in all_cases(quick=True) if not c.realistic and c.dtype not in REDUCED_DTYPES]
    wanted = {(i, v) for c in cases for i, v in enumerate(_factors(c)[:5])}
    chosen: list[Case] = []
    while wanted:
        best = max(cases, key=lambda c: len({(i, v) for i, v in enumerate(_factors(c)[:5])} & wanted))
        chosen.append(best)
        wanted -= {(i, v) for i, v in enumerate(_factors(best)[:5])}
    return sorted(chosen, key=cases.index)


def _cell_bptt_subset(cases: list[Case]) -> list[Case]:
    """Greedy choice of cases until each (cell, bptt) pair and every other factor value occurs once."""
    def covers(c: Case) -> set:
        f = _factors(c)
        return {("cell+bptt", f[0], f[2])} | {(i, v) for i, v in enumerate(f) if i not in (0, 2)}

    wanted = set().union(*map(covers, cases)) if cases else set()
    chosen: list[Case] = []
    while wanted:
        best = max(cases, key=lambda c: len(covers(c) & wanted))
        chosen.append(best)
        wanted -= covers(best)
    return sorted(chosen, key=cases.index)


def _factors(case: Case) -> tuple:
    """What a case of the matrix varies: cell, head, bptt, input kind, dtype, batch, layers, bias."""
    return (case.cell, case.head, case.bptt, case.tokens, case.dtype, case.batch, case.model.layers, case.model.bias)


def _pairwise_subset(cases: list[Case]) -> list[Case]:
    """Greedy choice of cases until every pair of factor values that occurs is covered."""
    wanted = set()
    for c in cases:
        f = _factors(c)
        wanted |= {(a, f[a], b, f[b]) for a, b in itertools.combinations(range(len(f)), 2)}
    chosen: list[Case] = []
    while wanted:
        best = max(cases, key=lambda c: len(_pairs(c) & wanted))
        chosen.append(best)
        wanted -= _pairs(best)
    return sorted(chosen, key=cases.index)


def _pairs(case: Case) -> set:
    f = _factors(case)
    return {(a, f[a], b, f[b]) for a, b in itertools.combinations(range(len(f)), 2)}


def make_data(case: Case, step: int = 0):
    """Deterministic inputs and targets for a case (one batch per step)."""
    rng = np.random.default_rng([case.seed, step])
    T, B, D, O = case.seq_len, case.batch, case.input_size, case.output_size
    dtype = master_dtype(case.dtype)
    x = rng.integers(0, D, size=(T, B)) if case.tokens else rng.normal(size=(T, B, D)).astype(dtype)
    if case.model.head == "softmax_xent":
        y = rng.integers(0, O, size=(T, B))
    else:
        y = (0.5 * rng.normal(size=(T, B, O))).astype(dtype)
    return x, y


def initial_params(case: Case) -> dict[str, np.ndarray]:
    """Shared initial parameters, with small non-zero biases and peepholes so they are exercised."""
    params = ref.init_params(case.model, case.input_size, case.output_size, case.seed)
    rng = np.random.default_rng([case.seed, 99])
    for k, v in params.items():
        if v.ndim == 1:
            params[k] = rng.uniform(-0.1, 0.1, size=v.shape)
    return ref.params_like(params, master_dtype(case.dtype))


def reference_run(case: Case, params: dict[str, np.ndarray], dtype, forward: bool,
                  outputs_rounded: bool = False) -> dict[str, object]:
    """What the reference gives for every compared quantity of a case, computed in ``dtype`` (bfloat16,
    float16: in float32 with that type's roundings) from the same (already rounded) parameters and data:
    outputs, loss, gradients, step losses, parameters. ``outputs_rounded``: every product's result rounded too
    (not the spec's: what the mixed-precision bound reads, see :meth:`Tolerance.judge`)."""
    precision = ref.Precision.of(dtype, case.loss_scale, outputs_rounded)
    return _answers(case, ref.params_like(params, master_dtype(dtype)), precision, forward)


def _answers(case: Case, p: dict[str, np.ndarray], precision: ref.Precision, forward: bool) -> dict[str, object]:
    """:func:`reference_run` from parameters ``p`` as they are, with ``precision``'s roundings."""
    x, y = make_data(case)
    want: dict[str, object] = {}
    if forward:
        want["outputs"] = ref.outputs(case.model, p, x, precision)
    want["loss"], grads = ref.loss_and_grads(case.model, p, x, y, precision)
    want.update({f"d{k}": g for k, g in grads.items()})
    losses = []
    for step in range(N_STEPS):
        xs, ys = make_data(case, step)
        loss, p = ref.sgd_step(case.model, p, xs, ys, LR, precision)
        losses.append(loss)
    want["step losses"] = losses
    want.update({f"{k} after {N_STEPS} steps": v for k, v in p.items()})
    return want


def run_case(backend, case: Case, device: str = "cpu") -> CaseResult:
    """Conformance of one backend instance on one case: forward, loss + grads, 3 SGD steps, each judged
    against the reference (:func:`harness.verify.judge.judge`)."""
    full = backend.full_name
    res = CaseResult(full, case.label, case.dtype, Status.PASS)
    train = case.problem("train_step", device)
    ok, why = supports(backend, train)
    if not ok:
        res.status, res.reason = Status.UNSUPPORTED, why
        return res
    tol = tolerance(backend, train)
    res.reason, res.bound = tol.why, tol.describe()
    params = initial_params(case)
    x, y = make_data(case)
    got: dict[str, object] = {}
    try:
        fwd = case.problem("forward", device)
        if supports(backend, fwd)[0]:
            backend.prepare(fwd, ref.params_like(params, master_dtype(case.dtype)), device=device, threads=1)
            backend.warm_up((x, y))
            got["outputs"] = backend.forward(x)
        backend.prepare(train, ref.params_like(params, master_dtype(case.dtype)), device=device, threads=1)
        backend.warm_up((x, y))
        got["loss"], grads = backend.loss_and_grads(x, y)
        losses = []
        for step in range(N_STEPS):
            xs, ys = make_data(case, step)
            losses.append(float(backend.sgd_step(xs, ys, LR)))  # a device scalar converts through float()
        backend.sync()
        got["step losses"] = losses
        got_params = backend.get_params()
        for k in case.model.param_names():
            got[f"d{k}"] = grads.get(k, np.full(np.shape(params[k]), np.nan))  # a missing gradient fails
            got[f"{k} after {N_STEPS} steps"] = got_params[k]
        # the reference in float64 from the float32-rounded values, and (only when needed; always under mixed
        # precision) in the case's dtype
        forward = "outputs" in got
        verdict = judge(tol, got, lambda p, precision: _answers(case, p, precision, forward), params,
                        case.dtype, case.loss_scale)
    except Exception as exc:  # a crash is a result of the check, shown with its reason
        res.status = Status.ERROR
        res.reason = error_text(exc)
        res.details = {"traceback": traceback.format_exc(limit=6)}
        return res
    finally:
        backend.close()
    res.worst, res.worst_ratio = verdict.worst, verdict.ratio
    res.details = {"ratios": {k: float(v) for k, v in verdict.ratios.items()}}
    if not verdict.ok:
        res.status = Status.FAIL
        res.reason = f"{res.worst} off by {res.worst_ratio:.3g}x the bound"
    return res


def supported_subset(full_name: str, device: str = "cpu") -> list[Case] | None:
    """For a backend that supports none of the quick subset's cases (one that implements a corner of the spec,
    say a dense one-layer Elman cell): a pairwise-covering subset of the whole matrix's cases it supports (its
    cells, heads, input kinds, dtypes, biases, in pairs), then the realistic ones it supports. None when the
    quick subset holds a case it supports, when it supports no case at all, or when it cannot be asked here
    (its check then says why)."""
    import backends

    from backends.base import screen_device

    try:
        backend = backends.create(full_name)
        if screen_device(backend, device)[0] != Status.OK:
            return None

        def runs(case: Case) -> bool:
            return supports(backend, case.problem("train_step", device))[0]

        if any(runs(c) for c in all_cases(quick=True)):
            return None
        ok = [c for c in all_cases() if runs(c)]
    except Exception:  # a broken backend: its check says why
        return None
    if not ok:
        return None
    return _pairwise_subset([c for c in ok if c.cell is not None]) + [c for c in ok if c.cell is None]


def case_list(quick: bool = False, representative: bool = False) -> list[Case]:
    """The cases a check runs: a handful, the pairwise-covering subset, or the whole matrix."""
    return representative_cases() if representative else all_cases(quick)


def check_backend(full_name: str, quick: bool = False, device: str = "cpu", cases=None):
    """Yield one :class:`CaseResult` per case for ``name[:variant]`` (in this process)."""
    import backends

    from backends.base import screen_device

    backend = backends.create(full_name)
    status, why = screen_device(backend, device)
    if status != Status.OK:
        yield CaseResult(backend.full_name, "*", "*", status, why)
        return
    for case in cases if cases is not None else all_cases(quick):
        yield run_case(backend, case, device)
