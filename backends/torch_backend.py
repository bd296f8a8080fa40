"""PyTorch: an explicit autograd cell, the fused nn.RNN / nn.LSTM / nn.GRU modules, and torch.compile.

Variants::

    autograd  the SPEC.md cell written step by step in torch ops; autograd does BPTT
    fused     torch.nn.RNN / nn.LSTM / nn.GRU over the whole sequence (oneDNN on CPU, cuDNN on GPU)
    compile   the autograd variant with each time step's cell compiled by torch.compile (inductor)

Shapes follow SPEC.md (time-major, row vectors). Token input is a row gather of
the layer-0 input weight (each direction's, in a bidirectional network); its gradient
comes back as one row per token and is applied with ``index_add_``, as a sparse
embedding update would be, never through one-hot matrices or a dense (vocab, H)
gradient in the training step. The GRU's gates are grouped as the LSTM's: one input
GEMM over all steps and one recurrent GEMM per step (two before the reset).

Mixed precision (``bfloat16``, ``float16``) is the spec's: float32 parameters, gradients, update,
element-wise maths and state; every matrix product (the input projection over all steps, the
recurrent product of each step, the head, and in the backward pass the products of the gradients)
goes through ``backends.low_precision``'s autograd product, which rounds its operands, the gradients
included, to the low type and returns the float32 sum, ``torch.mm(a_low, b_low, out_dtype=float32)``
on a GPU (a recurrent weight is rounded once per sequence, not once per step). float16 multiplies
the objective by the static loss scale and unscales with
``torch._amp_foreach_non_finite_check_and_unscale_``, whose non-finite flag makes the step's loss
NaN. There is no autocast: it rounds every product's result to the low type as well, forward and
backward, which landed up to 1.5x past the bound that catches a 5% gradient error (the realistic
LSTM's dW_hh 1.01x, a GRU case 1.16x, nn.GRU 1.53x; ``benchmarks/measure_mixed_precision.py``).

Where that runs: torch:autograd and torch:compile on a GPU whose torch has ``aten::mm.dtype``
(checked when the cell is screened, and the product probed once on the device in ``prepare``).
On the CPU mixed precision is refused: PyTorch has no CPU matrix product with low-precision inputs
and a float32 result (``aten::mm.dtype`` has a CUDA kernel only), and its low-precision ``a @ b``
returns the low type (autocast's extra rounding), whatever its speed on the CPU at hand. Tests run the same step on the
CPU with the product emulated (``low_precision.EMULATE_ON_CPU``), which checks the maths, never a
speed. torch:fused refuses it everywhere: cuDNN's (and oneDNN's) half-precision RNNs run in the
module's dtype, keeping ``h``, ``c`` and the gates in the low type and rounding every product's
result, and the one measurement of such a module (nn.GRU under autocast) landed 1.53x past the bound.
"""

from __future__ import annotations

import importlib.util

import numpy as np

from backends.base import Backend, unsupported
from harness.spec.model import Problem, layer_suffix

_NOT_INSTALLED = "unavailable: torch not installed (pip install 'rnn-harness[torch]')"
_NO_CUDA = "unavailable: no CUDA device (torch.cuda.is_available() is False)"


