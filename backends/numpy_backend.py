"""NumPy backends: a vectorised implementation of all of SPEC.md, and the WildML tutorial loop.

``numpy`` (variant ``fast``) works over buffers allocated once per ``(T, B)``:
the input projections of every step are one GEMM (a row gather for token ids),
each step costs one recurrent GEMM plus a few in-place ufuncs, and the weight
gradients are single GEMMs over all steps. ``truncated: K`` runs one backward
sweep that carries the K+1 outputs whose windows are open as a stack of rows
(a ring indexed by ``t mod (K+1)``), so it is still one GEMM per step.

The GRU keeps r and z in the slots of their pre-activations and, per step, costs one
recurrent GEMM forward (two before the reset: ``(r * h) W_hn`` needs r first) and one
backward (two before the reset). A bidirectional layer runs the same code on the
time-reversed input for its reverse direction (full BPTT only, so one window).

Mixed precision (``bfloat16``, ``float16``) is the spec's own roundings: every product's
inputs are rounded to the low type (``reference.round_to``) and multiplied in float32, which
holds each product of two such numbers exactly and sums them in float32; everything else runs
in float32, as for ``float32``. It rounds the same values as the reference, in another
summation order, except under truncated BPTT: it sums the open windows' gradients before their
weight-gradient product, where the reference rounds each window's; either moves a result by
less than half the bound. NumPy has no low-precision GEMM, so this
is an emulation: it shows what the roundings do to a result, not what they save in time.

``numpy:wildml`` is the WildML ``RNNNumpy`` tutorial code (one sentence at a
time, ``np.outer`` per step, the O(T*K) ``bptt_truncate`` walk): the
historical baseline every other backend is compared against.
"""

from __future__ import annotations

import numpy as np

from backends.base import Backend, unsupported
from harness.spec.model import Problem
from harness.spec.reference import round_to
from harness.spec.model import layer_suffix as _sfx


def _sigmoid_(a: np.ndarray) -> None:
    """In place ``1 / (1 + exp(-a))``, the reference's formula."""
    np.negative(a, out=a)
    np.exp(a, out=a)
    np.add(a, 1, out=a)
    np.reciprocal(a, out=a)


class _Layer:
    """One recurrent layer's parameters (shared with the owner, updated in place) and buffers."""

    def __init__(self, net: "_Fast", layer: int, direction: int = 0):
        spec, p, s = net.spec, net.params, _sfx(layer, direction)
        self.index, self.direction = layer, direction
        self.lstm, self.gru = spec.kind == "lstm", spec.kind == "gru"
        self.reset_after = self.gru and spec.reset_after
        self.in_name = spec.input_weight + s
        self.hh_name = "W_hh" + s
        self.b_name = (spec.bias_name + s) if spec.bias else None
        self.bhn_name = "b_hn" + s if self.reset_after and spec.bias else None
        self.peep_names = tuple(k + s for k in ("p_i", "p_f", "p_o")) if spec.peephole else None
        self.W_in, self.W_hh = p[self.in_name], p[self.hh_name]
        self.b = p[self.b_name] if self.b_name else None
        self.b_hn = p[self.bhn_name] if self.bhn_name else None
        if self.peep_names:
            self.p_i, self.p_f, self.p_o = (p[k] for k in self.peep_names)
            self.p_if = np.empty((2, spec.hidden), net.dtype)  # refreshed each call: p_i, p_f stacked
        self.sparse_input = layer == 0 and net.problem.tokens
        self.single = not spec.bidirectional

    def allocate(self, T: int, B: int, S: int, H: int, top: bool, dtype) -> None:
        """Buffers for sequences of length T, batch B and S open truncation windows."""
        G = (4 if self.lstm else 3 if self.gru else 1) * H
        e = lambda *shape: np.empty(shape, dtype)  # noqa: E731
        self.a = e(T, B, G)  # pre-activations, then (LSTM) the gate activations i, f, ., o, (GRU) r, z, .
        self.h = np.zeros((T + 1, B, H), dtype)  # h[0] = h_{-1} = 0 is never written
        self.das = e(T, S, B, G)  # per-window dL/da (S = 1 unless truncated)
        self.das_rows = self.das.reshape(T, S * B, G)
        self.da = self.das[:, 0] if S == 1 else e(T, B, G)  # summed over windows
        self.dh = e(S, B, H)
        self.dh_rows = self.dh.reshape(S * B, H)
        # dL/dh from above: the output layer's (T, B, H), or the layer above's per-window (T, S, B, H).
        # With few rows, OpenBLAS computes W_hy dz^T (H x T*B) markedly faster than dz W_hy^T,
        # so the top layer then keeps it transposed and reads it through a strided view.
        self.up_t = e(H, T * B) if top and T * B < H and self.single else None
        if self.up_t is not None:
            self.up = self.up_t.T.reshape(T, B, H)
        else:
            self.up = e(T, B, H) if top else e(T, S, B, H)
        if self.lstm:
            self.tmp_bh, self.tmp_sbh, self.tmp_tbh, self.tmp_b2h = e(B, H), e(S, B, H), e(T, B, H), e(B, 2, H)
            self.gates5 = self.a.reshape(T, B, 4, H)
            self.das5 = self.das.reshape(T, S, B, 4, H)
            self.c = np.zeros((T + 1, B, H), dtype)
            self.g = e(T, B, H)  # tanh of the g gate (its slot in ``a`` holds a discarded sigmoid)
            self.tc = e(T, B, H)  # tanh(c_t)
            self.rec = e(B, G)
            self.k_o = e(T, B, H)  # dL/da_o = dh * k_o
            self.k_c = e(T, B, H)  # dc += dh * k_c
            self.k_ifg = e(T, B, 3, H)  # (dL/da_i, dL/da_f, dL/da_g) = dc * k_ifg
            self.f_c = e(T, B, H) if self.peep_names else self.gates5[:, :, 1]  # dc_{t-1} = dc * f_c
            self.dc = e(S, B, H)
            self.dc_wide = self.dc[:, :, None, :]
        elif self.gru:
            self.gates4 = self.a.reshape(T, B, 3, H)
            self.das4 = self.das.reshape(T, S, B, 3, H)
            self.rec = e(B, G)
            self.n = e(T, B, H)
            self.un = e(T, B, H) if self.reset_after else None  # h_{t-1} W_hn + b_hn
            self.rh = np.zeros((T, B, H), dtype) if not self.reset_after else None  # r * h_{t-1}
            self.k_n, self.k_z, self.k_r = e(T, B, H), e(T, B, H), e(T, B, H)  # dL/da_n = dh k_n, ...
            self.du = e(S, B, G)  # the recurrent side's dL/du: (da_r, da_z, da_n r) after the reset
            self.du4 = self.du.reshape(S, B, 3, H)
            self.du_rows = self.du.reshape(S * B, G)
            self.tmp_sbh, self.tmp_tbh = e(S, B, H), e(T, B, H)
            self.tmp_rows = self.tmp_sbh.reshape(S * B, H)
            self.du_all = e(T, B, G)
        else:
            self.act_grad = e(T, B, H)


