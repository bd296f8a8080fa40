"""The cuda backend's engine: parameters and state on the device, and the calls the backend makes.

:class:`Net` holds what every stage reads (the spec's flags, the weights in their stored layouts,
the kernel modules, the product, the streams) and ties the stages together: the forward pass
(:mod:`backends.cuda.forward`), the head (:mod:`backends.cuda.head`), BPTT
(:mod:`backends.cuda.backward`, :mod:`backends.cuda.weight_grads`) and the SGD update here.
:class:`backends.cuda.graphed.GraphedNet` replays the same step from a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from harness.spec.model import Problem, layer_suffix

from backends.cuda import backward, head
from backends.cuda.streams import Streams


class Net:
    """Parameters on the device and the step, forward and backward, for one variant.

    A layer's direction is a unit ``u = (layer, direction)``: its parameters are the names with
    ``layer_suffix(layer, direction)``; every per-unit function takes ``u``."""

    def __init__(self, problem: Problem, params: dict[str, np.ndarray], device, variant: str):
        import torch

        from backends.cuda import elementwise, elman, gru, lstm, persistent

        self.torch, self.E, self.k_lstm, self.k_elman, self.k_gru, self.k_pers = \
            torch, elementwise, lstm, elman, gru, persistent
        self.problem, self.spec, self.device, self.variant = problem, problem.model, device, variant
        spec = self.spec
        self.dtype = getattr(torch, problem.master_dtype)  # parameters, state, gradients (float32 when mixed)
        # mixed precision: the products' operand type, float16's loss scale, and the weights rounded once per pass
        self.low = getattr(torch, problem.dtype) if problem.reduced else None
        self.scale = problem.objective_scale
        self._low_w: dict[str, object] = {}
        if self.low is None:
            self.mm = torch.mm
        else:  # cuBLAS's low-precision product with a float32 result; under the interpreter its emulation
            from backends import low_precision

            self.mm = low_precision.raw_product(torch, self.low, device, emulate=device.type == "cpu")
            low_precision.check_product(torch, self.mm, self.low, device)
        self.H, self.L = spec.hidden, spec.layers
        H = self.H
        self.is_lstm = spec.kind == "lstm"
        self.is_gru = spec.kind == "gru"
        self.reset_after = self.is_gru and spec.reset_after
        self.dirs = spec.directions
        self.G = spec.gates * H  # the input and recurrent products' width
        # the width of da (the backward's pre-activation gradients): the GRU's reset after keeps dun too
        self.GB = 4 * H if self.reset_after else self.G
        self.GS = 4 * H  # stored gates (LSTM, GRU)
        # which weight gate each da gate multiplies: input weights, and W_hh against h_prev
        ident = [(k, k) for k in range(spec.gates)]
        if self.reset_after:
            self.in_map, self.rec_map = [(0, 0), (1, 1), (2, 3)], [(0, 0), (1, 1), (2, 2)]
        elif self.is_gru:
            self.in_map, self.rec_map = ident, [(0, 0), (1, 1)]  # W_hn meets r * h_prev, not h_prev
        else:
            self.in_map = self.rec_map = ident
        self.tokens = problem.tokens
        self.naive = variant == "naive"
        self.fused = variant in ("fused", "streams", "graph", "persistent")
        # a (layer, step) wavefront needs layer l step t to read layer l-1 at step t only; a reverse
        # direction reads layer l-1's last step first, so bidirectional layers run one after another
        self.wavefront = variant in ("streams", "graph") and self.L > 1 and self.dirs == 1
        self.persistent = variant == "persistent"
        self.on_gpu = device.type == "cuda"
        self.w_in = spec.input_weight
        self.b_in = spec.bias_name
        self.names = spec.param_names()
        # Pre-transposed (stored (G, D) / (G, H), nn.Linear's layout) for every variant past naive;
        # the token tables stay (V, G) (their rows are gathered).
        self.transposed = set()
        if not self.naive:
            for layer in range(self.L):
                for d in range(self.dirs):
                    s = layer_suffix(layer, d)
                    self.transposed.add("W_hh" + s)
                    if not (layer == 0 and self.tokens):
                        self.transposed.add(self.w_in + s)
        self.p = {}
        for k in self.names:
            a = np.asarray(params[k])
            a = a.T if k in self.transposed else a
            self.p[k] = torch.tensor(np.ascontiguousarray(a), dtype=self.dtype, device=device)
        self.lr = torch.zeros(1, dtype=self.dtype, device=device)  # read by the SGD kernel on the device
        self.clip = None if spec.clip is None else torch.full((1,), spec.clip, dtype=self.dtype, device=device)
        self.streams = Streams(torch, device, self.L, self.wavefront and self.on_gpu)
        self.barriers: list = []  # the persistent kernel's grid-barrier flags, checked after the pass

    # -- what the stages read --------------------------------------------------------
    def P(self, name: str, u):
        """Unit ``u``'s parameter ``name`` (None where the spec has none)."""
        return self.p.get(name + layer_suffix(*u))

    def W(self, full: str):
        """Weight ``full`` as the products read it: itself, or under mixed precision its copy rounded to the
        low type at the start of the pass (:meth:`round_weights`)."""
        return self.p[full] if self.low is None else self._low_w[full]

    def round_weights(self):
        """Mixed precision: every weight matrix a product reads, rounded once per pass (the token tables are
        gathered, not multiplied: they stay float32)."""
        if self.low is None:
            return
        tables = {self.w_in + layer_suffix(0, d) for d in range(self.dirs)} if self.tokens else set()
        self._low_w = {k: v.to(self.low) for k, v in self.p.items() if v.dim() == 2 and k not in tables}

    def is_table(self, u) -> bool:
        """Whether unit ``u``'s input weights are a token table (rows gathered, not multiplied)."""
        return u[0] == 0 and self.tokens

    def peep(self, u):
        """Unit ``u``'s peepholes ``(p_i, p_f, p_o)``, or None without them."""
        if not self.spec.peephole:
            return None
        return tuple(self.P(k, u) for k in ("p_i", "p_f", "p_o"))

    # -- the passes ------------------------------------------------------------------
    def _x(self, x):
        return self.torch.as_tensor(self.problem.cast_inputs(x, np.int64), device=self.device)

    def _y(self, y):
        return self.torch.as_tensor(self.problem.cast_targets(y, np.int64), device=self.device)

    def _outputs_dev(self, xt):
        return head.outputs(self, xt)

    def _grads_dev(self, xt, yt):
        return backward.grads_dev(self, xt, yt)

    def _sgd(self, grads):
        """``p -= lr * clip(g)`` for every parameter (a gradient never formed is zero: no change)."""
        for k in self.names:
            if k in grads:
                self.E.sgd_(self.p[k], grads[k].contiguous(), self.lr, self.clip)

    # -- what the backend calls -----------------------------------------------------
    def outputs(self, x) -> np.ndarray:
        """The forward pass's outputs (T, B, O) on the host."""
        with self.torch.inference_mode():
            out = self._outputs_dev(self._x(x)).cpu().numpy()
        self._check_barriers()
        return out

    def warm_up_training(self, x, y) -> None:
        """One training pass without the update: compiles every kernel specialisation it launches."""
        with self.torch.no_grad():
            self._grads_dev(self._x(x), self._y(y))

    def loss_and_grads(self, x, y):
        """The reported loss and the gradients on the host, keyed and shaped as the spec names them."""
        with self.torch.no_grad():
            loss, grads = self._grads_dev(self._x(x), self._y(y))
        self._check_barriers()
        return float(loss), self._to_numpy(grads)

    def sgd_step(self, x, y, lr: float):
        """One SGD step in place; returns the loss before it (a device scalar, not synchronised)."""
        with self.torch.no_grad():
            self.lr.fill_(lr)
            loss, grads = self._grads_dev(self._x(x), self._y(y))
            self._sgd(grads)
        return loss

    def _to_numpy(self, grads) -> dict[str, np.ndarray]:
        out = {}
        for k in self.names:
            g = grads.get(k)
            g = self.torch.zeros_like(self.p[k]) if g is None else g
            out[k] = (g.t() if k in self.transposed else g).cpu().numpy()
        return out

    def get_params(self) -> dict[str, np.ndarray]:
        """Copies of the parameters on the host, in the spec's layouts."""
        return {k: (v.t() if k in self.transposed else v).cpu().numpy().copy() for k, v in self.p.items()}

    def _check_barriers(self):
        bars, self.barriers = self.barriers, []
        for bar in bars:
            self.k_pers.raise_on_barrier_timeout(bar)

    def sync(self) -> None:
        """Wait for the device, then raise if a persistent kernel's grid barrier timed out."""
        if self.on_gpu:
            self.torch.cuda.synchronize(self.device)
        self._check_barriers()