class TorchBackend(Backend):
    """PyTorch, as its users would write the SPEC.md network (see the module docstring)."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "torch"
    package = "torch"
    variants = ("autograd", "fused", "compile")
    devices = ("cpu", "gpu")

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        # Only torch.compile pays seconds per graph; the eager variants run the whole matrix.
        self.compile_heavy = self.variant == "compile"
        self._net: _Net | None = None

    # -- cheap questions -------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        """Torch importable here (found without importing it)."""
        if importlib.util.find_spec("torch") is None:
            return False, _NOT_INSTALLED
        return True, ""

    def device_availability(self, device: str) -> tuple[bool, str]:
        """CPU always; GPU when torch sees a CUDA device."""
        ok, why = super().device_availability(device)
        if not ok or device == "cpu":
            return ok, why
        ok, why = self.availability()
        if not ok:
            return ok, why
        import torch

        if not torch.cuda.is_available():
            return False, _NO_CUDA
        return True, ""

    def supports(self, problem: Problem) -> tuple[bool, str]:
        """Everything for autograd and compile in float32 and float64, and in bfloat16 and float16 on a GPU
        with the spec's product; what nn.RNN / nn.LSTM / nn.GRU can express for fused, in float32 and float64
        (see the module docstring for mixed precision)."""
        m = problem.model
        if problem.reduced:
            return self._supports_reduced(problem)
        if self.variant != "fused":
            return True, ""
        if m.kind == "gru" and not m.reset_after:
            return unsupported("torch:fused: nn.GRU implements the reset-after form only (cuDNN's, "
                               "r * (h W_hn + b_hn)), not reset_after: false")
        if m.kind == "elman" and m.activation == "sigmoid":
            return unsupported("torch:fused: nn.RNN offers only the tanh and relu nonlinearities")
        if m.peephole:
            return unsupported("torch:fused: nn.LSTM has no peephole connections")
        return True, ""

    def _supports_reduced(self, problem: Problem) -> tuple[bool, str]:
        """Mixed precision: the spec's product on a GPU (torch:autograd, torch:compile), nowhere else."""
        from backends import low_precision

        if self.variant == "fused":
            return unsupported(f"torch:fused: cuDNN's and oneDNN's {problem.dtype} RNN modules keep h, c and the gates "
                               f"in {problem.dtype} and round every product's result (nn.GRU under autocast: 1.53x "
                               f"past the bound that must catch a 5% gradient error)")
        if problem.device == "cpu":
            if low_precision.EMULATE_ON_CPU:  # tests: the spec's product emulated, the maths checked, never timed
                return True, ""
            return unsupported(f"{self.full_name} on the CPU: " + low_precision.CPU_REASON.format(dtype=problem.dtype))
        if not self.availability()[0]:
            return self.availability()
        import torch

        missing = low_precision.gpu_product_missing(torch)
        if missing:
            return unsupported(f"{self.full_name}: {missing}")
        return True, ""

    def versions(self) -> dict[str, str]:
        """numpy, torch, and the CUDA / cuDNN / oneDNN builds torch carries."""
        out = super().versions()
        if not self.availability()[0]:
            return out
        import torch

        cuda = torch.cuda.is_available()
        out["torch"] = torch.__version__
        out["torch_cuda"] = f"{torch.version.cuda} (device present: {cuda})" if torch.version.cuda else "none"
        cudnn = cuda and torch.backends.cudnn.is_available()
        out["torch_cudnn"] = str(torch.backends.cudnn.version()) if cudnn else "none"
        out["torch_mkldnn"] = str(torch.backends.mkldnn.is_available())
        out["tf32"] = "off (matmul and cuDNN; prepare() switches it off)"
        return out

    # -- the work -------------------------------------------------------------------
    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        """Copy the shared parameters into torch tensors (module weights for fused)."""
        import torch

        self.close()
        torch.set_num_threads(threads)
        # The spec's tolerances assume IEEE float32 products; TF32 would miss them on GPUs.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # Mixed precision: cuBLAS's low-precision products sum in float32 all the way (no split-K partial sums
        # kept in bfloat16 / float16), as the spec's product does.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        self.problem = problem
        dev = torch.device("cuda" if device == "gpu" else "cpu")
        if self.variant == "fused":
            self._net = _FusedNet(problem, params, dev)
        elif self.variant == "compile":
            self._net = _CompiledNet(problem, params, dev)
        else:
            self._net = _Net(problem, params, dev)

    def warm_up(self, batch) -> None:
        """One untimed pass (for compile: tracing and inductor code generation); no update."""
        x, y = batch
        if self.problem.workload == "forward":
            self._net.outputs(x)
        else:
            self._net.loss_and_grads(x, y, as_numpy=False)
        self.sync()

    def forward(self, x) -> np.ndarray:
        """Softmax probabilities or the mse head's output, (T, B, O)."""
        return self._net.outputs(x)

    def loss_and_grads(self, x, y):
        """Reported loss and the objective's gradients, keyed like the parameters."""
        return self._net.loss_and_grads(x, y, as_numpy=True)

    def sgd_step(self, x, y, lr: float) -> float:
        """Forward, BPTT and the in-place SGD update; the loss before the update."""
        return self._net.sgd_step(x, y, lr)

    def sync(self) -> None:
        """Wait for queued CUDA work."""
        if self._net is not None and self._net.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self._net.device)

    def get_params(self) -> dict[str, np.ndarray]:
        """Parameters in SPEC.md names and layouts."""
        return self._net.get_params()

    def close(self) -> None:
        """Drop the tensors (and modules)."""
        self._net = None