class _Buffers:
    """Everything sized by ``(T, B)``: per-layer buffers, the head's, the window layout."""

    def __init__(self, net: "_Fast", T: int, B: int):
        spec = net.spec
        bptt = spec.bptt.effective(T)
        mode, K = bptt.mode, bptt.k
        self.truncated = mode == "truncated"
        self.S = K + 1 if self.truncated else 1
        self.t0 = T - K if mode == "tail" else 0
        self.T, self.B = T, B
        N, O = T * B, net.problem.output_size
        for layer in net.layers:
            layer.allocate(T, B, self.S, spec.hidden, layer.index == spec.layers - 1, net.dtype)
        # a bidirectional layer's output [h_t, h_t_rev] (row 0 zero, as h[0]) and its dL/d output
        self.outs = [np.zeros((T + 1, B, 2 * spec.hidden), net.dtype) for _ in range(spec.layers)] \
            if spec.bidirectional else None
        self.ups = np.empty((T, B, 2 * spec.hidden), net.dtype) if spec.bidirectional else None
        self.z = np.empty((N, O), net.dtype)
        self.rows = np.arange(N)
        self.m = np.empty(N, net.dtype)
        self.s = np.empty(N, net.dtype)
        self.ones = np.ones(O, net.dtype)  # row sums as a GEMV: several times faster than np.sum here
        self.r = np.empty(N, net.dtype)
        self.diff = np.empty((N, O), net.dtype) if spec.output_act == "tanh" else None


def _matmul(problem: Problem):
    """``np.matmul`` (with ``out``) as the problem's products are computed: under mixed precision of the
    inputs rounded to the low type, in float32."""
    if not problem.reduced:
        return np.matmul
    low = problem.dtype

    def matmul(a, b, out=None):
        with np.errstate(invalid="ignore"):  # inf * 0 after a float16 overflow: sgd_step reports it as NaN
            return np.matmul(round_to(a, low), round_to(b, low), out=out)

    return matmul


