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
time-reversed input for its reverse direction (full BPTT only, so one window). The step maths
of each cell kind, forward, backward and weight gradients, is ``backends.numpy_cells``; the class
here owns the buffers and runs the layers, the head and the update.

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

from backends import numpy_cells as cells
from backends.base import Backend, unsupported
from backends.numpy_cells import Layer
from harness.spec.model import Problem
from harness.spec.reference import round_to


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
        self.ones = np.ones(O, net.dtype)  # row sums as a GEMV: faster than np.sum on these rows
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
            self.layers = [self._layer(layer, d) for layer in range(self.spec.layers) for d in (0, 1)]
        else:
            self.layers = [self._layer(layer) for layer in range(self.spec.layers)]
        self.W_hy = self.params["W_hy"]
        self.b_y = self.params.get("b_y")
        # gradient buffers; each token embedding's gradient stays as rows (see sgd_step)
        self.sparse = [lay for lay in self.layers if lay.sparse_input]
        self.grads = {k: np.empty_like(v) for k, v in self.params.items()
                      if k not in {lay.in_name for lay in self.sparse}}
        self.buf: _Buffers | None = None
        self.sparse_rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def _layer(self, layer: int, direction: int = 0) -> Layer:
        return Layer(self.spec, self.params, self.dtype, self.problem.tokens, layer, direction)

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
            a = self._project(layer, seq)
            if layer.lstm:
                cells.lstm_forward(layer, a, self.mm)
            elif layer.gru:
                cells.gru_forward(layer, a, self.mm)
            else:
                cells.elman_forward(layer, a, self.mm)
            if layer.direction == 1:
                out, H = self.buf.outs[layer.index], self.spec.hidden
                np.copyto(out[1:, :, :H], self.layers[2 * layer.index].h[1:])
                np.copyto(out[1:, :, H:], layer.h[:0:-1])
                inp = out[1:]
            elif not self.bi:
                inp = layer.h[1:]
        return self.buf.outs[-1] if self.bi else self.layers[-1].h

    def _project(self, layer: Layer, inp) -> np.ndarray:
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

    def _backward(self, layer: Layer, top: bool) -> None:
        """The layer's backward sweep, its ``dL/da`` into ``layer.das``."""
        if layer.lstm:
            cells.lstm_backward(layer, self.buf, top, self.mm, self.one)
        elif layer.gru:
            cells.gru_backward(layer, self.buf, top, self.mm, self.one)
        else:
            cells.elman_backward(layer, self.buf, top, self.mm, self.one)

    def _weight_grads(self, layer: Layer, inp, below: Layer | None) -> None:
        """The layer's parameter gradients into ``self.grads`` (and ``sparse_rows``), dL/dh into ``below``."""
        cells.weight_grads(layer, self.buf, inp, below, self.grads, self.sparse_rows, self.mm)

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
            if problem.dtype.reduced:
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