class _Net:
    """The explicit cell under autograd: parameters, the objective, gradients and the update."""

    def __init__(self, problem: Problem, params: dict[str, np.ndarray], device):
        import torch
        import torch.nn.functional as F

        self.torch, self.F = torch, F
        self.problem, self.spec, self.device = problem, problem.model, device
        self.dtype = getattr(torch, problem.master_dtype)  # parameters and gradients (float32 masters when mixed)
        self.low = getattr(torch, problem.dtype) if problem.reduced else None  # the products' input type, if any
        self.scale = problem.objective_scale  # float16's static loss scale, else 1
        self.found_inf = None  # the last gradient's non-finite flag (mixed precision)
        spec = self.spec
        self.H = spec.hidden
        self.names = spec.param_names()
        self.w_in, self.b_in = spec.input_weight, spec.bias_name
        # Token input: each direction's layer-0 input weight is a row table updated with index_add_.
        self.tables = [self.w_in + layer_suffix(0, d) for d in range(spec.directions)] if problem.tokens else []
        self.table = self.tables[0] if self.tables else None
        self.transposed: set[str] = set()  # names stored transposed (module layout)
        self.sliced: dict[str, slice] = {}  # names that are a slice of a module parameter (nn.GRU's b_hn)
        self.p = {}
        self._load(params)
        self.train_names = [k for k in self.names if k not in self.tables]
        self.act = {"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid}[spec.activation]
        self._mm = self._product()
        self._addmm = _addmm(torch, self._mm if self.low is not None else None)
        self._elman_cell, self._lstm_cell, self._gru_cell = _cells(torch, self.act, spec.reset_after,
                                                                   self._mm if self.low is not None else None)
        self._windows: dict[int, object] = {}

    # -- set-up ---------------------------------------------------------------------
    def _load(self, params):
        for k in self.names:
            t = self.torch.tensor(np.asarray(params[k]), dtype=self.dtype, device=self.device)
            self.p[k] = t.requires_grad_(k not in self.tables)

    def _product(self):
        """``mm(a, b, b_low=None)``: ``torch.mm``, or under mixed precision the spec's product (operands rounded
        to the low type, float32 sums and result, in the backward pass too; ``backends.low_precision``)."""
        torch = self.torch
        if self.low is None:
            return lambda a, b, b_low=None: torch.mm(a, b)
        from backends import low_precision

        raw = low_precision.raw_product(torch, self.low, self.device, emulate=low_precision.EMULATE_ON_CPU)
        low_precision.check_product(torch, raw, self.low, self.device)
        return low_precision.autograd_product(torch, raw)

    def _rounded(self, W):
        """A weight rounded to the low type once for every step that multiplies by it (None: not mixed)."""
        return None if self.low is None else W.detach().to(self.low)

    def _unscale(self, grads: list) -> None:
        """Mixed precision: divide the gradients by the loss scale in place and note whether any is
        non-finite (``torch.amp``'s own check, as GradScaler does it, with the static scale)."""
        torch = self.torch
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=self.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv)

    def _reported(self, total, B: int, T: int) -> float:
        """The reported loss; NaN when a mixed-precision gradient was non-finite (the cell diverges)."""
        if self.found_inf is not None and bool(self.found_inf.item()):
            return float("nan")
        return float(total) / (B * T)

    def _own(self, k: str, t):
        """A tensor in the module's layout as SPEC.md names it: transposed back, or its slice."""
        t = t.T if k in self.transposed else t
        return t[self.sliced[k]] if k in self.sliced else t

    def get_params(self) -> dict[str, np.ndarray]:
        return {k: self._own(k, self.p[k].detach()).cpu().numpy().copy() for k in self.names}

    def _x(self, x):
        return self.torch.as_tensor(self.problem.cast_inputs(x, np.int64), device=self.device)

    def _y(self, y):
        return self.torch.as_tensor(self.problem.cast_targets(y, np.int64), device=self.device)

    def _grad_start(self, T: int) -> int:
        """First step whose input receives gradient (tail K holds the earlier ones constant)."""
        bptt = self.spec.bptt
        return max(0, T - bptt.k) if bptt.mode == "tail" else 0

    def _leaf_rows(self, xt):
        """Token input: per table, the gathered rows the gradient flows into, as leaves; None for dense input."""
        if not self.tables:
            return None
        with self.torch.no_grad():
            rows = [self.p[k][xt[self._grad_start(xt.shape[0]):]] for k in self.tables]
        return [r.requires_grad_(True) for r in rows]

    def _aux(self, T: int):
        """Gather indices of the truncated-BPTT windows, or None when no windows are needed."""
        bptt = self.spec.bptt
        if bptt.mode != "truncated" or bptt.k >= T - 1:
            return None
        if T not in self._windows:
            K, N = bptt.k, T - bptt.k - 1
            # window n (output t = K+1+n) reads steps n+1 .. n+1+K
            arange = self.torch.arange
            idx = arange(K + 1, device=self.device)[:, None] + arange(1, N + 1, device=self.device)
            self._windows[T] = idx.reshape(-1)
        return self._windows[T]

    # -- the network ----------------------------------------------------------------
    def _project(self, P, layer: int, inp, direction: int = 0):
        """``inp W + b`` for all steps at once: (S, N, Din) -> (S, N, G)."""
        s = layer_suffix(layer, direction)
        W, b = P[self.w_in + s], P.get(self.b_in + s)
        S, N = inp.shape[:2]
        flat = inp.reshape(S * N, -1)
        out = self._mm(flat, W) if b is None else self._addmm(b, flat, W)
        return out.view(S, N, -1)

    def _project0(self, P, xt, rows, start: int, stop: int, direction: int = 0):
        """Layer-0 input projection of steps start..stop-1; ``rows`` (the leaves) cover the grad steps."""
        torch = self.torch
        if not self.tables:
            return self._project(P, 0, xt[start:stop], direction)
        g0 = self._grad_start(xt.shape[0])
        use_rows = rows is not None and start >= g0
        proj = rows[direction][start - g0: stop - g0] if use_rows else P[self.tables[direction]][xt[start:stop]]
        b = P.get(self.b_in + layer_suffix(0, direction))
        return proj if b is None else torch.add(proj, b)

    def _scan(self, P, layer: int, steps, h, c, want_c: bool = False, direction: int = 0):
        """Run one layer (one direction) over ``steps`` (S, N, G) from ``(h, c)`` (None: zeros).

        Returns ``(hs (S, N, H), h, c, cs)``; ``cs`` stacks the cell states when asked.
        """
        s = layer_suffix(layer, direction)
        W_hh = P["W_hh" + s]
        W_low = self._rounded(W_hh)  # mixed precision: rounded once for every step
        hs, cs = [], []
        if self.spec.kind == "gru":
            b_hn, cell = P.get("b_hn" + s), self._gru_cell
            if h is None:
                h = steps.new_zeros(steps.shape[1], self.H)
            for a_in in steps.unbind(0):
                h = cell(a_in, h, W_hh, W_low) if b_hn is None else cell(a_in, h, W_hh, W_low, b_hn)
                hs.append(h)
            return self.torch.stack(hs), h, None, None
        if self.spec.kind == "elman":
            act, cell = self.act, self._elman_cell
            for a_in in steps.unbind(0):
                h = act(a_in) if h is None else cell(a_in, h, W_hh, W_low)
                hs.append(h)
            return self.torch.stack(hs), h, None, None
        peeps = (P["p_i" + s], P["p_f" + s], P["p_o" + s]) if self.spec.peephole else ()
        cell = self._lstm_cell
        for a_in in steps.unbind(0):
            h, c = _lstm_first(self.torch, a_in, *peeps) if h is None else cell(a_in, h, c, W_hh, W_low, *peeps)
            hs.append(h)
            if want_c:
                cs.append(c)
        return self.torch.stack(hs), h, c, (self.torch.stack(cs) if want_c else None)

    def _stack_forward(self, P, xt, rows, start, stop, state, want_c=False, inp=None):
        """Every layer over steps start..stop-1 from per-layer ``state`` (``inp``: layer 0's projection
        when already made); returns (top hs, new state, all hs, all cs)."""
        if inp is None:
            inp = self._project0(P, xt, rows, start, stop)
        new_state, all_h, all_c = [], [], []
        for layer in range(self.spec.layers):
            if layer > 0:
                inp = self._project(P, layer, all_h[-1])
            h0, c0 = state[layer] if state is not None else (None, None)
            hs, h, c, cs = self._scan(P, layer, inp, h0, c0, want_c)
            if self.spec.bidirectional:  # the reverse direction over the flipped steps, from zeros
                back = self._project0(P, xt, rows, start, stop, 1) if layer == 0 else \
                    self._project(P, layer, all_h[-1], 1)
                hs_rev = self._scan(P, layer, back.flip(0), None, None, False, 1)[0]
                hs = self.torch.cat([hs, hs_rev.flip(0)], -1)
            new_state.append((h, c))
            all_h.append(hs)
            all_c.append(cs)
        return all_h[-1], new_state, all_h, all_c

    def _logits(self, P, hs):
        flat = hs.reshape(-1, hs.shape[-1])
        b = P.get("b_y")
        return self._mm(flat, P["W_hy"]) if b is None else self._addmm(b, flat, P["W_hy"])

    def _head_sum(self, z, y):
        """``sum l`` over the rows of ``z`` (N, O) against ``y`` (rows of targets)."""
        F = self.F
        z = z.to(self.dtype)  # the head and the loss in the parameters' dtype (float32 under mixed precision)
        if self.spec.head == "softmax_xent":
            return F.cross_entropy(z, y.reshape(-1), reduction="sum")
        out = self.torch.tanh(z) if self.spec.output_act == "tanh" else z
        return 0.5 * F.mse_loss(out, y.reshape(z.shape), reduction="sum")

    def _objective(self, P, xt, yt, rows, win_idx):
        """``(L, sum l)``: the objective to differentiate (honouring bptt) and the loss sum, both tensors."""
        torch = self.torch
        T, B = xt.shape[:2]
        bptt = self.spec.bptt
        if bptt.mode == "tail" and bptt.k < T:
            t0 = T - bptt.k
            with torch.no_grad():  # the steps before the tail are constants
                hs_pre, state, _, _ = self._stack_forward(P, xt, rows, 0, t0, None)
                pre_sum = self._head_sum(self._logits(P, hs_pre), yt[:t0])
            hs, _, _, _ = self._stack_forward(P, xt, rows, t0, T, state)
            tail_sum = self._head_sum(self._logits(P, hs), yt[t0:])
            return tail_sum / B, tail_sum.detach() + pre_sum
        if win_idx is None:  # full, or a window that reaches the start anyway
            hs, _, _, _ = self._stack_forward(P, xt, rows, 0, T, None)
            total = self._head_sum(self._logits(P, hs), yt)
            return total / B, total.detach()
        return self._truncated_objective(P, xt, yt, rows, win_idx)

    def _truncated_objective(self, P, xt, yt, rows, win_idx):
        """Truncated K without a Python loop over outputs.

        Outputs t <= K reach back to the start: ordinary BPTT over steps 0..K. Each later
        output t = K+1+n gets its own window, steps n+1..t started from the detached state
        after step n; all N = T-K-1 windows run side by side as one batch of N*B rows.
        """
        torch = self.torch
        T, B = xt.shape[:2]
        K = self.spec.bptt.k
        N, L, H = T - K - 1, self.spec.layers, self.H
        lstm = self.spec.kind == "lstm"
        proj = self._project0(P, xt, rows, 0, T)
        hs_a, state_a, all_h, all_c = self._stack_forward(P, xt, rows, 0, K + 1, None, lstm, proj[: K + 1])
        with torch.no_grad():  # the windows' starting states: steps 0..N-1, reusing 0..K
            h_start = [hh.detach() for hh in all_h]
            c_start = [cc.detach() if cc is not None else None for cc in all_c]
            if N > K + 1:
                st = [(h.detach(), c.detach() if c is not None else None) for h, c in state_a]
                _, _, more_h, more_c = self._stack_forward(P, xt, rows, K + 1, N, st, lstm, proj[K + 1: N])
                h_start = [torch.cat([a, b]) for a, b in zip(h_start, more_h)]
                if lstm:
                    c_start = [torch.cat([a, b]) for a, b in zip(c_start, more_c)]
        inp = proj.index_select(0, win_idx).view(K + 1, N * B, -1)
        for layer in range(L):
            if layer > 0:
                inp = self._project(P, layer, hs)
            h0 = h_start[layer][:N].reshape(N * B, H)
            c0 = c_start[layer][:N].reshape(N * B, H) if lstm else None
            hs, h_last, _, _ = self._scan(P, layer, inp, h0, c0)
        top = torch.cat([hs_a, h_last.view(N, B, H)])
        total = self._head_sum(self._logits(P, top), yt)
        return total / B, total.detach()

    def _outputs(self, P, xt):
        hs, _, _, _ = self._stack_forward(P, xt, None, 0, xt.shape[0], None)
        z = self._logits(P, hs).view(xt.shape[0], xt.shape[1], -1).to(self.dtype)
        if self.spec.head == "softmax_xent":
            return self.torch.softmax(z, dim=-1)
        return self.torch.tanh(z) if self.spec.output_act == "tanh" else z

    # -- what the backend calls -----------------------------------------------------
    def outputs(self, x) -> np.ndarray:
        with self.torch.inference_mode():
            return self._outputs(self.p, self._x(x)).to(self.dtype).cpu().numpy()

    def _grads(self, x, y):
        """``(loss sum tensor, dense grads, row grads or None, token ids of the rows)``."""
        xt, yt = self._x(x), self._y(y)
        rows = self._leaf_rows(xt)
        obj, total = self._objective(self.p, xt, yt, rows, self._aux(xt.shape[0]))
        dense = [self.p[k] for k in self.train_names]
        inputs = dense + (rows or [])
        gs = list(self.torch.autograd.grad(obj * self.scale if self.scale != 1 else obj, inputs, allow_unused=True))
        for i, (g, t) in enumerate(zip(gs, inputs)):
            if g is None:  # e.g. p_f when no step has a previous cell state
                gs[i] = self.torch.zeros_like(t)
        if self.low is not None:
            self._unscale(gs)
        for i, k in enumerate(self.train_names):
            if k in self.sliced:  # only the slice is the parameter: the rest of the module's tensor stays
                keep = self.torch.zeros_like(gs[i])
                keep[self.sliced[k]] = gs[i][self.sliced[k]]
                gs[i] = keep
        row_grads = gs[len(dense):] if rows is not None else None
        del gs[len(dense):]
        ids = xt[self._grad_start(xt.shape[0]):].reshape(-1) if rows is not None else None
        return total, gs, row_grads, ids

    def loss_and_grads(self, x, y, as_numpy: bool = True):
        T, B = np.shape(x)[:2]
        total, gs, row_grads, ids = self._grads(x, y)
        if not as_numpy:
            return total, gs
        out = {}
        for k, g in zip(self.train_names, gs):
            out[k] = self._own(k, g).cpu().numpy()
        for table, row_grad in zip(self.tables, row_grads or []):
            W = self.p[table]
            dense = self.torch.zeros_like(W).index_add_(0, ids, row_grad.reshape(-1, W.shape[1]))
            out[table] = dense.cpu().numpy()
        return self._reported(total, B, T), {k: out[k] for k in self.names}

    def sgd_step(self, x, y, lr: float) -> float:
        torch = self.torch
        T, B = np.shape(x)[:2]
        total, gs, row_grads, all_ids = self._grads(x, y)
        clip = self.spec.clip
        with torch.no_grad():
            params = [self.p[k] for k in self.train_names]
            if clip is not None:
                torch._foreach_clamp_min_(gs, -clip)
                torch._foreach_clamp_max_(gs, clip)
            torch._foreach_add_(params, gs, alpha=-lr)
            for table, row_grad in zip(self.tables, row_grads or []):
                W, ids = self.p[table], all_ids
                rg = row_grad.reshape(-1, W.shape[1])
                if clip is not None:  # clip the per-row sums, not each token's share
                    ids, inverse = torch.unique(ids, return_inverse=True)
                    sums = torch.zeros((ids.shape[0], W.shape[1]), dtype=W.dtype, device=W.device)
                    rg = sums.index_add_(0, inverse, rg)
                    rg.clamp_(-clip, clip)
                W.index_add_(0, ids, rg, alpha=-lr)
        return self._reported(total, B, T)


