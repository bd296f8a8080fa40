"""The building blocks of the Halide pipelines and their schedules: the input and parameter buffers, the
float type's constants and activations, register-tiled products over all rows, weight and bias gradients
over chunks of rows, row reductions through ``rfactor``, and the domain and schedule of a recurrence
(:mod:`backends.halide_pipelines.elman` holds how the network is built from them).

Shapes use Halide's order, the reverse of NumPy's: ``x(d, b, t)``, ``W_xh(i, d)`` is NumPy's
``W_xh[d, i]``, and per-row tensors are 2-D ``(feature, n)`` with the row ``n = b + B*t``. Each block
is scheduled as it is defined: ``fast`` (the ``scheduled`` variant) tiles and vectorises it, with
``threads > 1`` in parallel; otherwise it keeps Halide's defaults (``compute_root`` only where an
update definition would be recomputed inline).
"""

from __future__ import annotations

from harness.spec.model import Problem

# tanh(a) = a * sum_k c_k a^(2k) for |a| < _TANH_SMALL: the first term left out is 2e-9 relative there
_TANH_SERIES = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925)
_TANH_SMALL = 0.3
#: rows per register tile of the row-by-weight products, and weight rows per tile of the gradients
_ROW_TILE = 4
_WGRAD_TILE = 8
#: rows (b, t) per chunk of a weight gradient's reduction
_WGRAD_ROWS = 64
#: batch rows per register tile of the recurrences
_BATCH_TILE = 4


def param_shapes(problem: Problem) -> dict[str, tuple[int, ...]]:
    """NumPy shapes of the parameters (SPEC.md layout)."""
    return problem.model.param_shapes(problem.input_size, problem.output_size)


def width(extent: int, vec: int) -> int:
    """The widest power-of-two vector, at most ``vec`` lanes, that fits ``extent``."""
    w = 1
    while w * 2 <= min(extent, vec):
        w *= 2
    return w


class Element:
    """One value of a Tuple-valued Func, indexed like a Func."""

    def __init__(self, func, index: int):
        self.func, self.index = func, index

    def __getitem__(self, args):
        return self.func[args][self.index]


