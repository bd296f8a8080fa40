"""SPEC.md's Elman network as Halide pipelines, compiled through Halide's Python bindings.

One training step is **one** call into one compiled pipeline: forward over all
steps, the head, BPTT, every gradient and the SGD update (written to a second set
of parameter buffers, swapped after the call). The batch and the sequence length
are read from the input buffers, so one compile serves every ``(T, B)``. Inference
is a second, smaller pipeline. Shapes use Halide's order, the reverse of NumPy's:
``x(d, b, t)``, ``W_xh(i, d)`` is NumPy's ``W_xh[d, i]``, and per-row tensors are
2-D ``(feature, n)`` with the row ``n = b + B*t``.

The recurrence is an update definition over a reduction domain, not a per-step
pipeline called T times from Python: each call costs tens of microseconds of Python
and buffer wrapping, twice per step, which is more than a whole training step costs
at the Sobel shape. The step's product cannot be a Func of its own either (it would
read the state and the state would read it: Halide rejects the cycle), and a Func
may read itself at another *pure* index only, so the hidden index is a reduction
variable and the state is a Tuple of (running sum, state)::

    h(i, b, t)  = (xa(i, b, t-1), act(xa(i, b, 0)) if t == 1 else 0)
    h(i, b, t) += (h.state(k, b, t-1) * W_hh(i, k), unchanged)   for k < H,   t in [2, T]
    h(i, b, t)  = (unchanged, act(sum))                          at k == H

with ``i = io*TI + ii`` spelled out in the domain (``ii``, ``k``, ``io``, ``t``):
Halide keeps reduction variables in domain order, and this one lets a tile of TI
hidden units x 4 batch rows accumulate over ``k`` in registers (the state, in its own
buffer, does not alias the sums). ``b`` stays a pure variable: rows are independent
and run in parallel. Halide's race check cannot prove that lanes of ``ii`` are
independent; they are (they write ``(i, b, t)`` and read only step t-1's finished
state), so the schedule says ``allow_race_conditions``. The backward recurrence over
``dL/da`` runs the same way in reverse time with ``W_hh`` transposed.

Variants share the Funcs and differ in schedules:

* ``scheduled`` (default): the recurrences as above; the products outside them (input
  projection, logits, ``dz W_hy^T``, ``da W_xh^T``) register-tiled (vectorised along the
  output features, 4 rows unrolled, accumulators computed at the tile); the weight
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
(see :class:`_Pipelines`): the first process pays the compile, later ones load it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections import OrderedDict
from importlib.metadata import version
from pathlib import Path

import numpy as np

from backends.base import Backend, unsupported
from harness.spec.model import Problem
from harness.spec.model import layer_suffix as _sfx

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
#: compiled pipelines kept per backend instance (the conformance check reuses structures)
_CACHE_SIZE = 8


def _param_shapes(problem: Problem) -> dict[str, tuple[int, ...]]:
    """NumPy shapes of the parameters (SPEC.md layout)."""
    return problem.model.param_shapes(problem.input_size, problem.output_size)


def _width(extent: int, vec: int) -> int:
    """The widest power-of-two vector, at most ``vec`` lanes, that fits ``extent``."""
    w = 1
    while w * 2 <= min(extent, vec):
        w *= 2
    return w


class _Element:
    """One value of a Tuple-valued Func, indexed like a Func."""

    def __init__(self, func, index: int):
        self.func, self.index = func, index

    def __getitem__(self, args):
        return self.func[args][self.index]


class _Graph:
    """The Funcs of one problem structure, scheduled as they are defined."""

    def __init__(self, hl, problem: Problem, train: bool, fast: bool, threads: int):
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
        for name, shape in _param_shapes(problem).items():
            param = hl.ImageParam(self.ft, len(shape), name)
            for d, extent in enumerate(reversed(shape)):
                param.dim(d).set_bounds(0, extent)
            if len(shape) == 2:  # C-contiguous, so that the row stride is a constant
                param.dim(1).set_stride(shape[1])
            self.p[name] = param
        self.inputs = [self.x]
        self._rdoms = []
        self.h = []
        for layer in range(self.spec.layers):
            self.h.append(self._forward_layer(layer))
        self.z = self._logits()
        if train:
            self._train()
        else:
            self.outputs = [self._outputs()]
        self.inputs += list(self.p.values())
        if train:
            self.inputs.append(self.lr)

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
        w = _width(extent, self.vec)
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
        w = _width(J, self.vec)
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
        w = _width(J, self.vec)
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
            w = _width(extent, self.vec)
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

    # -- forward ------------------------------------------------------------------------
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
        w = _width(H, self.vec)
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

    def _forward_layer(self, layer: int):
        """The hidden states ``h(i, b, t)``, t in [0, T], of one layer (h(., ., 0) = 0)."""
        hl = self.hl
        s, H = _sfx(layer), self.spec.hidden
        j, b, t, n = self.j, self.b, self.t, self.n
        W_xh, W_hh, b_h = self.p["W_xh" + s], self.p["W_hh" + s], self.p.get("b_h" + s)
        if layer == 0 and self.problem.tokens:
            D = self.problem.input_size
            xa = hl.Func("xa" + s)
            xb, xt = self._row(n)
            proj = W_xh[j, hl.clamp(self.x[xb, xt], 0, D - 1)]
            xa[j, n] = proj + b_h[j] if b_h is not None else proj
        elif layer == 0:
            xa = self._rows_mm("xa" + s, lambda k, n_: self.x[k, n_ % self.B, n_ // self.B], self.problem.input_size,
                               lambda j_, k: W_xh[j_, k], H, bias=b_h)
        else:
            below = self.h[layer - 1]
            xa = self._rows_mm("xa" + s, lambda k, n_: below[k, n_ % self.B, n_ // self.B + 1], H,
                               lambda j_, k: W_xh[j_, k], H, bias=b_h)
        h = hl.Func("h" + s)
        first = xa[j, b + self.B * hl.max(t - 1, 0)]
        # (running sum, state): the state of step t-1 sits in its own buffer, so the step's
        # accumulators stay in registers while the state is read
        h[j, b, t] = hl.Tuple([first, hl.select(t == 1, self._act(first), hl.likely(self.c(0.0)))])
        r = self._step_domain("rh" + s, self.T - 1, 2)
        ri, rk, more, rt = r
        acc, state = h[ri, b, rt][0], h[ri, b, rt][1]
        h[ri, b, rt] = hl.Tuple([hl.select(more, hl.likely(acc + h[rk, b, rt - 1][1] * W_hh[ri, rk]), acc),
                                 hl.select(more, hl.likely(state), self._act(acc))])
        self._schedule_recurrence(h)
        return _Element(h, 1)

    def _logits(self):
        """``z(o, n) = h_top(., n) W_hy + b_y``."""
        top, B = self.h[-1], self.B
        W_hy = self.p["W_hy"]
        return self._rows_mm("z", lambda k, n: top[k, n % B, n // B + 1], self.spec.hidden,
                             lambda j, k: W_hy[j, k], self.problem.output_size, bias=self.p.get("b_y"))

    def _softmax(self):
        """``(m(n), e(o, n), se(n))``: row maxima of z, ``exp(z - m)`` and its row sums."""
        hl = self.hl
        O, z = self.problem.output_size, self.z
        j, n = self.j, self.n
        m = self._row_sum("zmax", lambda o, n_: z[o, n_], O, op="max")
        e = hl.Func("e")
        e[j, n] = hl.exp(z[j, n] - m[n])
        if self.fast:
            e.compute_root()
            self._vectorize(e, j, O)
            if self.par:
                e.parallel(n, 8)
        return m, e, self._row_sum("zsum", lambda o, n_: e[o, n_], O)

    def _mse_out(self):
        """The mse head's output ``z`` or ``tanh(z)``."""
        out = self.hl.Func("out")
        out[self.j, self.n] = self._tanh(self.z[self.j, self.n]) if self.spec.output_act == "tanh" else self.z[self.j, self.n]
        return out

    def _head(self):
        """``(row_loss(n), dL/dz * B (o, n))`` as expressions in ``j``, ``n``; adds the target ``y`` input."""
        hl = self.hl
        O, z = self.problem.output_size, self.z
        j, n = self.j, self.n
        yb, yt = self._row(n)
        if self.spec.head == "softmax_xent":
            m, e, se = self._softmax()
            self._y = hl.ImageParam(hl.Int(32), 2, "y")
            y_n = hl.clamp(self._y[yb, yt], 0, O - 1)
            row_loss = m[n] + hl.log(se[n]) - z[y_n, n]
            return row_loss, e[j, n] / se[n] - hl.select(j == y_n, self.c(1.0), self.c(0.0))
        out = self._mse_out()
        self._y = hl.ImageParam(self.ft, 3, "y")
        self._y.dim(0).set_bounds(0, O)
        diff = hl.Func("diff")
        diff[j, n] = out[j, n] - self._y[j, yb, yt]
        if self.fast:
            diff.compute_root()
            self._vectorize(diff, j, O)
            if self.par:
                diff.parallel(n, 8)
        sq = self._row_sum("sq", lambda o, n_: diff[o, n_] * diff[o, n_], O)
        dz = diff[j, n]
        if self.spec.output_act == "tanh":
            dz = dz * (self.c(1.0) - out[j, n] * out[j, n])
        return self.c(0.5) * sq[n], dz

    def _outputs(self):
        """Inference output ``(o, b, t)``: softmax probabilities, or z / tanh(z)."""
        hl = self.hl
        j, b, t = self.j, self.b, self.t
        n = b + self.B * t
        if self.spec.head == "softmax_xent":
            _, e, se = self._softmax()
            value = e[j, n] / se[n]
        else:
            value = self._mse_out()[j, n]
        out = hl.Func("outputs")
        out[j, b, t] = value
        if self.fast:
            self._vectorize(out, j, self.problem.output_size)
            if self.par:
                out.parallel(t)
        return out

    # -- training -----------------------------------------------------------------------
    def _train(self):
        """Loss, every gradient and the SGD update as pipeline outputs."""
        hl = self.hl
        spec, B, T = self.spec, self.B, self.T
        H, O = spec.hidden, self.problem.output_size
        j, k, n, b, t = self.j, self.k, self.n, self.b, self.t
        row_loss, dz_raw = self._head()
        self.inputs.append(self._y)
        scale = self.c(1.0) / hl.cast(self.ft, B)
        dz = hl.Func("dz")
        dz[j, n] = dz_raw * scale
        if self.fast:
            dz.compute_root()
            self._vectorize(dz, j, O)
            if self.par:
                dz.parallel(n, 8)
        per_row = hl.Func("row_loss")
        per_row[n] = hl.cast(hl.Float(64), row_loss)
        rn = hl.RDom([hl.Range(0, self.N)], "rloss")
        total = hl.Func("loss_sum")
        total[k] = hl.f64(0.0)
        total[k] = total[k] + per_row[rn.x]
        total.compute_root()
        loss = hl.Func("loss")
        loss[k] = total[k] / hl.cast(hl.Float(64), self.N)
        grads = {}
        top = self.h[-1]
        grads["W_hy"] = self._weight_grad("d_W_hy", lambda k_, b_, t_: top[k_, b_, t_ + 1], H,
                                          lambda j_, b_, t_: dz[j_, b_ + B * t_], O)
        if spec.bias:
            grads["b_y"] = self._bias_grad("d_b_y", lambda j_, b_, t_: dz[j_, b_ + B * t_], O)
        W_hy_T = self._transpose("W_hy_T", self.p["W_hy"])
        up = self._rows_mm("dh_top", lambda k_, n_: dz[k_, n_], O, lambda j_, k_: W_hy_T[j_, k_], H)
        for layer in reversed(range(spec.layers)):
            s = _sfx(layer)
            da = self._backward_layer(layer, up)
            h = self.h[layer]
            grads["W_hh" + s] = self._weight_grad("d_W_hh" + s, lambda k_, b_, t_, h=h: h[k_, b_, t_], H,
                                                  lambda j_, b_, t_, da=da: da[j_, b_, t_], H)
            if layer == 0 and self.problem.tokens:
                grads["W_xh"] = self._token_grad(da)
            else:
                din = self.problem.input_size if layer == 0 else H
                below = (lambda k_, b_, t_: self.x[k_, b_, t_]) if layer == 0 else \
                    (lambda k_, b_, t_, hb=self.h[layer - 1]: hb[k_, b_, t_ + 1])
                grads["W_xh" + s] = self._weight_grad("d_W_xh" + s, below, din,
                                                      lambda j_, b_, t_, da=da: da[j_, b_, t_], H)
            if spec.bias:
                grads["b_h" + s] = self._bias_grad("d_b_h" + s, lambda j_, b_, t_, da=da: da[j_, b_, t_], H)
            if layer > 0:
                W_xh_T = self._transpose("W_xh_T" + s, self.p["W_xh" + s])
                up = self._rows_mm("dh" + _sfx(layer - 1), lambda k_, n_, da=da: da[k_, n_ % B, n_ // B], H,
                                   lambda j_, k_, W=W_xh_T: W[j_, k_], H)
        self.lr = hl.Param(self.ft, "lr")
        updates = []
        for name in self.p:
            updates.append(self._sgd(name, grads[name]))
        self.outputs = [loss] + [grads[name] for name in self.p] + updates

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

    def _token_grad(self, da):
        """The embedding's gradient: row ``x[t, b]`` of ``W_xh`` gathers ``da[t, b]`` (a scatter-add)."""
        hl = self.hl
        j, k = self.j, self.k
        H, D = self.spec.hidden, self.problem.input_size
        out = hl.Func("d_W_xh")
        r = hl.RDom([hl.Range(0, self.B), hl.Range(0, self.T)], "d_W_xh_r")
        out[j, k] = self.c(0.0)
        row = hl.clamp(self.x[r.x, r.y], 0, D - 1)
        out[j, row] = out[j, row] + da[j, r.x, r.y]
        if self.fast:
            self._vectorize(out, j, H)
            self._vectorize(out, j, H, stage=out.update())
        return out

    def _backward_layer(self, layer: int, up):
        """``da(i, b, t) = dL/da_t`` of one layer, from ``up(i, n)`` = dL/dh_t coming from above."""
        hl = self.hl
        s, H = _sfx(layer), self.spec.hidden
        j, b, t = self.j, self.b, self.t
        B, T = self.B, self.T
        h = self.h[layer]
        W_hh_T = self._transpose("W_hh_T" + s, self.p["W_hh" + s])
        da = hl.Func("da" + s)
        u = up[j, b + B * t]
        da[j, b, t] = hl.Tuple([u, hl.select(t == T - 1, u * self._act_grad(h[j, b, T]), hl.likely(self.c(0.0)))])
        ri, rj, more, rs = self._step_domain("rda" + s, T - 1, 0)
        ts = T - 2 - rs
        w = W_hh_T[ri, rj]
        acc, value = da[ri, b, ts][0], da[ri, b, ts][1]
        da[ri, b, ts] = hl.Tuple([hl.select(more, hl.likely(acc + da[rj, b, ts + 1][1] * w), acc),
                                  hl.select(more, hl.likely(value), acc * self._act_grad(h[ri, b, ts + 1]))])
        self._schedule_recurrence(da)
        return _Element(da, 1)

    def _sgd(self, name: str, grad):
        """``p - lr * clip(g)``, written to a second parameter buffer."""
        hl = self.hl
        param = self.p[name]
        dims = [self.j, self.k][: param.dimensions()]
        g = grad[dims]
        if self.spec.clip is not None:
            g = hl.clamp(g, self.c(-self.spec.clip), self.c(self.spec.clip))
        new = hl.Func("new_" + name)
        new[dims] = param[dims] - self.lr * g
        if self.fast:
            self._vectorize(new, self.j, _param_shapes(self.problem)[name][-1])
        return new


def aot_dir() -> Path:
    """Where ahead-of-time compiled pipelines live, shared by every process of the harness."""
    from harness.spec.environments import cache_dir

    return cache_dir("halide")


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """This file's hash: a cached module built from other Funcs or schedules is never loaded."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _runtime_object(hl, folder: Path) -> Path:
    """Halide's runtime compiled once for this target, linked into every extension module."""
    target = hl.get_host_target()
    tag = hashlib.sha256(repr((version("halide"), str(target))).encode()).hexdigest()[:16]
    path = folder / f"halide_runtime_{tag}.o"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            obj = Path(tmp) / path.name
            hl.compile_standalone_runtime(str(obj), target)
            os.replace(obj, path)
    return path


def _build_extension(hl, pipeline, inputs, name: str, folder: Path) -> Path:
    """Compile ``pipeline`` ahead of time into the Python extension module ``folder/name``; returns its path."""
    cxx = shutil.which("c++") or shutil.which("g++")
    include = Path(sysconfig.get_paths()["include"])
    if cxx is None or not (include / "Python.h").exists():
        raise RuntimeError("building a Halide extension needs a C++ compiler and Python's headers")
    runtime = _runtime_object(hl, folder)
    final = folder / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        obj, src, lib = Path(tmp) / (name + ".o"), Path(tmp) / (name + ".py.cpp"), Path(tmp) / final.name
        files = {hl.OutputFileType.object: str(obj), hl.OutputFileType.python_extension: str(src)}
        pipeline.compile_to(files, inputs, name, hl.get_host_target().with_feature(hl.TargetFeature.NoRuntime))
        # the wrapper only unpacks arguments: -O1 compiles it in a third of -O2's time
        cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{include}", f"-I{Path(hl.__file__).parent / 'include'}",
               f"-DHALIDE_PYTHON_EXTENSION_MODULE_NAME={name}", str(src), str(obj), str(runtime), "-o", str(lib),
               "-lpthread", "-ldl"]
        subprocess.run(cmd, check=True, capture_output=True)
        os.replace(lib, final)  # atomic: a concurrent worker sees the whole module or none
    return final