def _addmm(torch, mm=None):
    """``c + a @ b``: ``torch.addmm``, or under mixed precision (``mm`` the spec's product) the float32 product
    and ``c`` (a bias, or a step's input projection) added in float32."""
    if mm is None:
        return torch.addmm
    return lambda c, a, b, b_low=None: c + mm(a, b, b_low)


def _cells(torch, act, reset_after=True, mm=None):
    """One time step of each cell, from a previous state: ``(elman(a_in, h, W_hh, W_low) -> h,
    lstm(a_in, h, c, W_hh, W_low[, p_i, p_f, p_o]) -> (h, c), gru(a_in, h, W_hh, W_low[, b_hn]) -> h)``;
    ``a_in`` is the step's input projection (with the bias ``b``). ``mm``: under mixed precision the spec's
    product (``W_low`` then ``W_hh`` rounded once per sequence), None for float32 and float64 (``W_low`` None)."""

    # Under mixed precision every product returns float32, so the gates, the cell state and h stay float32.
    if mm is None:
        addmm = lambda c, a, b, b_low=None: torch.addmm(c, a, b)  # noqa: E731
        product = lambda a, b, b_low=None: torch.mm(a, b)  # noqa: E731
    else:
        addmm, product = _addmm(torch, mm), mm

    def cols(W_low, part):
        return None if W_low is None else W_low[:, part]

    def gru(a_in, h, W_hh, W_low, b_hn=None):
        H = h.shape[1]
        if reset_after:  # one GEMM for all three gates: r * (h W_hn + b_hn)
            u = product(h, W_hh, W_low)
            r, z = torch.sigmoid(a_in[:, : 2 * H] + u[:, : 2 * H]).chunk(2, 1)
            un = u[:, 2 * H:] if b_hn is None else u[:, 2 * H:] + b_hn
            n = torch.tanh(torch.addcmul(a_in[:, 2 * H:], r, un))
        else:  # (r * h) W_hn needs r first: a second GEMM
            rz, rn = slice(0, 2 * H), slice(2 * H, 3 * H)
            r, z = torch.sigmoid(addmm(a_in[:, rz], h, W_hh[:, rz], cols(W_low, rz))).chunk(2, 1)
            n = torch.tanh(addmm(a_in[:, rn], r * h, W_hh[:, rn], cols(W_low, rn)))
        return torch.addcmul(n, z, h - n)

    def elman(a_in, h, W_hh, W_low):
        return act(addmm(a_in, h, W_hh, W_low))

    def lstm(a_in, h, c, W_hh, W_low, *peeps):
        a = addmm(a_in, h, W_hh, W_low)
        if peeps:
            pi, pf, po = peeps
            ai, af, ag, ao = a.chunk(4, 1)
            i = torch.sigmoid(torch.addcmul(ai, pi, c))
            f = torch.sigmoid(torch.addcmul(af, pf, c))
            c = torch.addcmul(f * c, i, torch.tanh(ag))
            o = torch.sigmoid(torch.addcmul(ao, po, c))
        else:
            # one sigmoid over all four gates is cheaper than three launches; g's slot is unused
            H = a.shape[1] // 4
            i, f, _, o = torch.sigmoid(a).chunk(4, 1)
            c = torch.addcmul(f * c, i, torch.tanh(a[:, 2 * H: 3 * H]))
        return o * torch.tanh(c), c

    return elman, lstm, gru