class _Fast:
    """SPEC.md vectorised over steps and batch, in the problem's dtype, over reused buffers."""

    def __init__(self, problem: Problem, params: dict[str, np.ndarray]):
        self.problem = problem
        self.spec = problem.model
        self.dtype = np.dtype(problem.master_dtype)
        self.mm = _matmul(problem)  # every product of the network (the head's row sums are not products)
        self.scale = problem.objective_scale  # float16's loss scale, else 1
        self.one = self.dtype.type(1)
        self.params = {k: np.array(params[k], dtype=self.dtype, order="C") for k in self.spec.param_names()}
        self.bi = self.spec.bidirectional
        if self.bi:  # layer l's directions are layers[2l], layers[2l + 1]
            self.layers = [_Layer(self, layer, d) for layer in range(self.spec.layers) for d in (0, 1)]
        else:
            self.layers = [_Layer(self, layer) for layer in range(self.spec.layers)]
        self.W_hy = self.params["W_hy"]
        self.b_y = self.params.get("b_y")
        # gradient buffers; each token embedding's gradient stays as rows (see sgd_step)
        self.sparse = [lay for lay in self.layers if lay.sparse_input]
        self.grads = {k: np.empty_like(v) for k, v in self.params.items()
                      if k not in {lay.in_name for lay in self.sparse}}
        self.buf: _Buffers | None = None
        self.sparse_rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    # -- inputs and buffers ----------------------------------------------------------
    def _inputs(self, x, y=None):
        x = self.problem.cast_inputs(x)
        if y is not None:
            y = self.problem.cast_targets(y)
        T, B = x.shape[:2]
        if self.buf is None or (self.buf.T, self.buf.B) != (T, B):
            self.buf = _Buffers(self, T, B)
        return x, y

    # -- forward ---------------------------------------------------------------------
    def _run_layers(self, x) -> np.ndarray:
        """Forward through every layer; returns the top layer's h (T+1, B, H) (bidirectional: its
        [h, h_rev], (T+1, B, 2H)), row 0 zero."""
        inp = x
        for layer in self.layers:
            seq = inp[::-1] if layer.direction == 1 else inp
            if layer.lstm:
                self._lstm_forward(layer, seq)
            elif layer.gru:
                self._gru_forward(layer, seq)
            else:
                self._elman_forward(layer, seq)
            if layer.direction == 1:
                out, H = self.buf.outs[layer.index], self.spec.hidden
                np.copyto(out[1:, :, :H], self.layers[2 * layer.index].h[1:])
                np.copyto(out[1:, :, H:], layer.h[:0:-1])
                inp = out[1:]
            elif not self.bi:
                inp = layer.h[1:]
        return self.buf.outs[-1] if self.bi else self.layers[-1].h

    def _project(self, layer: _Layer, inp) -> np.ndarray:
        """``inp W_in (+ b)`` for every step at once: one row gather or one GEMM."""
        a = layer.a
        if layer.sparse_input:
            # mode="raise" would buffer the whole output; the ids are range-checked here instead
            if inp.size and (inp.min() < 0 or inp.max() >= layer.W_in.shape[0]):
                raise IndexError(f"token ids must lie in [0, {layer.W_in.shape[0]})")
            np.take(layer.W_in, inp, axis=0, out=a, mode="clip")
        else:
            self.mm(inp.reshape(-1, inp.shape[-1]), layer.W_in, out=a.reshape(-1, a.shape[-1]))
        if layer.b is not None:
            np.add(a, layer.b, out=a)
        return a

    def _elman_forward(self, layer: _Layer, inp) -> None:
        a, h, W_hh = self._project(layer, inp), layer.h, layer.W_hh
        act = self.spec.activation
        for t in range(a.shape[0]):
            ht = h[t + 1]
            if t:
                self.mm(h[t], W_hh, out=ht)
                np.add(ht, a[t], out=ht)
            else:
                np.copyto(ht, a[0])
            if act == "tanh":
                np.tanh(ht, out=ht)
            elif act == "relu":
                np.maximum(ht, 0, out=ht)
            else:
                _sigmoid_(ht)

    def _gru_forward(self, layer: _Layer, inp) -> None:
        a, h, n, H = self._project(layer, inp), layer.h, layer.n, layer.h.shape[-1]
        W_hh, rec, g4 = layer.W_hh, layer.rec, layer.gates4
        W_hrz, W_hn = W_hh[:, : 2 * H], W_hh[:, 2 * H :]
        for t in range(a.shape[0]):
            at, nt = a[t], n[t]
            r, z = g4[t, :, 0], g4[t, :, 1]
            if layer.reset_after:
                self.mm(h[t], W_hh, out=rec)
                np.add(at[:, : 2 * H], rec[:, : 2 * H], out=at[:, : 2 * H])
                _sigmoid_(at[:, : 2 * H])
                un = layer.un[t]
                np.copyto(un, rec[:, 2 * H :])
                if layer.b_hn is not None:
                    np.add(un, layer.b_hn, out=un)
                np.multiply(r, un, out=nt)
            else:
                self.mm(h[t], W_hrz, out=rec[:, : 2 * H])
                np.add(at[:, : 2 * H], rec[:, : 2 * H], out=at[:, : 2 * H])
                _sigmoid_(at[:, : 2 * H])
                np.multiply(r, h[t], out=layer.rh[t])
                self.mm(layer.rh[t], W_hn, out=nt)
            np.add(nt, at[:, 2 * H :], out=nt)
            np.tanh(nt, out=nt)
            ht = h[t + 1]  # (1 - z) n + z h_{t-1} = n + z (h_{t-1} - n)
            np.subtract(h[t], nt, out=ht)
            np.multiply(ht, z, out=ht)
            np.add(ht, nt, out=ht)

    def _lstm_forward(self, layer: _Layer, inp) -> None:
        a, h, c, g, tc = self._project(layer, inp), layer.h, layer.c, layer.g, layer.tc
        H, W_hh, rec = h.shape[-1], layer.W_hh, layer.rec
        gates5, peep = layer.gates5, layer.peep_names is not None
        if peep:
            np.copyto(layer.p_if[0], layer.p_i)
            np.copyto(layer.p_if[1], layer.p_f)
        tmp = layer.tmp_bh
        for t in range(a.shape[0]):
            at = a[t]
            if t:
                self.mm(h[t], W_hh, out=rec)
                np.add(at, rec, out=at)
            np.tanh(at[:, 2 * H:3 * H], out=g[t])
            i, f, o = gates5[t, :, 0], gates5[t, :, 1], gates5[t, :, 3]
            if peep:
                np.multiply(c[t][:, None, :], layer.p_if, out=layer.tmp_b2h)
                np.add(gates5[t, :, :2], layer.tmp_b2h, out=gates5[t, :, :2])
                _sigmoid_(at[:, :2 * H])
            else:  # one pass over all four gates beats three calls; the g slot is not read
                _sigmoid_(at)
            np.multiply(f, c[t], out=c[t + 1])
            np.multiply(i, g[t], out=tmp)
            np.add(c[t + 1], tmp, out=c[t + 1])
            if peep:
                np.multiply(c[t + 1], layer.p_o, out=tmp)
                np.add(o, tmp, out=o)
                _sigmoid_(o)
            np.tanh(c[t + 1], out=tc[t])
            np.multiply(o, tc[t], out=h[t + 1])

    def _logits(self, h_top: np.ndarray, out=None) -> np.ndarray:
        H = h_top.shape[-1]
        z = self.mm(h_top[1:].reshape(-1, H), self.W_hy, out=out)
        if self.b_y is not None:
            np.add(z, self.b_y, out=z)
        return z

    def forward(self, x) -> np.ndarray:
        """Softmax probabilities or the mse head's output, (T, B, O), in a new array."""
        x, _ = self._inputs(x)
        T, B = x.shape[:2]
        with np.errstate(over="ignore"):  # exp(-a) -> inf is a sigmoid of 0, as intended
            z = self._logits(self._run_layers(x))
        if self.spec.head == "softmax_xent":
            z -= z.max(axis=1, keepdims=True)
            np.exp(z, out=z)
            z /= np.matmul(z, self.buf.ones)[:, None]
        elif self.spec.output_act == "tanh":
            np.tanh(z, out=z)
        return z.reshape(T, B, -1)

    # -- head ------------------------------------------------------------------------
    def _head(self, y, scale) -> float:
        """Reported loss; leaves ``scale * dL/dz`` in the rows of ``buf.z`` that get a gradient."""
        buf, z = self.buf, self.buf.z
        N, B = z.shape[0], buf.B
        w0 = buf.t0 * B  # tail: earlier rows get no gradient
        c = self.dtype.type(scale / B)
        if self.spec.head == "softmax_xent":
            yf = y.reshape(-1)
            m = np.max(z, axis=1, out=buf.m)
            np.subtract(z, m[:, None], out=z)
            z_y = z[buf.rows, yf]
            np.exp(z, out=z)
            s = np.matmul(z, buf.ones, out=buf.s)
            loss = float(np.log(s).sum() - z_y.sum()) / N
            r = np.divide(c, s[w0:], out=buf.r[w0:])
            zw = z[w0:]
            np.multiply(zw, r[:, None], out=zw)
            zw[buf.rows[: N - w0], yf[w0:]] -= c
            return loss
        if self.spec.output_act == "linear":
            diff = np.subtract(z, y.reshape(N, -1), out=z)
            loss = 0.5 * float(np.vdot(diff, diff)) / N
            np.multiply(diff[w0:], c, out=z[w0:])
            return loss
        np.tanh(z, out=z)
        diff = np.subtract(z, y.reshape(N, -1), out=buf.diff)
        loss = 0.5 * float(np.vdot(diff, diff)) / N
        zw = z[w0:]
        np.multiply(zw, zw, out=zw)
        np.subtract(self.one, zw, out=zw)
        np.multiply(zw, diff[w0:], out=zw)
        np.multiply(zw, c, out=zw)
        return loss

    # -- backward --------------------------------------------------------------------
    def _grads(self, x, y, scale) -> float:
        """Forward, head and BPTT; leaves ``scale * dL/dp`` in ``self.grads``; returns the loss."""
        x, y = self._inputs(x, y)
        buf = self.buf
        with np.errstate(over="ignore"):
            h_top = self._run_layers(x)
        self._logits(h_top, out=buf.z)
        loss = self._head(y, scale)
        t0, H = buf.t0, self.spec.hidden
        dz = buf.z[t0 * buf.B:]
        self.mm(h_top[t0 + 1:].reshape(-1, h_top.shape[-1]).T, dz, out=self.grads["W_hy"])
        if self.b_y is not None:
            np.sum(dz, axis=0, out=self.grads["b_y"])
        top = self.layers[-1]
        if self.bi:
            return self._grads_bidirectional(x, dz, loss)
        if top.up_t is not None:
            self.mm(self.W_hy, dz.T, out=top.up_t[:, t0 * buf.B:])
        else:
            self.mm(dz, self.W_hy.T, out=top.up[t0:].reshape(-1, H))
        for layer in reversed(self.layers):
            below = self.layers[layer.index - 1] if layer.index else None
            self._backward(layer, layer is top)
            self._weight_grads(layer, x if below is None else below.h[1:], below)
        return loss

    def _backward(self, layer: _Layer, top: bool) -> None:
        if layer.lstm:
            self._lstm_backward(layer, top)
        elif layer.gru:
            self._gru_backward(layer, top)
        else:
            self._elman_backward(layer, top)

    def _grads_bidirectional(self, x, dz, loss) -> float:
        """BPTT through bidirectional layers (full BPTT: one window, t0 = 0): each direction takes its half
        of dL/d output (time-reversed for the reverse one) and both add their dL/d input into the layer below's."""
        buf, H = self.buf, self.spec.hidden
        ups = buf.ups
        self.mm(dz, self.W_hy.T, out=ups.reshape(-1, 2 * H))
        for index in reversed(range(self.spec.layers)):
            fwd, rev = self.layers[2 * index], self.layers[2 * index + 1]
            np.copyto(fwd.up.reshape(ups.shape[0], -1, H), ups[:, :, :H])
            np.copyto(rev.up.reshape(ups.shape[0], -1, H), ups[::-1, :, H:])
            inp = x if index == 0 else buf.outs[index - 1][1:]
            for layer in (fwd, rev):
                self._backward(layer, index == self.spec.layers - 1)
                self._weight_grads(layer, inp[::-1] if layer is rev else inp, None)
            if index:  # the layer below's dL/d output: both directions' dL/d input, in forward time
                self.mm(fwd.da.reshape(-1, fwd.da.shape[-1]), fwd.W_in.T, out=ups.reshape(-1, 2 * H))
                ups[::-1] += self.mm(rev.da.reshape(-1, rev.da.shape[-1]), rev.W_in.T).reshape(ups.shape)
        return loss

    def _seed(self, layer: _Layer, s: int, top: bool) -> None:
        """Add step s's gradient from above into ``dh``; in a truncated sweep, open output s's window."""
        dh, up = layer.dh, layer.up
        if not self.buf.truncated:
            np.add(dh, up[s], out=dh)
            return
        r = s % self.buf.S  # the slot of output s+K+1, whose window closed at step s+1
        if top:
            np.copyto(dh[r], up[s])
        else:
            dh[r].fill(0)
            np.add(dh, up[s], out=dh)
        if layer.lstm:
            layer.dc[r].fill(0)

    def _gru_backward(self, layer: _Layer, top: bool) -> None:
        buf = self.buf
        t0, T, H, one = buf.t0, buf.T, self.spec.hidden, self.one
        g4 = layer.gates4[t0:]
        r, z, n, h_prev = g4[:, :, 0], g4[:, :, 1], layer.n[t0:], layer.h[t0:T]
        k_n, k_z, k_r = layer.k_n[t0:], layer.k_z[t0:], layer.k_r[t0:]
        np.multiply(n, n, out=k_n)
        np.subtract(one, k_n, out=k_n)
        np.subtract(one, z, out=k_z)
        np.multiply(k_n, k_z, out=k_n)  # k_n = (1 - z)(1 - n^2)
        np.multiply(k_z, z, out=k_z)
        tmp_t = layer.tmp_tbh[t0:]
        np.subtract(h_prev, n, out=tmp_t)
        np.multiply(k_z, tmp_t, out=k_z)  # k_z = (h_{t-1} - n) z (1 - z)
        np.subtract(one, r, out=k_r)
        np.multiply(k_r, r, out=k_r)  # k_r = r (1 - r) un (after), r (1 - r) h_{t-1} (before)
        np.multiply(k_r, layer.un[t0:] if layer.reset_after else h_prev, out=k_r)
        dh, dh_rows, das4, das_rows = layer.dh, layer.dh_rows, layer.das4, layer.das_rows
        du, du4, du_rows, tmp, tmp_rows = layer.du, layer.du4, layer.du_rows, layer.tmp_sbh, layer.tmp_rows
        W_hh = layer.W_hh
        W_hrz_T, W_hn_T = W_hh[:, : 2 * H].T, W_hh[:, 2 * H :].T
        dh.fill(0)
        for s in range(T - 1, t0 - 1, -1):
            self._seed(layer, s, top)
            d4 = das4[s]
            dan = d4[:, :, 2]
            np.multiply(dh, layer.k_n[s], out=dan)
            np.multiply(dh, layer.k_z[s], out=d4[:, :, 1])
            if layer.reset_after:
                np.multiply(dan, layer.k_r[s], out=d4[:, :, 0])
                if s > t0:  # dh_{t-1} = dh z + (da_r, da_z, da_n r) W_hh^T
                    np.copyto(du4[:, :, :2], d4[:, :, :2])
                    np.multiply(dan, layer.gates4[s, :, 0], out=du4[:, :, 2])
                    self.mm(du_rows, W_hh.T, out=tmp_rows)
            else:
                self.mm(dan.reshape(-1, H), W_hn_T, out=tmp_rows)  # dL/d(r h_{t-1})
                np.multiply(tmp, layer.k_r[s], out=d4[:, :, 0])
                if s > t0:  # dh_{t-1} = dh z + dL/d(r h) r + (da_r, da_z) W_hrz^T
                    np.multiply(tmp, layer.gates4[s, :, 0], out=tmp)
                    tmp_rows += self.mm(das_rows[s][:, : 2 * H], W_hrz_T)
            if s > t0:
                np.multiply(dh, layer.gates4[s, :, 1], out=dh)
                np.add(dh, tmp, out=dh)

    def _elman_backward(self, layer: _Layer, top: bool) -> None:
        buf = self.buf
        t0, T = buf.t0, buf.T
        hw, dg = layer.h[t0 + 1:], layer.act_grad[t0:]
        act = self.spec.activation
        if act == "tanh":
            np.multiply(hw, hw, out=dg)
            np.subtract(self.one, dg, out=dg)
        elif act == "relu":
            np.greater(hw, 0, out=dg)
        else:
            np.subtract(self.one, hw, out=dg)
            np.multiply(dg, hw, out=dg)
        dh, dh_rows, das, das_rows, W_hh_T = layer.dh, layer.dh_rows, layer.das, layer.das_rows, layer.W_hh.T
        dh.fill(0)
        for s in range(T - 1, t0 - 1, -1):
            self._seed(layer, s, top)
            np.multiply(dh, layer.act_grad[s], out=das[s])
            if s > t0:
                self.mm(das_rows[s], W_hh_T, out=dh_rows)

    def _lstm_backward(self, layer: _Layer, top: bool) -> None:
        buf = self.buf
        t0, T = buf.t0, buf.T
        g5 = layer.gates5[t0:]
        i, f, o = g5[:, :, 0], g5[:, :, 1], g5[:, :, 3]
        g, c_prev, tc = layer.g[t0:], layer.c[t0:T], layer.tc[t0:]
        k_o, k_c, tmp = layer.k_o[t0:], layer.k_c[t0:], layer.tmp_tbh[t0:]
        k_i, k_f, k_g = (layer.k_ifg[t0:, :, j] for j in range(3))
        one = self.one
        np.subtract(one, o, out=k_o)
        np.multiply(k_o, o, out=k_o)
        np.multiply(k_o, tc, out=k_o)  # tanh(c) o (1 - o)
        np.multiply(tc, tc, out=k_c)
        np.subtract(one, k_c, out=k_c)
        np.multiply(k_c, o, out=k_c)  # o (1 - tanh(c)^2)
        np.subtract(one, i, out=k_i)
        np.multiply(k_i, i, out=k_i)
        np.multiply(k_i, g, out=k_i)  # g i (1 - i)
        np.subtract(one, f, out=k_f)
        np.multiply(k_f, f, out=k_f)
        np.multiply(k_f, c_prev, out=k_f)  # c_{t-1} f (1 - f)
        np.multiply(g, g, out=k_g)
        np.subtract(one, k_g, out=k_g)
        np.multiply(k_g, i, out=k_g)  # i (1 - g^2)
        if layer.peep_names:  # o's peephole feeds dc; i's and f's feed dc_{t-1}
            np.multiply(k_o, layer.p_o, out=tmp)
            np.add(k_c, tmp, out=k_c)
            f_c = layer.f_c[t0:]
            np.multiply(k_i, layer.p_i, out=f_c)
            np.add(f_c, f, out=f_c)
            np.multiply(k_f, layer.p_f, out=tmp)
            np.add(f_c, tmp, out=f_c)
        dh, dc, dh_rows, das_rows, das5 = layer.dh, layer.dc, layer.dh_rows, layer.das_rows, layer.das5
        dc_wide, tmp, W_hh_T = layer.dc_wide, layer.tmp_sbh, layer.W_hh.T
        dh.fill(0)
        dc.fill(0)
        for s in range(T - 1, t0 - 1, -1):
            self._seed(layer, s, top)
            np.multiply(dh, layer.k_o[s], out=das5[s, :, :, 3])
            np.multiply(dh, layer.k_c[s], out=tmp)
            np.add(dc, tmp, out=dc)
            np.multiply(dc_wide, layer.k_ifg[s], out=das5[s, :, :, :3])
            if s > t0:
                self.mm(das_rows[s], W_hh_T, out=dh_rows)
                np.multiply(dc, layer.f_c[s], out=dc)

    def _weight_grads(self, layer: _Layer, inp, below: _Layer | None) -> None:
        """Single GEMMs over the window: W_hh, W_in, bias, peepholes; and dL/dh for the layer below."""
        buf, g = self.buf, self.grads
        t0, T, H = buf.t0, buf.T, self.spec.hidden
        if buf.S > 1:
            np.sum(layer.das, axis=1, out=layer.da)
        da = layer.da[t0:]
        da_rows = da.reshape(-1, da.shape[-1])
        t1 = max(t0, 1)  # h[0] = 0 adds nothing to W_hh's gradient
        h_rows = layer.h[t1:T].reshape(-1, H)
        if layer.reset_after:  # the recurrent side's gradient: (da_r, da_z, da_n r)
            du = layer.du_all[t0:]
            np.copyto(du, da)
            du4 = du.reshape(T - t0, buf.B, 3, H)
            np.multiply(du4[:, :, 2], layer.gates4[t0:, :, 0], out=du4[:, :, 2])
            self.mm(h_rows.T, layer.du_all[t1:].reshape(-1, 3 * H), out=g[layer.hh_name])
            if layer.bhn_name:
                np.sum(du4[:, :, 2].reshape(-1, H), axis=0, out=g[layer.bhn_name])
        elif layer.gru:  # (r h_{t-1}) W_hn: W_hn's gradient reads r h_{t-1}
            dW = g[layer.hh_name]
            dW[:, : 2 * H] = self.mm(h_rows.T, layer.da[t1:, :, : 2 * H].reshape(-1, 2 * H))
            dW[:, 2 * H :] = self.mm(layer.rh[t1:T].reshape(-1, H).T, layer.da[t1:, :, 2 * H :].reshape(-1, H))
        else:
            self.mm(h_rows.T, layer.da[t1:].reshape(-1, da.shape[-1]), out=g[layer.hh_name])
        if layer.sparse_input:
            self.sparse_rows[layer.in_name] = (inp[t0:].reshape(-1), da_rows)
        else:
            self.mm(inp[t0:].reshape(-1, inp.shape[-1]).T, da_rows, out=g[layer.in_name])
        if layer.b_name:
            np.sum(da_rows, axis=0, out=g[layer.b_name])
        if layer.peep_names:
            tmp, da4 = layer.tmp_tbh[t0:], da.reshape(T - t0, buf.B, 4, H)
            p_i, p_f, p_o = layer.peep_names
            for name, gate, c in ((p_i, 0, layer.c[t0:T]), (p_f, 1, layer.c[t0:T]), (p_o, 3, layer.c[t0 + 1:])):
                np.multiply(da4[:, :, gate], c, out=tmp)
                np.sum(tmp.reshape(-1, H), axis=0, out=g[name])
        if below is not None:  # per window, so each output's window bounds the layer below too
            self.mm(layer.das_rows[t0:].reshape(-1, da.shape[-1]), layer.W_in.T,
                      out=below.up[t0:].reshape(-1, H))

    # -- the protocol ----------------------------------------------------------------
    def loss_and_grads(self, x, y):
        """Reported loss and dense copies of the gradients, keyed like the parameters."""
        loss = self._grads(x, y, self.scale)
        grads = {k: v.copy() for k, v in self.grads.items()}
        for name, (ids, rows) in self.sparse_rows.items():
            dense = np.zeros_like(self.params[name])
            np.add.at(dense, ids, rows)
            grads[name] = dense
        if self.scale != 1:
            grads = {k: v / self.dtype.type(self.scale) for k, v in grads.items()}
        return loss, {k: grads[k] for k in self.params}

    def sgd_step(self, x, y, lr: float) -> float:
        """One SGD step in place; returns the loss before it."""
        if self.problem.reduced:
            # rounded products are not linear in their inputs, so the backward pass is seeded with the loss
            # scale alone and its buffers turned into the steps -lr g afterwards
            loss = self._grads(x, y, self.scale)
            steps = list(self.grads.values()) + [rows for _, rows in self.sparse_rows.values()]
            if not all(np.isfinite(v).all() for v in steps):
                loss = float("nan")  # a non-finite gradient (float16 overflow): the cell is diverged
            rate = self.dtype.type(-lr / self.scale)
            for v in steps:
                np.multiply(v, rate, out=v)
        else:
            # the backward pass is linear in dL/dz, so seeding it with -lr * dL/dz leaves the
            # update itself in the gradient buffers; clipping scales to [-|lr| c, |lr| c]
            loss = self._grads(x, y, -lr)
        clip = self.spec.clip
        bound = self.dtype.type(abs(lr) * clip) if clip is not None else None
        for name, step in self.grads.items():
            if bound is not None:
                np.clip(step, -bound, bound, out=step)
            p = self.params[name]
            np.add(p, step, out=p)
        for name, (ids, rows) in self.sparse_rows.items():
            W = self.params[name]
            if bound is None:
                np.add.at(W, ids, rows)
            else:  # clip the summed gradient of each distinct row
                uniq, inverse = np.unique(ids, return_inverse=True)
                step = np.zeros((uniq.size, rows.shape[1]), self.dtype)
                np.add.at(step, inverse.reshape(-1), rows)
                np.clip(step, -bound, bound, out=step)
                W[uniq] += step
        return loss

    def get_params(self):
        """Copies of the parameters."""
        return {k: v.copy() for k, v in self.params.items()}


