"""SPEC.md's Elman network as Halide Funcs: the forward recurrence of each layer, the head, and for the
training pipeline BPTT, every gradient and the SGD update (written to a second set of parameter buffers).
The batch and the sequence length are read from the input buffers, so one compile serves every ``(T, B)``.

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
"""

from __future__ import annotations

from backends.halide_pipelines.blocks import Blocks, Element, param_shapes
from harness.spec.model import Problem
from harness.spec.model import layer_suffix as _sfx


class ElmanGraph(Blocks):
    """The Funcs of one problem structure, scheduled as they are defined: inference's outputs, or with
    ``train`` the loss, the gradients and the updated parameters."""

    def __init__(self, hl, problem: Problem, train: bool, fast: bool, threads: int):
        super().__init__(hl, problem, fast, threads)
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

    # -- forward ------------------------------------------------------------------------
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
        return Element(h, 1)

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
        return Element(da, 1)

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
            self._vectorize(new, self.j, param_shapes(self.problem)[name][-1])
        return new