def _lstm_first(torch, a_in, *peeps):
    """The LSTM's first step from zero state: no recurrent product, ``c = i * g``."""
    ai, _, ag, ao = a_in.chunk(4, 1)
    c = torch.sigmoid(ai) * torch.tanh(ag)
    o = torch.sigmoid(torch.addcmul(ao, peeps[2], c) if peeps else ao)
    return o * torch.tanh(c), c


class _CompiledNet(_Net):
    """The autograd network with each time step's cell compiled by torch.compile (inductor).

    Compiling the cell, not the unrolled sequence, keeps the graph one step long: compile
    time does not grow with the steps and layers (a 4-layer, 100-step LSTM unrolled into one
    graph did not finish compiling in minutes on a GPU), while the step's element-wise gate
    maths still fuses into one kernel forward and one backward. The projections over all
    steps and the head stay single large products, as in the autograd variant.
    """

    def __init__(self, problem, params, device):
        super().__init__(problem, params, device)
        torch = self.torch
        # A fresh cache per problem, and a hard error instead of dynamo's silent eager
        # fallback once the recompile limit is hit (each distinct row count and grad mode
        # of a step is one graph: training, inference, truncated windows).
        torch._dynamo.reset()
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        self._elman_cell = torch.compile(self._elman_cell, fullgraph=True, dynamic=False)
        self._lstm_cell = torch.compile(self._lstm_cell, fullgraph=True, dynamic=False)
        self._gru_cell = torch.compile(self._gru_cell, fullgraph=True, dynamic=False)