class _WildML:
    """The WildML ``RNNNumpy`` tutorial, kept in its own shape: U (H, V), W (H, H), V (V, H)."""

    def __init__(self, problem: Problem, params: dict[str, np.ndarray]):
        spec, dtype = problem.model, np.dtype(problem.dtype)
        self.dtype = dtype
        # the tutorial's word_dim, as the output size: SPEC.md lets input and output vocabularies differ
        self.out_dim, self.hidden_dim = problem.output_size, spec.hidden
        self.U = np.array(params["W_xh"].T, dtype=dtype, order="C")
        self.W = np.array(params["W_hh"].T, dtype=dtype, order="C")
        self.V = np.array(params["W_hy"].T, dtype=dtype, order="C")
        self.bias = spec.bias
        if spec.bias:
            self.b = np.array(params["b_h"], dtype=dtype)
            self.c = np.array(params["b_y"], dtype=dtype)
        self.bptt_truncate = spec.bptt.k if spec.bptt.mode == "truncated" else None
        self.clip = spec.clip

    @staticmethod
    def supports(problem: Problem) -> tuple[bool, str]:
        """The tutorial's model only: batch 1, tokens, one tanh Elman layer, softmax, full or truncated."""
        m, who = problem.model, "numpy:wildml is the tutorial's"
        if problem.batch != 1:
            return unsupported(f"{who} one-example loop (batch 1 only)")
        if m.bidirectional:
            return unsupported(f"{who} one-direction network (no reverse direction)")
        if m.kind != "elman" or m.activation != "tanh":
            return unsupported(f"{who} tanh Elman network (got {m.kind}"
                               + (f" {m.activation})" if m.kind == "elman" else ")"))
        if not problem.tokens:
            return unsupported(f"{who} token-id input U[:, x[t]] (dense inputs are not)")
        if m.head != "softmax_xent":
            return unsupported(f"{who} softmax language model (no mse head)")
        if m.layers != 1:
            return unsupported(f"{who} single-layer network (layers {m.layers})")
        if m.bptt.mode == "tail":
            return unsupported(f"{who} per-output bptt_truncate walk; tail:{m.bptt.k} is scan's truncation")
        return True, ""

    def forward_propagation(self, x, y=None):
        """The tutorial's loop; also sums the stable per-token loss when ``y`` is given."""
        T = len(x)
        # s[-1] is the zero initial state, as in the tutorial
        s = np.zeros((T + 1, self.hidden_dim), self.dtype)
        o = np.zeros((T, self.out_dim), self.dtype)
        loss = 0.0
        for t in np.arange(T):
            a = self.U[:, x[t]] + self.W.dot(s[t - 1])
            s[t] = np.tanh(a + self.b if self.bias else a)
            z = self.V.dot(s[t])
            if self.bias:
                z = z + self.c
            zmax = np.max(z)
            e = np.exp(z - zmax)
            total = np.sum(e)
            o[t] = e / total
            if y is not None:
                loss += float(np.log(total) + zmax - z[y[t]])
        return o, s, loss

    def bptt(self, x, y):
        """The tutorial's BPTT: every output walks back ``bptt_truncate`` steps with np.outer."""
        T = len(y)
        o, s, loss = self.forward_propagation(x, y)
        truncate = T if self.bptt_truncate is None else self.bptt_truncate
        dLdU = np.zeros(self.U.shape, self.dtype)
        dLdV = np.zeros(self.V.shape, self.dtype)
        dLdW = np.zeros(self.W.shape, self.dtype)
        dLdb = np.zeros(self.hidden_dim, self.dtype)
        dLdc = np.zeros(self.out_dim, self.dtype)
        delta_o = o
        delta_o[np.arange(len(y)), y] -= 1.0
        for t in np.arange(T)[::-1]:
            dLdV += np.outer(delta_o[t], s[t].T)
            if self.bias:
                dLdc += delta_o[t]
            delta_t = self.V.T.dot(delta_o[t]) * (1 - (s[t] ** 2))
            for bptt_step in np.arange(max(0, t - truncate), t + 1)[::-1]:
                dLdW += np.outer(delta_t, s[bptt_step - 1])
                dLdU[:, x[bptt_step]] += delta_t
                if self.bias:
                    dLdb += delta_t
                delta_t = self.W.T.dot(delta_t) * (1 - s[bptt_step - 1] ** 2)
        return loss / T, [dLdU, dLdV, dLdW, dLdb, dLdc]

    def _named(self, grads):
        """The tutorial's gradients under SPEC.md's names and row-vector shapes."""
        dLdU, dLdV, dLdW, dLdb, dLdc = grads
        out = {"W_xh": dLdU.T.copy(), "W_hh": dLdW.T.copy()}
        if self.bias:
            out["b_h"] = dLdb
        out["W_hy"] = dLdV.T.copy()
        if self.bias:
            out["b_y"] = dLdc
        return out

    def forward(self, x):
        """Softmax probabilities (T, 1, O)."""
        o, _, _ = self.forward_propagation(np.asarray(x)[:, 0])
        return o[:, None, :]

    def loss_and_grads(self, x, y):
        """Per-token loss and the gradients of the sentence's summed loss."""
        loss, grads = self.bptt(np.asarray(x)[:, 0], np.asarray(y)[:, 0])
        return loss, self._named(grads)

    def sgd_step(self, x, y, learning_rate):
        """The tutorial's ``sgd_step`` (plus optional clipping); returns the loss before it."""
        loss, (dLdU, dLdV, dLdW, dLdb, dLdc) = self.bptt(np.asarray(x)[:, 0], np.asarray(y)[:, 0])
        if self.clip is not None:
            for g in (dLdU, dLdV, dLdW, dLdb, dLdc):
                np.clip(g, -self.clip, self.clip, out=g)
        self.U -= learning_rate * dLdU
        self.V -= learning_rate * dLdV
        self.W -= learning_rate * dLdW
        if self.bias:
            self.b -= learning_rate * dLdb
            self.c -= learning_rate * dLdc
        return loss

    def get_params(self):
        """Copies of U, W, V (and biases) under SPEC.md's names and shapes."""
        out = {"W_xh": self.U.T.copy(), "W_hh": self.W.T.copy()}
        if self.bias:
            out["b_h"] = self.b.copy()
        out["W_hy"] = self.V.T.copy()
        if self.bias:
            out["b_y"] = self.c.copy()
        return out


