"""``torch:autograd``: the SPEC.md cell written step by step in torch ops, autograd doing BPTT; the
parameters, the objective under each bptt mode (full, truncated windows side by side, tail), the
gradients (token tables as gathered rows) and the SGD update. The other variants derive from it."""

from __future__ import annotations

import numpy as np

from backends.torch_nets.cells import addmm_of, lstm_first, step_cells
from harness.spec.model import Problem, layer_suffix


class Net:
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
        self._addmm = addmm_of(torch, self._mm if self.low is not None else None)
        self._elman_cell, self._lstm_cell, self._gru_cell = step_cells(torch, self.act, spec.reset_after,
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
            h, c = lstm_first(self.torch, a_in, *peeps) if h is None else cell(a_in, h, c, W_hh, W_low, *peeps)
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