class _FusedNet(_Net):
    """torch.nn.RNN / nn.LSTM / nn.GRU (time-major, ``bidirectional`` as the model asks) holding the
    recurrent weights; the head as matmuls.

    The module stores ``W_ih^T`` / ``W_hh^T``; ``b`` lives in ``bias_ih``, and ``bias_hh`` is a
    frozen zero except nn.GRU's last third, which is ``b_hn`` (PyTorch's ``b_hr``, ``b_hz`` would
    only add to ``b_ir``, ``b_iz``): its gradient and update touch that slice alone. For token
    input the module's layer-0 input weight is a frozen identity (per direction, the block that
    picks its own table's rows) and its input the gathered rows ``W_ih[x]`` (with
    ``W_ih_rev[x]`` beside them): the module always multiplies its input by ``weight_ih``, so
    this costs one extra (T*B, G) x (G, G) product per direction over all steps, outside the
    recurrence, and is exact in floating point (TF32 off); it keeps the row gather honest.
    """

    def _load(self, params):
        torch, spec = self.torch, self.spec
        H, L, ndir = spec.hidden, spec.layers, spec.directions
        G = spec.gates * H
        d_in = ndir * G if self.problem.tokens else params[self.w_in].shape[0]
        if spec.kind == "elman":
            mod = torch.nn.RNN(d_in, H, num_layers=L, nonlinearity=spec.activation, bias=spec.bias,
                               bidirectional=spec.bidirectional)
        else:
            module = torch.nn.LSTM if spec.kind == "lstm" else torch.nn.GRU
            mod = module(d_in, H, num_layers=L, bias=spec.bias, bidirectional=spec.bidirectional)
        mod = mod.to(device=self.device, dtype=self.dtype)
        for prm in mod.parameters():
            prm.requires_grad_(False)
        own = {}  # SPEC.md name -> module parameter
        with torch.no_grad():
            for layer in range(L):
                for d in range(ndir):
                    s, m = layer_suffix(layer, d), f"l{layer}" + ("_reverse" if d else "")
                    w_ih = getattr(mod, f"weight_ih_{m}")
                    if layer == 0 and self.problem.tokens:
                        w_ih.zero_()
                        w_ih[:, d * G: (d + 1) * G] = torch.eye(G, dtype=self.dtype, device=self.device)
                    else:
                        w_ih.copy_(torch.as_tensor(np.asarray(params[self.w_in + s]).T))
                        own[self.w_in + s] = w_ih
                    own["W_hh" + s] = getattr(mod, f"weight_hh_{m}")
                    own["W_hh" + s].copy_(torch.as_tensor(np.asarray(params["W_hh" + s]).T))
                    if spec.bias:
                        own[self.b_in + s] = getattr(mod, f"bias_ih_{m}")
                        own[self.b_in + s].copy_(torch.as_tensor(np.asarray(params[self.b_in + s])))
                        bias_hh = getattr(mod, f"bias_hh_{m}")
                        bias_hh.zero_()
                        if spec.kind == "gru":
                            bias_hh[2 * H:] = torch.as_tensor(np.asarray(params["b_hn" + s]))
                            own["b_hn" + s] = bias_hh
                            self.sliced["b_hn" + s] = slice(2 * H, 3 * H)
        if self.device.type == "cuda":
            mod.flatten_parameters()  # one cuDNN weight buffer; in-place updates keep it valid
        for k, prm in own.items():
            self.p[k] = prm
            if prm.dim() == 2:
                self.transposed.add(k)
        for k in self.names:
            if k not in self.p:  # the head, and the token tables
                self.p[k] = torch.tensor(np.asarray(params[k]), dtype=self.dtype, device=self.device)
            self.p[k].requires_grad_(k not in self.tables)
        self.mod = mod

    def _inputs(self, xt, rows, start, stop):
        if not self.tables:
            return xt[start:stop]
        g0 = self._grad_start(xt.shape[0])
        if rows is not None and start >= g0:
            parts = [r[start - g0: stop - g0] for r in rows]
        else:
            parts = [self.p[k][xt[start:stop]] for k in self.tables]
        return parts[0] if len(parts) == 1 else self.torch.cat(parts, -1)

    def _objective(self, P, xt, yt, rows, win_idx):
        T, B = xt.shape[:2]
        bptt = self.spec.bptt
        if bptt.mode == "tail" and bptt.k < T:
            t0 = T - bptt.k
            with self.torch.no_grad():  # the steps before the tail are constants
                hs_pre, state = self.mod(self._inputs(xt, rows, 0, t0))
                pre_sum = self._head_sum(self._logits(P, hs_pre), yt[:t0])
            hs, _ = self.mod(self._inputs(xt, rows, t0, T), state)
            tail_sum = self._head_sum(self._logits(P, hs), yt[t0:])
            return tail_sum / B, tail_sum.detach() + pre_sum
        if win_idx is not None:
            return self._truncated_objective(P, xt, yt, rows, win_idx)
        hs, _ = self.mod(self._inputs(xt, rows, 0, T))
        total = self._head_sum(self._logits(P, hs), yt)
        return total / B, total.detach()

    def _truncated_objective(self, P, xt, yt, rows, win_idx):
        """Truncated K through the module: outputs t <= K from one call over steps 0..K; each later
        output t = K+1+n from window n, steps n+1..t started from the state after step n, detached.
        All N = T-K-1 windows are one module call of K+1 steps over N*B sequences."""
        torch = self.torch
        T, B = xt.shape[:2]
        K, L, H = self.spec.bptt.k, self.spec.layers, self.H
        N = T - K - 1
        lstm = self.spec.kind == "lstm"
        inputs = self._inputs(xt, rows, 0, T)
        hs_a, _ = self.mod(inputs[: K + 1])
        with torch.no_grad():  # every layer's (h, c) after steps 0..N-1: the windows' starting states
            if L == 1 and not lstm:  # the output sequence is the state sequence
                h_start, c_start = self.mod(inputs[:N])[0].unsqueeze(0), None  # (1, N, B, H)
            else:  # the module returns every layer's state only at the end of a call: one step per call
                hh, cc, state = [], [], None
                for t in range(N):
                    _, state = self.mod(inputs[t: t + 1], state)
                    hh.append(state[0] if lstm else state)
                    if lstm:
                        cc.append(state[1])
                h_start = torch.stack(hh, 1)  # (L, N, B, H)
                c_start = torch.stack(cc, 1) if lstm else None
        h0 = h_start.reshape(L, N * B, H)
        win = inputs.index_select(0, win_idx).view(K + 1, N * B, -1)
        hs_w, _ = self.mod(win, (h0, c_start.reshape(L, N * B, H)) if lstm else h0)
        top = torch.cat([hs_a, hs_w[-1].view(N, B, H)])
        total = self._head_sum(self._logits(P, top), yt)
        return total / B, total.detach()

    def _outputs(self, P, xt):
        hs, _ = self.mod(self._inputs(xt, None, 0, xt.shape[0]))
        z = self._logits(P, hs)
        z = z.to(self.dtype)
        if self.spec.head == "softmax_xent":
            return self.torch.softmax(z, dim=-1).view(xt.shape[0], xt.shape[1], -1)
        out = self.torch.tanh(z) if self.spec.output_act == "tanh" else z
        return out.view(xt.shape[0], xt.shape[1], -1)