class NumpyBackend(Backend):
    """``numpy``: vectorised SPEC.md over reused buffers; ``numpy:wildml``: the tutorial's loop."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "numpy"
    package = "numpy"
    variants = ("fast", "wildml")

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        self._impl: _Fast | _WildML | None = None

    def supports(self, problem: Problem) -> tuple[bool, str]:
        """Every SPEC.md option for ``fast`` (mixed precision as the spec's roundings, emulated); the tutorial's
        model only, in float32 or float64, for ``wildml``."""
        ok, why = self.supports_device(problem.device)
        if not ok:
            return ok, why
        if self.variant == "wildml":
            if problem.dtype not in ("float32", "float64"):
                return unsupported(f"{self.full_name} is the tutorial's float32/float64 code; it has no mixed "
                                   f"precision ({problem.dtype})")
            return _WildML.supports(problem)
        return True, ""

    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        """Copy the parameters in the problem's dtype; buffers follow on the first batch."""
        self.problem = problem
        self._impl = (_WildML if self.variant == "wildml" else _Fast)(problem, params)

    def warm_up(self, batch) -> None:
        """Allocate and touch the buffers for this batch shape (parameters are left unchanged)."""
        x, y = batch
        if self.problem.workload == "forward" or y is None:
            self._impl.forward(x)
        else:
            self._impl.loss_and_grads(x, y)

    def forward(self, x) -> np.ndarray:
        """Softmax probabilities, or ``z`` / ``tanh(z)`` for the mse head, shaped (T, B, O)."""
        return self._impl.forward(x)

    def loss_and_grads(self, x, y):
        """Reported loss and the gradients of the objective, keyed like the parameters."""
        return self._impl.loss_and_grads(x, y)

    def sgd_step(self, x, y, lr: float) -> float:
        """Forward, BPTT and the in-place SGD update; returns the loss before the update."""
        return self._impl.sgd_step(x, y, lr)

    def get_params(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, keyed and shaped as SPEC.md names them."""
        return self._impl.get_params()

    def close(self) -> None:
        """Drop the parameters and buffers."""
        self._impl = None