def _load_extension(path: Path, name: str):
    """The pipeline function of a built extension module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


class _Pipelines:
    """Compiled pipelines for one problem structure: inference and the training step.

    With ``aot``, each pipeline is compiled ahead of time into a Python extension module
    under :func:`aot_dir` (named by a hash of this file, the Halide version and target, the
    schedule and the problem's structure) and later processes load it in milliseconds;
    without a C++ compiler it falls back to the JIT. ``how[which]`` says which happened.
    """

    def __init__(self, hl, problem: Problem, fast: bool, threads: int, aot: bool):
        self.hl, self.problem, self.fast, self.threads, self.aot = hl, problem, fast, threads, aot
        self._compiled: dict[str, object] = {}
        self.how: dict[str, str] = {}

    def _name(self, which: str) -> str:
        p = self.problem
        parts = (_source_digest(), version("halide"), str(self.hl.get_host_target()), self.fast, self.fast and self.threads > 1,
                 which, p.model, p.input_size, p.output_size, p.tokens, p.dtype)
        return f"rnn_halide_{which}_" + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]

    def get(self, which: str):
        """The compiled ``forward`` or ``train`` pipeline, compiled (or loaded) on first use."""
        if which in self._compiled:
            return self._compiled[which]
        hl = self.hl
        name = self._name(which)
        built = aot_dir() / (name + sysconfig.get_config_var("EXT_SUFFIX"))
        if self.aot and built.exists():
            self._compiled[which], self.how[which] = _load_extension(built, name), "aot-load"
            return self._compiled[which]
        graph = _Graph(hl, self.problem, which == "train", self.fast, self.threads)
        pipeline = hl.Pipeline(graph.outputs)
        if self.aot:
            try:
                path = _build_extension(hl, pipeline, graph.inputs, name, aot_dir())
                self._compiled[which], self.how[which] = _load_extension(path, name), "aot-build"
                return self._compiled[which]
            except (OSError, RuntimeError, subprocess.CalledProcessError):
                pass  # no compiler, headers or writable cache here: the JIT computes the same
        self._compiled[which] = pipeline.compile_to_callable(graph.inputs, hl.get_jit_target_from_environment())
        self.how[which] = "jit"
        return self._compiled[which]


class HalideBackend(Backend):
    """``halide``: SPEC.md's Elman network as scheduled Halide pipelines; ``halide:naive``: default schedules."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "halide"
    package = "halide"
    variants = ("scheduled", "naive")
    compile_heavy = True
    #: keep compiled pipelines as extension modules on disk (see :class:`_Pipelines`); False: JIT only
    aot = True

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        self._cache: OrderedDict = OrderedDict()
        self._pipes: _Pipelines | None = None
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
            self._cache[key] = _Pipelines(hl, problem, self.variant == "scheduled", threads, self.aot)
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
