"""The cuda backend's Triton kernels and its conformance, through Triton's CPU interpreter.

Each kernel is checked against torch on small shapes in float32 and float64; the variants against
the reference on a few conformance cases. Triton decides at decoration time whether a kernel is
compiled or interpreted, so the fixture below sets ``TRITON_INTERPRET=1`` before the kernel modules
are first imported (and restores the variable afterwards, so other tests' backend listings do not
see the interpreter switched on).
"""

import importlib
import importlib.util
import os

import numpy as np
import pytest

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("the cuda backend needs torch and triton (pip install 'rnn-harness[cuda]')", allow_module_level=True)

import torch  # noqa: E402

import backends  # noqa: E402
from harness.verify.check import Case, all_cases, gru_or_bidirectional, representative_cases, run_case  # noqa: E402
from harness.spec.model import ModelSpec, Problem  # noqa: E402

DTYPES = (torch.float64, torch.float32)
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


@pytest.fixture(scope="module")
def K(interpreter):
    """The kernel modules, imported with the interpreter on."""
    from triton.runtime.interpreter import InterpretedFunction

    mods = {m: importlib.import_module(f"backends.cuda.{m}") for m in ("elementwise", "lstm", "elman", "gru", "persistent")}
    if not isinstance(mods["lstm"]._lstm_fwd_kernel, InterpretedFunction):
        pytest.skip("the cuda kernels were imported compiled before this module (on a GPU machine): "
                    "run this file on its own to check them under the interpreter")
    return mods


def _close(got, want, dtype):
    want = want.detach()
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"max |err| {err:.3g}"


# -- element-wise kernels (cuda:naive, cuda:grouped) ---------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 33)])
def test_unary_and_binary_ops_on_column_slices(K, dtype, shape):
    E = K["elementwise"]
    g = torch.Generator().manual_seed(sum(shape))
    R, C = shape
    big = torch.randn(R, 3 * C, dtype=dtype, generator=g)
    x = big[:, C:2 * C]  # a column slice, as one gate of a (B, 4H) matrix
    s = torch.sigmoid(x)
    want = {"sigmoid": s, "tanh": torch.tanh(x), "relu": torch.relu(x), "dsigmoid": x * (1 - x),
            "dtanh": 1 - x * x, "drelu": (x > 0).to(dtype)}
    for op, w in want.items():
        _close(E.unary(op, x), w, dtype)
    y = big[:, :C]
    row = torch.randn(C, dtype=dtype, generator=g)
    for op, w in (("add", x + y), ("sub", x - y), ("mul", x * y)):
        _close(E.binary(op, x, y), w, dtype)
    _close(E.binary("mul", x, row, row=True), x * row, dtype)
    out = torch.zeros(R, 3 * C, dtype=dtype)
    E.binary("add", x, y, out=out[:, 2 * C:])  # written into a slice, the rest untouched
    _close(out[:, 2 * C:], x + y, dtype)
    assert not out[:, :2 * C].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip", [None, 0.3])
def test_sgd_kernel_clips_then_steps(K, dtype, clip):
    g = torch.Generator().manual_seed(1)
    p = torch.randn(5, 7, dtype=dtype, generator=g)
    grad = torch.randn(5, 7, dtype=dtype, generator=g)
    lr = torch.tensor([0.1], dtype=dtype)
    want = p - 0.1 * (grad if clip is None else grad.clamp(-clip, clip))
    K["elementwise"].sgd_(p, grad, lr, None if clip is None else torch.tensor([clip], dtype=dtype))
    _close(p, want, dtype)


