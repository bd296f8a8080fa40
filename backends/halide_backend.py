"""SPEC.md's Elman network as Halide pipelines, compiled through Halide's Python bindings.

One training step is **one** call into one compiled pipeline: forward over all
steps, the head, BPTT, every gradient and the SGD update (written to a second set
of parameter buffers, swapped after the call). The batch and the sequence length
are read from the input buffers, so one compile serves every ``(T, B)``. Inference
is a second, smaller pipeline. Shapes use Halide's order, the reverse of NumPy's:
``x(d, b, t)``, ``W_xh(i, d)`` is NumPy's ``W_xh[d, i]``, and per-row tensors are
2-D ``(feature, n)`` with the row ``n = b + B*t``.

The recurrence is an update definition over a reduction domain inside that pipeline, not a per-step
pipeline called T times from Python (:mod:`backends.halide_pipelines.elman` says why and how); the
pipelines are built in :mod:`backends.halide_pipelines`, and this module holds the class.

Variants share the Funcs and differ in schedules:

* ``scheduled`` (default): the recurrences register-tiled (:mod:`backends.halide_pipelines.elman`);
  the products outside them (input projection, logits, ``dz W_hy^T``, ``da W_xh^T``) register-tiled
  (vectorised along the output features, 4 rows unrolled, accumulators computed at the tile); the weight
  gradients tiled the same way over chunks of 64 rows (each chunk stays in cache while
  every tile passes over it); the head's row reductions vectorised through ``rfactor``;
  parameter and gradient buffers with constant row strides so LLVM keeps tiles in
  registers. With ``threads > 1`` (Halide's pool size comes from ``HL_NUM_THREADS``)
  the products, the recurrences (over batch tiles) and the elementwise stages run in
  parallel; with one thread the schedule has no parallel loops at all.
* ``naive``: Halide's default schedule, everything inline, except ``compute_root`` on
  every Func with an update definition (inline, each reduction would be recomputed at
  every point of its consumer), as an unscheduled algorithm runs.

Halide's float semantics allow FMA contraction and reassociation; the results meet
SPEC.md's tolerances. float32 ``tanh`` is ``(1 - e) / (1 + e)`` with ``e = exp(-2|a|)``
(an odd Taylor polynomial below ``|a| < 0.3``), within 3e-7 relative of the true value:
Halide's own float32 ``tanh`` calls libm once per lane, which does not vectorise.
float64 uses Halide's ``tanh``, which is libm's.

Compiled pipelines are kept on disk as Python extension modules built ahead of time
(:class:`backends.halide_pipelines.aot.Pipelines`): the first process pays the compile, later ones
load it.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from importlib.metadata import version

import numpy as np

from backends.base import Backend, unsupported
from backends.halide_pipelines.aot import Pipelines
from harness.spec.model import Problem

#: compiled pipelines kept per backend instance (the conformance check reuses structures)
_CACHE_SIZE = 8


class HalideBackend(Backend):
    """``halide``: SPEC.md's Elman network as scheduled Halide pipelines; ``halide:naive``: default schedules."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "halide"
    package = "halide"
    variants = ("scheduled", "naive")
    compile_heavy = True
    #: keep compiled pipelines as extension modules on disk (see :class:`backends.halide_pipelines.aot.Pipelines`); False: JIT only
    aot = True

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        self._cache: OrderedDict = OrderedDict()
        self._pipes: Pipelines | None = None
        self._params: list[dict[str, np.ndarray]] = []
        self._bufs: list[list] = []
        self._grads: dict[str, np.ndarray] = {}
        self._grad_bufs: list = []
        self._loss = np.zeros(1)
        self._loss_buf = None
        self._cur = 0

    def availability(self) -> tuple[bool, str]:
        """Halide's Python bindings must be importable."""
        if importlib.util.find_spec("halide") is None:
            return False, "unavailable: halide not installed (pip install 'rnn-harness[halide]')"
        return True, ""

    def supports(self, problem: Problem) -> tuple[bool, str]:
        """The Elman cell with full BPTT on the CPU, any head, activation, bias, depth and clip."""
        spec = problem.model
        ok, why = self.supports_device(problem.device)
        if not ok:
            return ok, why
        if spec.kind != "elman":
            return unsupported(f"{self.full_name} implements the elman cell only, not {spec.kind}")
        if spec.bidirectional:
            return unsupported(f"{self.full_name} implements one direction only: its pipelines run the recurrence forwards in time")
        if spec.bptt.mode != "full":
            return unsupported(f"{self.full_name} implements bptt full only, not {spec.bptt}")
        if problem.dtype.reduced:
            return unsupported(f"{self.full_name}'s pipelines are generated for float32 or float64 buffers; none "
                               f"rounds the products' inputs to {problem.dtype} (mixed precision is not written)")
        return True, ""

    @classmethod
    def environment_variables(cls, variant: str, threads: int, device: str, dtype: str) -> dict[str, str]:
        """Halide's thread pool reads its size when it first starts."""
        return {"HL_NUM_THREADS": str(threads)}

    def versions(self) -> dict[str, str]:
        """numpy and Halide versions."""
        return {"numpy": np.__version__, "halide": version("halide")}

    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        """Copy the parameters into two buffer sets (the step writes the other); find or make the pipelines."""
        import halide as hl

        self.problem = problem
        dtype = np.dtype(problem.dtype)
        names = problem.model.param_names()
        self._params = [{k: np.array(params[k], dtype=dtype, order="C") for k in names} for _ in range(2)]
        self._bufs = [[hl.Buffer(p[k]) for k in names] for p in self._params]
        self._grads = {k: np.zeros_like(v) for k, v in self._params[0].items()}
        self._grad_bufs = [hl.Buffer(self._grads[k]) for k in names]
        self._loss = np.zeros(1)
        self._loss_buf = hl.Buffer(self._loss)
        self._cur = 0
        parallel = self.variant == "scheduled" and threads > 1
        key = (self.variant, parallel, self.aot, problem.model, problem.input_size, problem.output_size, problem.tokens, problem.dtype)
        if key not in self._cache:
            self._cache[key] = Pipelines(hl, problem, self.variant == "scheduled", threads, self.aot)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        self._pipes = self._cache[key]

    def warm_up(self, batch) -> None:
        """Compile (or load) the pipelines this workload calls and run each once; parameters are unchanged."""
        x, y = batch
        if self.problem.workload != "train_step" or y is None:
            self.forward(x)
        if self.problem.workload != "forward" and y is not None:
            self._step(x, y, 0.0)

    # -- calls ------------------------------------------------------------------------
    def _x(self, x):
        import halide as hl

        p = self.problem
        x = p.cast_inputs(x, np.int32)
        if p.tokens and x.size and (x.min() < 0 or x.max() >= p.input_size):
            raise IndexError(f"token ids must lie in [0, {p.input_size})")
        return x, hl.Buffer(x)

    def _y(self, y):
        import halide as hl

        p = self.problem
        y = p.cast_targets(y, np.int32)
        if p.model.head == "softmax_xent" and y.size and (y.min() < 0 or y.max() >= p.output_size):
            raise IndexError(f"class ids must lie in [0, {p.output_size})")
        return y, hl.Buffer(y)

    def _step(self, x, y, lr: float) -> float:
        """Run the training pipeline: loss and gradients, and the updated parameters into the other set."""
        xs, xb = self._x(x)
        ys, yb = self._y(y)
        call = self._pipes.get("train")
        call(xb, yb, *self._bufs[self._cur], lr, self._loss_buf, *self._grad_bufs, *self._bufs[1 - self._cur])
        return float(self._loss[0])

    def forward(self, x) -> np.ndarray:
        """Softmax probabilities, or ``z`` / ``tanh(z)`` for the mse head, shaped (T, B, O)."""
        import halide as hl

        xs, xb = self._x(x)
        T, B = xs.shape[:2]
        out = np.empty((T, B, self.problem.output_size), self.problem.dtype)
        self._pipes.get("forward")(xb, *self._bufs[self._cur], hl.Buffer(out))
        return out

    def loss_and_grads(self, x, y):
        """Reported loss and the gradients of the objective, keyed like the parameters."""
        loss = self._step(x, y, 0.0)
        return loss, {k: v.copy() for k, v in self._grads.items()}

    def sgd_step(self, x, y, lr: float) -> float:
        """Forward, BPTT and the SGD update in one pipeline call; returns the loss before the update."""
        loss = self._step(x, y, lr)
        self._cur = 1 - self._cur
        return loss

    def get_params(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters."""
        return {k: v.copy() for k, v in self._params[self._cur].items()}

    def close(self) -> None:
        """Drop the parameter and gradient buffers (compiled pipelines stay cached on the instance)."""
        self._params, self._bufs, self._grads, self._grad_bufs = [], [], {}, []
        self._loss_buf = None
        self._pipes = None
