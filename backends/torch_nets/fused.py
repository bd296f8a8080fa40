"""``torch:fused``: nn.RNN / nn.LSTM / nn.GRU over the whole sequence (oneDNN on the CPU, cuDNN on a GPU)."""

from __future__ import annotations

import numpy as np

from backends.torch_nets.autograd import Net
from harness.spec.model import layer_suffix


class FusedNet(Net):
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