# -- fused step kernels ---------------------------------------------------------------
def _lstm_cell(pre, rec, c_prev, peep):
    a = pre if rec is None else pre + rec
    ai, af, ag, ao = a.chunk(4, -1)
    if peep is not None:
        ai, af = ai + peep[0] * c_prev, af + peep[1] * c_prev
    i, f, g = torch.sigmoid(ai), torch.sigmoid(af), torch.tanh(ag)
    c = f * c_prev + i * g
    o = torch.sigmoid(ao + (peep[2] * c if peep is not None else 0))
    return o * torch.tanh(c), c, torch.cat([i, f, g, o], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R, H", [(1, 1), (3, 4), (5, 17)])
@pytest.mark.parametrize("peephole", [False, True])
def test_fused_lstm_step_forward_and_backward(K, dtype, R, H, peephole):
    L = K["lstm"]
    g = torch.Generator().manual_seed(R * 31 + H)
    rnd = lambda *s: torch.randn(*s, dtype=dtype, generator=g)  # noqa: E731
    pre, rec, c_prev = rnd(R, 4 * H), rnd(R, 4 * H), rnd(R, H)
    peep = tuple(rnd(H) for _ in range(3)) if peephole else None
    for r in (rec, None):
        h, c, gates = torch.empty(R, H, dtype=dtype), torch.empty(R, H, dtype=dtype), torch.empty(R, 4 * H, dtype=dtype)
        L.forward_step(pre, r, c_prev, peep, h, c, gates)
        wh, wc, wg = _lstm_cell(pre, r, c_prev, peep)
        _close(h, wh, dtype)
        _close(c, wc, dtype)
        _close(gates, wg, dtype)
    # backward: da = dL/da and the carried dL/dc_prev (through c only) against autograd
    a = (pre + rec).requires_grad_(True)
    cp = c_prev.clone().requires_grad_(True)
    wh, wc, _ = _lstm_cell(a, None, cp, peep)
    dh_out, dh_rec, dc_next = rnd(R, H), rnd(R, H), rnd(R, H)
    torch.autograd.backward([wh, wc], [dh_out + dh_rec, dc_next])
    h, c, gates = torch.empty(R, H, dtype=dtype), torch.empty(R, H, dtype=dtype), torch.empty(R, 4 * H, dtype=dtype)
    L.forward_step(pre, rec, c_prev, peep, h, c, gates)
    da, dc = torch.empty(R, 4 * H, dtype=dtype), torch.empty(R, H, dtype=dtype)
    L.backward_step(dh_out, dh_rec, dc_next, gates, c_prev, c, peep, da, dc)
    _close(da, a.grad, dtype)
    _close(dc, cp.grad, dtype)
    L.backward_step(None, dh_rec, None, gates, c_prev, c, peep, da, dc)  # absent inputs are zeros
    a.grad, cp.grad = None, None
    wh, wc, _ = _lstm_cell(a, None, cp, peep)
    torch.autograd.backward([wh], [dh_rec])
    _close(da, a.grad, dtype)
    _close(dc, cp.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["tanh", "relu", "sigmoid"])
def test_fused_elman_step_forward_and_backward(K, dtype, activation):
    E = K["elman"]
    g = torch.Generator().manual_seed(3)
    pre, rec = torch.randn(4, 6, dtype=dtype, generator=g), torch.randn(4, 6, dtype=dtype, generator=g)
    fn = {"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid}[activation]
    a = (pre + rec).requires_grad_(True)
    want = fn(a)
    h = torch.empty(4, 6, dtype=dtype)
    E.forward_step(pre, rec, h, activation)
    _close(h, want, dtype)
    E.forward_step(pre, None, h, activation)
    _close(h, fn(pre), dtype)
    E.forward_step(pre, rec, h, activation)
    dh_out, dh_rec = torch.randn(4, 6, dtype=dtype, generator=g), torch.randn(4, 6, dtype=dtype, generator=g)
    want.backward(dh_out + dh_rec)
    da = torch.empty(4, 6, dtype=dtype)
    E.backward_step(dh_out, dh_rec, h, da, activation)
    _close(da, a.grad, dtype)


def _gru_cell(pre, rec, b_hn, h_prev, w_n=None):
    """The spec's GRU step from ``pre = x W_ih + b`` and the recurrent product: reset after, ``rec`` is
    ``h_prev W_hh`` (3H); reset before (``w_n`` = W_hh[:, 2H:]), ``rec`` is ``h_prev W_hh[:, :2H]``.
    Returns ``h`` and the stored gates r, z, n, un | r * h_prev."""
    ar, az, an = pre.chunk(3, -1)
    r, z = torch.sigmoid(ar + rec[:, :ar.shape[1]]), torch.sigmoid(az + rec[:, ar.shape[1]:2 * ar.shape[1]])
    if w_n is None:
        x = rec[:, 2 * ar.shape[1]:] + (0 if b_hn is None else b_hn)
        n = torch.tanh(an + r * x)
    else:
        x = r * h_prev
        n = torch.tanh(an + x @ w_n)
    return (1 - z) * n + z * h_prev, torch.cat([r, z, n, x], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R, H", [(1, 1), (3, 4), (5, 17)])
@pytest.mark.parametrize("reset_after", [True, False])
def test_fused_gru_step_forward_and_backward(K, dtype, R, H, reset_after):
    G = K["gru"]
    g = torch.Generator().manual_seed(R * 17 + H)
    rnd = lambda *s: torch.randn(*s, dtype=dtype, generator=g)  # noqa: E731
    pre, h_prev, b_hn = rnd(R, 3 * H), rnd(R, H), rnd(H)
    rec = rnd(R, 3 * H) if reset_after else rnd(R, 2 * H)
    w_n = None if reset_after else 0.5 * rnd(H, H)

    def fused_forward(rec_or_none):
        h, gates = torch.empty(R, H, dtype=dtype), torch.full((R, 4 * H), float("nan"), dtype=dtype)
        if reset_after:
            G.forward_step(pre, rec_or_none, b_hn, h_prev, h, gates)
        else:
            G.reset_gate_step(pre, rec_or_none, h_prev, gates)
            G.new_gate_step(pre, gates[:, 3 * H:] @ w_n, h_prev, gates, h)
        return h, gates

    for r in (rec, None):  # None: the first step's absent product is zero
        h, gates = fused_forward(r)
        wh, wg = _gru_cell(pre, torch.zeros_like(rec) if r is None else r, b_hn, h_prev, w_n)
        _close(h, wh, dtype)
        _close(gates, wg, dtype)
    if reset_after:
        h_nob = torch.empty(R, H, dtype=dtype)
        G.forward_step(pre, rec, None, h_prev, h_nob)  # no bias, no stored gates
        _close(h_nob, _gru_cell(pre, rec, None, h_prev)[0], dtype)
    # backward against autograd: da (pre-activations, as backends.cuda.gru lays it out) and the carry dc,
    # the gradient reaching h_prev outside the recurrent GEMM (rec a separate leaf)
    pre_l, rec_l, hp_l = (t.clone().requires_grad_(True) for t in (pre, rec, h_prev))
    wh, _ = _gru_cell(pre_l, rec_l, b_hn, hp_l, w_n)
    dh_out, dh_rec, dc_next = rnd(R, H), rnd(R, H), rnd(R, H)
    wh.backward(dh_out + dh_rec + dc_next)
    _, gates = fused_forward(rec)
    da = torch.full((R, 4 * H if reset_after else 3 * H), float("nan"), dtype=dtype)
    dc = torch.empty(R, H, dtype=dtype)
    if reset_after:
        G.backward_step(dh_out, dh_rec, dc_next, gates, h_prev, da, dc)
        _close(torch.cat([da[:, :2 * H], da[:, 3 * H:]], -1), pre_l.grad, dtype)
        _close(da[:, :3 * H], rec_l.grad, dtype)  # dar, daz, dun: what W_hh's GEMMs read
    else:
        G.new_gate_backward(dh_out, dh_rec, dc_next, gates, h_prev, da, dc)
        G.reset_gate_backward(da[:, 2 * H:] @ w_n.t(), gates, h_prev, da, dc)
        _close(da, pre_l.grad, dtype)
        _close(da[:, :2 * H], rec_l.grad, dtype)
    _close(dc, hp_l.grad, dtype)
    # absent inputs are zeros
    pre_l.grad, rec_l.grad, hp_l.grad = None, None, None
    wh, _ = _gru_cell(pre_l, rec_l, b_hn, hp_l, w_n)
    wh.backward(dh_rec)
    if reset_after:
        G.backward_step(None, dh_rec, None, gates, h_prev, da, dc)
    else:
        G.new_gate_backward(None, dh_rec, None, gates, h_prev, da, dc)
        G.reset_gate_backward(da[:, 2 * H:] @ w_n.t(), gates, h_prev, da, dc)
    _close(dc, hp_l.grad, dtype)
    _close(da[:, :2 * H], pre_l.grad[:, :2 * H], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, B, H, block_b", [(1, 1, 1, None), (4, 3, 5, None), (3, 5, 6, 2)])
@pytest.mark.parametrize("cell", ["lstm", "lstm-peephole", "elman-relu"])
def test_persistent_layer_matches_step_by_step(K, dtype, T, B, H, block_b, cell):
    P = K["persistent"]
    g = torch.Generator().manual_seed(T * 100 + B * 10 + H)
    lstm = cell.startswith("lstm")
    G = 4 * H if lstm else H
    pre = torch.randn(T, B, G, dtype=dtype, generator=g)
    w_t = 0.5 * torch.randn(G, H, dtype=dtype, generator=g)  # W_hh^T
    peep = tuple(torch.randn(H, dtype=dtype, generator=g) for _ in range(3)) if cell == "lstm-peephole" else None
    hs = torch.zeros(T + 1, B, H, dtype=dtype)
    cs = torch.zeros_like(hs) if lstm else None
    gates = torch.empty(T, B, G, dtype=dtype) if lstm else None
    bar = P.run_layer(pre, w_t, hs, cs, gates, peep, lstm, "relu", block_b=block_b)
    P.raise_on_barrier_timeout(bar)
    h = torch.zeros(B, H, dtype=dtype)
    c = torch.zeros(B, H, dtype=dtype)
    for t in range(T):
        if lstm:
            h, c, gt = _lstm_cell(pre[t], h @ w_t.t(), c, peep)
            _close(cs[t + 1], c, dtype)
            _close(gates[t], gt, dtype)
        else:
            h = torch.relu(pre[t] + h @ w_t.t())
        _close(hs[t + 1], h, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", ["lstm-peephole", "elman-tanh"])
def test_persistent_programs_split_the_hidden_units(K, dtype, cell):
    """Several programs, each owning 2 of 5 hidden units and reading the whole start state: one step
    (the interpreter runs programs in turn, so a grid barrier between steps cannot be passed here)."""
    P = K["persistent"]
    g = torch.Generator().manual_seed(11)
    lstm = cell.startswith("lstm")
    B, H = 3, 5
    G = 4 * H if lstm else H
    pre = torch.randn(1, B, G, dtype=dtype, generator=g)
    w_t = 0.5 * torch.randn(G, H, dtype=dtype, generator=g)
    peep = tuple(torch.randn(H, dtype=dtype, generator=g) for _ in range(3)) if lstm else None
    hs = torch.zeros(2, B, H, dtype=dtype)
    hs[0] = torch.randn(B, H, dtype=dtype, generator=g)
    cs = torch.zeros_like(hs) if lstm else None
    if lstm:
        cs[0] = torch.randn(B, H, dtype=dtype, generator=g)
    gates = torch.empty(1, B, G, dtype=dtype) if lstm else None
    P.raise_on_barrier_timeout(P.run_layer(pre, w_t, hs, cs, gates, peep, lstm, "tanh", block_h=2))
    if lstm:
        h, c, gt = _lstm_cell(pre[0], hs[0] @ w_t.t(), cs[0], peep)
        _close(cs[1], c, dtype)
        _close(gates[0], gt, dtype)
    else:
        h = torch.tanh(pre[0] + hs[0] @ w_t.t())
    _close(hs[1], h, dtype)
    with pytest.raises(ValueError, match="T == 1"):
        P.run_layer(pre.repeat(2, 1, 1), w_t, hs.repeat(2, 1, 1)[:3].contiguous(), None if cs is None else
                    cs.repeat(2, 1, 1)[:3].contiguous(), None, peep, lstm, "tanh", block_h=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, B, H, block_b", [(1, 1, 1, None), (4, 3, 5, None), (3, 5, 6, 2)])
@pytest.mark.parametrize("reset_after", [True, False])
def test_persistent_gru_layer_matches_step_by_step(K, dtype, T, B, H, block_b, reset_after):
    P = K["persistent"]
    g = torch.Generator().manual_seed(T * 100 + B * 10 + H + 1)
    pre = torch.randn(T, B, 3 * H, dtype=dtype, generator=g)
    w_t = 0.5 * torch.randn(3 * H, H, dtype=dtype, generator=g)  # W_hh^T
    b_hn = torch.randn(H, dtype=dtype, generator=g)
    hs = torch.zeros(T + 1, B, H, dtype=dtype)
    hs[0] = torch.randn(B, H, dtype=dtype, generator=g)  # a non-zero start exercises every product
    gates = torch.empty(T, B, 4 * H, dtype=dtype)
    P.raise_on_barrier_timeout(P.run_gru_layer(pre, w_t, b_hn, hs, gates, reset_after, block_b=block_b))
    h = hs[0]
    for t in range(T):
        if reset_after:
            h, gt = _gru_cell(pre[t], h @ w_t.t(), b_hn, h)
        else:
            h, gt = _gru_cell(pre[t], h @ w_t[:2 * H].t(), None, h, w_t[2 * H:].t())
        _close(gates[t], gt, dtype)
        _close(hs[t + 1], h, dtype)
    if reset_after:  # inference: nothing stored, the same h
        hs2 = hs.clone()
        hs2[1:] = 0
        P.raise_on_barrier_timeout(P.run_gru_layer(pre, w_t, b_hn, hs2, None, True))
        _close(hs2, hs, dtype)
    else:
        with pytest.raises(ValueError, match="through gates"):
            P.run_gru_layer(pre, w_t, None, hs, None, False)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("cell", ["lstm", "gru-before"])
def test_persistent_kernels_round_the_products_operands(K, low, cell):
    """Mixed precision: the persistent kernels' recurrent products are those of h and W_hh rounded to the low
    type, summed in float32 (the state and gates float32): the step-by-step cell with rounded operands."""
    P = K["persistent"]
    g = torch.Generator().manual_seed(5)
    T, B, H = 3, 2, 5
    lt = getattr(torch, low)
    r = lambda t: t.to(lt).float()  # noqa: E731
    G = 3 * H if cell.startswith("gru") else 4 * H
    pre = torch.randn(T, B, G, generator=g)
    w_t = 0.5 * torch.randn(G, H, generator=g)
    hs = torch.zeros(T + 1, B, H)
    hs[0] = torch.randn(B, H, generator=g)
    gates = torch.empty(T, B, 4 * H)
    if cell == "lstm":
        cs = torch.zeros_like(hs)
        P.raise_on_barrier_timeout(P.run_layer(pre, w_t, hs, cs, gates, None, True, low=low))
    else:
        P.raise_on_barrier_timeout(P.run_gru_layer(pre, w_t, None, hs, gates, False, low=low))
    for t in range(T):  # each step from the kernel's own previous state (a state within rounding of a tie may
        h = hs[t]           # round the other way after a float32 sum in another order, and carry that on)
        if cell == "lstm":
            h, _, _ = _lstm_cell(pre[t], r(h) @ r(w_t).t(), cs[t], None)
        else:  # reset before: r * h_prev is a product's operand too
            ar, az, an = pre[t].chunk(3, -1)
            rz = r(h) @ r(w_t[:2 * H]).t()
            rg, z = torch.sigmoid(ar + rz[:, :H]), torch.sigmoid(az + rz[:, H:])
            n = torch.tanh(an + r(rg * h) @ r(w_t[2 * H:]).t())
            h = (1 - z) * n + z * h
        torch.testing.assert_close(hs[t + 1], h, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_persistent_gru_programs_split_the_hidden_units(K, dtype):
    """Reset after, several programs each owning 2 of 5 units, one step (as for the LSTM above); reset
    before has a barrier inside every step, so under the interpreter it runs one program only."""
    P = K["persistent"]
    g = torch.Generator().manual_seed(12)
    B, H = 3, 5
    pre = torch.randn(1, B, 3 * H, dtype=dtype, generator=g)
    w_t = 0.5 * torch.randn(3 * H, H, dtype=dtype, generator=g)
    hs = torch.zeros(2, B, H, dtype=dtype)
    hs[0] = torch.randn(B, H, dtype=dtype, generator=g)
    gates = torch.empty(1, B, 4 * H, dtype=dtype)
    P.raise_on_barrier_timeout(P.run_gru_layer(pre, w_t, None, hs, gates, True, block_h=2))
    h, gt = _gru_cell(pre[0], hs[0] @ w_t.t(), None, hs[0])
    _close(gates[0], gt, dtype)
    _close(hs[1], h, dtype)
    with pytest.raises(ValueError, match="T == 1"):
        P.run_gru_layer(pre, w_t, None, hs, gates, False, block_h=2)


# -- the backend ----------------------------------------------------------------------
def _small(kind: dict, label: str, dtype: str, tokens=False, layers=2, T=4, B=2) -> Case:
    spec = ModelSpec.from_mapping({"hidden": 3, "layers": layers, **kind})
    return Case(label, spec, tokens, 5, 6, T, B, dtype, seed=7)


# Every variant on a case its own machinery changes (streams and graph need two layers for the
# wavefront); cuda:fused, the kernels every later variant builds on, on the representative set.
VARIANT_CASES = [
    ("naive", _small({"kind": "lstm", "peephole": True, "head": "mse", "bptt": {"truncated": 1}}, "lstm-peephole trunc", "float64", layers=1, T=3)),
    ("naive", _small({"kind": "elman", "activation": "sigmoid"}, "elman-sigmoid L=2 tokens", "float32", tokens=True)),
    ("grouped", _small({"kind": "lstm", "peephole": True, "bptt": {"tail": 2}, "clip": 0.5}, "lstm-peephole tail clip", "float32", layers=1)),
    ("grouped", _small({"kind": "elman", "bptt": {"truncated": 1}}, "elman L=2 trunc", "float64", T=3)),
    ("streams", _small({"kind": "lstm", "peephole": True, "head": "mse", "output_act": "tanh"}, "lstm-peephole L=3 full", "float64", layers=3)),
    ("streams", _small({"kind": "elman", "bptt": {"truncated": 1}}, "elman L=2 trunc tokens", "float32", tokens=True)),
    ("graph", _small({"kind": "lstm", "bptt": {"truncated": 2}}, "lstm L=2 trunc tokens", "float64", tokens=True)),
    ("persistent", _small({"kind": "lstm", "peephole": True, "bptt": {"tail": 3}}, "lstm-peephole L=2 tail", "float64", B=3)),
    ("persistent", _small({"kind": "elman", "activation": "relu", "head": "mse"}, "elman-relu L=1", "float32", layers=1)),
]
# GRU in both forms and bidirectional layers, on what each variant does differently: per-gate GEMMs and
# op-by-op kernels (naive), the grouped GEMMs' gate maps (grouped), the wavefront over GRU layers and
# bidirectional layers in sequence (streams, graph), the persistent GRU kernels (persistent)
GRU_BI_CASES = [
    ("naive", _small({"kind": "gru", "bptt": {"truncated": 1}}, "gru trunc tokens", "float32", tokens=True, layers=1, T=3)),
    ("naive", _small({"kind": "gru", "reset_after": False, "bidirectional": True, "head": "mse"}, "gru-before-bi", "float64", layers=1, T=3)),
    ("grouped", _small({"kind": "gru", "reset_after": False, "bptt": {"tail": 2}, "clip": 0.5}, "gru-before tail clip", "float32", layers=1)),
    ("grouped", _small({"kind": "gru", "bidirectional": True, "bias": False}, "gru-bi nobias tokens", "float64", tokens=True, layers=1, T=3)),
    ("streams", _small({"kind": "gru", "reset_after": False, "head": "mse", "output_act": "tanh"}, "gru-before L=3 full", "float64", layers=3)),
    ("streams", _small({"kind": "elman", "activation": "relu", "bidirectional": True}, "elman-relu-bi L=2", "float32")),
    ("graph", _small({"kind": "gru", "bptt": {"truncated": 2}}, "gru L=2 trunc tokens", "float64", tokens=True)),
    ("graph", _small({"kind": "lstm", "peephole": True, "bidirectional": True}, "lstm-peephole-bi L=2", "float32", T=3)),
    ("persistent", _small({"kind": "gru", "bptt": {"tail": 3}}, "gru L=2 tail", "float64", B=3)),
    ("persistent", _small({"kind": "gru", "reset_after": False, "bidirectional": True}, "gru-before-bi L=2 tokens", "float32", tokens=True, T=3)),
]


# Mixed precision (the products emulated under the interpreter): each variant once, bfloat16 and float16, on
# what its machinery changes (per-gate products, grouped gate maps, the wavefront, the persistent kernels)
MIXED_CASES = [
    ("naive", _small({"kind": "gru", "reset_after": False, "bptt": {"truncated": 1}}, "gru-before trunc tokens", "float16", tokens=True, layers=1, T=3)),
    ("grouped", _small({"kind": "lstm", "peephole": True, "bptt": {"tail": 2}, "clip": 0.5}, "lstm-peephole tail clip", "bfloat16", layers=1)),
    ("fused", _small({"kind": "gru", "bidirectional": True, "head": "mse"}, "gru-bi", "bfloat16", layers=1, T=3)),
    ("streams", _small({"kind": "lstm", "head": "mse", "output_act": "tanh"}, "lstm L=2", "float16")),
    ("graph", _small({"kind": "elman", "activation": "relu", "bptt": {"truncated": 2}}, "elman-relu L=2 trunc tokens", "bfloat16", tokens=True)),
    ("persistent", _small({"kind": "gru", "reset_after": False, "bptt": {"tail": 3}}, "gru-before L=2 tail", "float16", B=3)),
    ("persistent", _small({"kind": "lstm", "peephole": True}, "lstm-peephole", "bfloat16", layers=1, B=3)),
]


def _passes(name, case):
    res = run_case(backends.create(name), case, "cpu")
    assert res.status == "pass", f"{res.status}: {res.reason}\n{res.details.get('traceback', '')}"


@pytest.mark.parametrize("case", representative_cases(), ids=lambda c: f"{c.label} {c.dtype}")
def test_fused_conformance_representative(K, case):
    _passes("cuda:fused", case)


@pytest.mark.parametrize("variant, case", VARIANT_CASES + GRU_BI_CASES,
                         ids=lambda v: v if isinstance(v, str) else v.label)
def test_each_variant_conforms(K, variant, case):
    _passes(f"cuda:{variant}", case)


@pytest.mark.parametrize("variant, case", MIXED_CASES, ids=lambda v: v if isinstance(v, str) else f"{v.label} {v.dtype}")
def test_each_variant_conforms_in_mixed_precision(K, variant, case):
    res = run_case(backends.create(f"cuda:{variant}"), case, "cpu")
    assert res.status == "pass", f"{res.status}: {res.reason}\n{res.details.get('traceback', '')}"
    from harness.spec.tolerance import ROUNDED

    assert res.worst_ratio < 0.5 and res.details["ratios"][ROUNDED] < 0.05, res.details  # the spec's roundings


def test_float16_overflow_makes_the_loss_nan(K):
    """A loss scale that overflows float16 makes the gradient non-finite: the step's loss is NaN (diverged)."""
    from dataclasses import replace

    from harness.verify.check import initial_params, make_data

    case = replace(MIXED_CASES[3][1], loss_scale=2.0 ** 32)
    backend = backends.create("cuda:fused")
    backend.prepare(case.problem("train_step", "cpu"), initial_params(case), device="cpu")
    x, y = make_data(case)
    assert np.isnan(backend.loss_and_grads(x, y)[0]) and np.isnan(float(backend.sgd_step(x, y, 0.1)))
    ok = backends.create("cuda:fused")
    ok.prepare(MIXED_CASES[3][1].problem("train_step", "cpu"), initial_params(case), device="cpu")
    assert np.isfinite(float(ok.sgd_step(x, y, 0.1)))


@pytest.mark.fullmatrix
@pytest.mark.parametrize("variant", ["naive", "grouped", "fused", "streams", "graph", "persistent"])
@pytest.mark.parametrize("case", [c for c in all_cases(quick=True) if gru_or_bidirectional(c) and c.dtype in ("float32", "float64")],
                         ids=lambda c: f"{c.label} {c.dtype}")
def test_every_variant_on_the_quick_gru_and_bidirectional_matrix(K, variant, case):
    """Each variant on the quick matrix's GRU and bidirectional cases, the realistic ones included."""
    _passes(f"cuda:{variant}", case)


def test_cpu_device_only_under_the_interpreter(monkeypatch):
    from backends import cuda_backend

    b = backends.create("cuda:fused")
    assert b.device_availability("cpu") == (True, "")
    assert b.device_availability("gpu")[0] is False  # the interpreter owns the kernels in this process
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = b.device_availability("cpu")
    assert not ok and "checks only" in why
    monkeypatch.setattr(cuda_backend, "_gpu_present", lambda: False)
    ok, why = b.availability()
    assert not ok and why.startswith("unavailable: no NVIDIA GPU")
    # timed cells' workers never run the interpreter
    assert cuda_backend.CudaBackend.environment_variables("fused", 1, "cpu", "float32")["TRITON_INTERPRET"] == "0"


def test_variants_default_and_unsupported_reason():
    cls = backends.backend_class("cuda")
    assert cls.variants[0] == "graph" and set(cls.variants) == {"naive", "grouped", "fused", "streams", "graph", "persistent"}
    big = Problem(ModelSpec.from_mapping({"kind": "lstm", "hidden": 2048}), 8, 8, False, device="gpu")
    ok, why = backends.create("cuda:persistent").supports(big)
    assert not ok and why.startswith("unsupported: ") and "registers" in why
    assert backends.create("cuda:fused").supports(big) == (True, "")
    for model in ({"kind": "gru", "reset_after": False, "hidden": 64, "layers": 2},
                  {"kind": "lstm", "bidirectional": True, "hidden": 64}):
        problem = Problem(ModelSpec.from_mapping(model), 8, 8, False, device="gpu")
        for variant in cls.variants:
            assert backends.create(f"cuda:{variant}").supports(problem) == (True, ""), (variant, model)
    big_gru = Problem(ModelSpec.from_mapping({"kind": "gru", "hidden": 2048}), 8, 8, False, device="gpu")
    ok, why = backends.create("cuda:persistent").supports(big_gru)
    assert not ok and "registers" in why


def test_truncated_depths_match_per_output_windows(K):
    """The batched-depth truncated BPTT against the reference on a sequence longer than its windows."""
    case = _small({"kind": "lstm", "peephole": True, "bptt": {"truncated": 2}}, "lstm trunc T=9", "float64", layers=1, T=9, B=1)
    _passes("cuda:fused", case)


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_without_one():
    """The same kernels lower to an sm_90 binary (Triton's compiler and ptxas, no device needed), in a
    process of its own because this one decorated them for the interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "backends.cuda.compile_check", "--arch", "90"], env=env,
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled ") == 19 and proc.stdout.count("_persistent_kernel") == 3
    assert proc.stdout.count("_persistent_gru_kernel") == 3 and "_gru_bwd_reset_kernel" in proc.stdout