class Blocks:
    """The pipeline's inputs (``x`` and the parameters) and the scheduled Funcs a network is built from."""

    def __init__(self, hl, problem: Problem, fast: bool, threads: int):
        self.hl, self.problem, self.spec = hl, problem, problem.model
        self.fast, self.par = fast, fast and threads > 1
        self.ft = hl.Float(8 * problem.dtype.n_bytes)  # float32 or float64 (supports() refuses the rest)
        self.target = hl.get_jit_target_from_environment()
        self.vec = self.target.natural_vector_size(self.ft)
        self.j, self.k, self.n, self.b, self.t = (hl.Var(v) for v in "jknbt")
        H, D = self.spec.hidden, problem.input_size
        if problem.tokens:
            self.x = hl.ImageParam(hl.Int(32), 2, "x")
        else:
            self.x = hl.ImageParam(self.ft, 3, "x")
            self.x.dim(0).set_bounds(0, D)
        nd = self.x.dimensions()
        self.B, self.T = self.x.dim(nd - 2).extent(), self.x.dim(nd - 1).extent()
        self.N = self.B * self.T
        self.p = {}
        for name, shape in param_shapes(problem).items():
            param = hl.ImageParam(self.ft, len(shape), name)
            for d, extent in enumerate(reversed(shape)):
                param.dim(d).set_bounds(0, extent)
            if len(shape) == 2:  # C-contiguous, so that the row stride is a constant
                param.dim(1).set_stride(shape[1])
            self.p[name] = param
        self.inputs = [self.x]
        self._rdoms = []
        self.inputs = [self.x]
        self._rdoms = []

    # -- small helpers ----------------------------------------------------------------
    def c(self, value: float):
        """A constant in the pipeline's float type (exact for float64)."""
        return self.hl.cast(self.ft, self.hl.f64(value))

    def _tanh(self, a):
        hl = self.hl
        if self.ft.bits() == 64:
            return hl.tanh(a)
        mag = hl.abs(a)
        e = hl.exp(mag * self.c(-2.0))
        large = (self.c(1.0) - e) / (self.c(1.0) + e)
        a2 = a * a
        poly = self.c(_TANH_SERIES[-1])
        for coef in reversed(_TANH_SERIES[:-1]):
            poly = poly * a2 + self.c(coef)
        r = hl.select(mag < self.c(_TANH_SMALL), mag * poly, large)
        return hl.select(a < self.c(0.0), -r, r)

    def _act(self, a):
        act = self.spec.activation
        if act == "tanh":
            return self._tanh(a)
        if act == "relu":
            return self.hl.max(a, self.c(0.0))
        return self.c(1.0) / (self.c(1.0) + self.hl.exp(-a))

    def _act_grad(self, h):
        """d act / d a from the output ``h = act(a)``, as the reference writes it."""
        act = self.spec.activation
        if act == "tanh":
            return self.c(1.0) - h * h
        if act == "relu":
            return self.hl.select(h > self.c(0.0), self.c(1.0), self.c(0.0))
        return h * (self.c(1.0) - h)

    def _row(self, n):
        """``(b, t)`` of row ``n``."""
        return n % self.B, n // self.B

    def _transpose(self, name: str, W):
        """``WT(j, k) = W(k, j)``; materialised in the scheduled variant so products read it contiguously."""
        hl = self.hl
        j, k = self.j, self.k
        WT = hl.Func(name)
        WT[j, k] = W[k, j]
        if self.fast:
            WT.compute_root()
        return WT

    def _vectorize(self, f, var, extent: int, stage=None):
        w = width(extent, self.vec)
        if w > 1 and stage is None:
            f.vectorize(var, w)
        elif w > 1:  # an update may not recompute points, so its last vector is masked instead
            stage.vectorize(var, w, self.hl.TailStrategy.GuardWithIf)

    # -- matrix products ----------------------------------------------------------------
    def _rows_mm(self, name: str, lhs, K: int, rhs, J: int, bias=None):
        """``out(j, n) = sum_k lhs(k, n) * rhs(j, k) (+ bias(j))`` over all N rows at once."""
        hl = self.hl
        j, n = self.j, self.n
        acc = hl.Func(name + "_acc")
        r = hl.RDom([hl.Range(0, K)], name + "_r")
        acc[j, n] = bias[j] if bias is not None else self.c(0.0)
        acc[j, n] = acc[j, n] + lhs(r.x, n) * rhs(j, r.x)
        out = hl.Func(name)
        out[j, n] = acc[j, n]
        if not self.fast:
            acc.compute_root()
            return out
        w = width(J, self.vec)
        tj = w * max(1, min(2, J // w))
        jo, ji, no, ni = hl.Var(name + "_jo"), hl.Var(name + "_ji"), hl.Var(name + "_no"), hl.Var(name + "_ni")
        out.compute_root()
        # the last row tile overlaps the one before it (rows recomputed, never read past N),
        # which needs N >= the tile: shorter inputs take one row per tile
        for rows, sched in ((_ROW_TILE, out.specialize(self.N >= _ROW_TILE)), (1, out)):
            sched.split(j, jo, ji, tj).split(n, no, ni, rows).reorder(ji, ni, jo, no)
            sched.vectorize(ji, w).unroll(ji).unroll(ni)
            if self.par:
                sched.parallel(no)
        acc.compute_at(out, jo).store_in(hl.MemoryType.Register)
        acc.vectorize(j, w).unroll(j).unroll(n)
        acc.update().reorder(j, n, r.x).vectorize(j, w).unroll(j).unroll(n)
        return out

    def _weight_grad(self, name: str, lhs, K: int, rhs, J: int):
        """``out(j, k) = sum_{b,t} lhs(k, b, t) * rhs(j, b, t)``: a weight gradient over all rows."""
        hl = self.hl
        j, k = self.j, self.k
        out = hl.Func(name)
        r = hl.RDom([hl.Range(0, self.B), hl.Range(0, self.T)], name + "_r")
        out[j, k] = self.c(0.0)
        out[j, k] = out[j, k] + lhs(k, r.x, r.y) * rhs(j, r.x, r.y)
        if not self.fast:
            return out
        w = width(J, self.vec)
        tj = w * max(1, min(2, J // w))
        tk = min(_WGRAD_TILE, K)
        jo, ji, ko, ki = hl.Var(name + "_jo"), hl.Var(name + "_ji"), hl.Var(name + "_ko"), hl.Var(name + "_ki")
        to, ti = hl.RVar(name + "_to"), hl.RVar(name + "_ti")
        # constant strides let LLVM keep a (tj x tk) tile in registers across a chunk of rows
        out.bound(j, 0, J).bound(k, 0, K)
        out.output_buffer().dim(1).set_stride(J)
        self._vectorize(out, j, J)
        step = out.update()
        guard = hl.TailStrategy.GuardWithIf
        # chunks of about _WGRAD_ROWS rows: every tile of the gradient passes over one chunk
        # while the chunk's inputs are still in cache
        step.split(r.y, to, ti, hl.max(1, _WGRAD_ROWS // self.B))
        step.split(j, jo, ji, tj, guard).split(k, ko, ki, tk, guard)
        step.reorder(ji, ki, r.x, ti, jo, ko, to)
        if w > 1:
            step.vectorize(ji, w)
        step.unroll(ji).unroll(ki)
        if self.par:
            step.parallel(ko)
        return out

    def _bias_grad(self, name: str, rhs, J: int):
        """``out(j) = sum_{b,t} rhs(j, b, t)``."""
        hl = self.hl
        j = self.j
        out = hl.Func(name)
        r = hl.RDom([hl.Range(0, self.B), hl.Range(0, self.T)], name + "_r")
        out[j] = self.c(0.0)
        out[j] = out[j] + rhs(j, r.x, r.y)
        if self.fast:
            self._vectorize(out, j, J)
            self._vectorize(out, j, J, stage=out.update())
        return out

    def _row_sum(self, name: str, f, extent: int, op: str = "add"):
        """``out(n) = sum_o f(o, n)`` (or the max), one reduction per row."""
        hl = self.hl
        n = self.n
        out = hl.Func(name)
        r = hl.RDom([hl.Range(0, extent)], name + "_r")
        if op == "max":
            out[n] = f(0, n)
            out[n] = hl.max(out[n], f(r.x, n))
        else:
            out[n] = self.c(0.0)
            out[n] = out[n] + f(r.x, n)
        out.compute_root()
        if self.fast:
            w = width(extent, self.vec)
            if w > 1:
                ro, ri = hl.RVar(name + "_ro"), hl.RVar(name + "_ri")
                # rfactor: w partial sums (maxima) per row, vectorised, then one horizontal step
                u = hl.Var(name + "_u")
                out.update().split(r.x, ro, ri, w, hl.TailStrategy.GuardWithIf)
                partial = out.update().rfactor(ri, u)
                partial.compute_at(out, n).vectorize(u)
                partial.update().vectorize(u)
            if self.par:
                out.parallel(n, 16)
                out.update().parallel(n, 16)
        return out

    # -- recurrences ---------------------------------------------------------------------
    def _step_domain(self, name: str, n_steps, first_step):
        """``(i, k, more, step)`` of a recurrence's update: per step, ``k`` runs over H+1 values,
        the last (``more`` false) finishing the step.

        The hidden index is split in the domain itself, ``i = io * TI + ii`` with ``ii``
        innermost and ``io`` outside ``k``: Halide keeps reduction variables in domain order,
        and this order lets one tile of ``i`` accumulate over ``k`` in registers.
        """
        hl = self.hl
        H = self.spec.hidden
        _, tile = self._hidden_tile()
        r = hl.RDom([hl.Range(0, tile), hl.Range(0, H + 1), hl.Range(0, H // tile), hl.Range(first_step, n_steps)], name)
        self._rdoms.append(r)
        return r.z * tile + r.x, hl.min(r.y, H - 1), r.y < H, r.w

    def _hidden_tile(self) -> tuple[int, int]:
        """``(vector width, tile)``: hidden units per vector and per register tile (both divide H)."""
        H = self.spec.hidden
        w = width(H, self.vec)
        while H % w:
            w //= 2
        mult = next(m for m in (4, 2, 1) if H % (w * m) == 0)
        return w, w * mult

    def _schedule_recurrence(self, f) -> None:
        """Scheduled: tiles of TI hidden units x 4 batch rows accumulate in registers; batch tiles in parallel."""
        hl = self.hl
        f.compute_root()
        if not self.fast:
            return
        w, _ = self._hidden_tile()
        r = self._rdoms[-1]
        # a constant row stride lets LLVM see that the tile's rows do not overlap
        f.bound(self.j, 0, self.spec.hidden)
        if w > 1:
            f.vectorize(self.j, w)
        step = f.update()
        # lanes of ii write (ii, b, t) and read only step t-1's finished state: no race,
        # which Halide's checker cannot prove on its own
        step.allow_race_conditions()
        bo, bi = hl.Var(f.name() + "_bo"), hl.Var(f.name() + "_bi")
        step.split(self.b, bo, bi, _BATCH_TILE, hl.TailStrategy.GuardWithIf)
        step.reorder(r.x, bi, r.y, r.z, r.w, bo)
        if w > 1:
            step.vectorize(r.x, w)
        step.unroll(r.x).unroll(bi)
        if self.par:
            step.parallel(bo)
