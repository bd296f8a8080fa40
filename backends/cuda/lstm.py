"""The fused LSTM step: all element-wise gate maths of one step in one kernel, forward and backward.

Layouts (rows ``R`` = batch rows, or windows x batch rows for truncated BPTT; gates in the
spec's order i, f, g, o, each ``H`` wide)::

    pre, rec, gates, da   (R, 4H)     c_prev, c, h, dh_*, dc_*   (R, H)     p_i, p_f, p_o   (H,)

Forward: ``a = pre + rec`` (``pre`` holds ``x W_ih + b``, ``rec`` the recurrent GEMM ``h W_hh``;
absent at the first step), peepholes optional; writes ``h``, ``c`` and, for training, the gate
activations the backward reads. Backward: from ``dh = dh_out + dh_rec`` and the carried ``dc``,
writes ``da`` (the four gates' pre-activation gradients, what the combined weight-gradient GEMMs
consume) and the ``dc`` carried to the step before.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.cuda import ew_block
from backends.cuda.activations import sigmoid, tanh


@triton.jit
def _lstm_fwd_kernel(pre_ptr, rec_ptr, c_prev_ptr, pi_ptr, pf_ptr, po_ptr, h_ptr, c_ptr, gates_ptr,
                     n, H, HAS_REC: tl.constexpr, PEEP: tl.constexpr, STORE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // H
    j = offs % H
    g0 = r * 4 * H + j  # gate i of unit j in row r; f, g, o follow at +H, +2H, +3H
    ai = tl.load(pre_ptr + g0, mask=mask, other=0.0)
    af = tl.load(pre_ptr + g0 + H, mask=mask, other=0.0)
    ag = tl.load(pre_ptr + g0 + 2 * H, mask=mask, other=0.0)
    ao = tl.load(pre_ptr + g0 + 3 * H, mask=mask, other=0.0)
    if HAS_REC:
        ai += tl.load(rec_ptr + g0, mask=mask, other=0.0)
        af += tl.load(rec_ptr + g0 + H, mask=mask, other=0.0)
        ag += tl.load(rec_ptr + g0 + 2 * H, mask=mask, other=0.0)
        ao += tl.load(rec_ptr + g0 + 3 * H, mask=mask, other=0.0)
    c_prev = tl.load(c_prev_ptr + offs, mask=mask, other=0.0)
    if PEEP:
        ai += tl.load(pi_ptr + j, mask=mask, other=0.0) * c_prev
        af += tl.load(pf_ptr + j, mask=mask, other=0.0) * c_prev
    i = sigmoid(ai)
    f = sigmoid(af)
    g = tanh(ag)
    c = f * c_prev + i * g
    if PEEP:
        ao += tl.load(po_ptr + j, mask=mask, other=0.0) * c
    o = sigmoid(ao)
    h = o * tanh(c)
    tl.store(c_ptr + offs, c, mask=mask)
    tl.store(h_ptr + offs, h, mask=mask)
    if STORE:
        tl.store(gates_ptr + g0, i, mask=mask)
        tl.store(gates_ptr + g0 + H, f, mask=mask)
        tl.store(gates_ptr + g0 + 2 * H, g, mask=mask)
        tl.store(gates_ptr + g0 + 3 * H, o, mask=mask)


@triton.jit
def _lstm_bwd_kernel(dh_out_ptr, dh_rec_ptr, dc_next_ptr, gates_ptr, c_prev_ptr, c_ptr, pi_ptr, pf_ptr, po_ptr,
                     da_ptr, dc_ptr, n, H, HAS_DHO: tl.constexpr, HAS_DHR: tl.constexpr, HAS_DC: tl.constexpr,
                     PEEP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // H
    j = offs % H
    g0 = r * 4 * H + j
    i = tl.load(gates_ptr + g0, mask=mask, other=0.0)
    f = tl.load(gates_ptr + g0 + H, mask=mask, other=0.0)
    g = tl.load(gates_ptr + g0 + 2 * H, mask=mask, other=0.0)
    o = tl.load(gates_ptr + g0 + 3 * H, mask=mask, other=0.0)
    c_prev = tl.load(c_prev_ptr + offs, mask=mask, other=0.0)
    c = tl.load(c_ptr + offs, mask=mask, other=0.0)
    dh = tl.zeros_like(c)
    if HAS_DHO:
        dh += tl.load(dh_out_ptr + offs, mask=mask, other=0.0)
    if HAS_DHR:
        dh += tl.load(dh_rec_ptr + offs, mask=mask, other=0.0)
    tc = tanh(c)
    dao = dh * tc * o * (1.0 - o)
    dc = dh * o * (1.0 - tc * tc)
    if HAS_DC:
        dc += tl.load(dc_next_ptr + offs, mask=mask, other=0.0)
    if PEEP:
        pi = tl.load(pi_ptr + j, mask=mask, other=0.0)
        pf = tl.load(pf_ptr + j, mask=mask, other=0.0)
        dc += dao * tl.load(po_ptr + j, mask=mask, other=0.0)
    dai = dc * g * i * (1.0 - i)
    daf = dc * c_prev * f * (1.0 - f)
    dag = dc * i * (1.0 - g * g)
    dc_carry = dc * f
    if PEEP:
        dc_carry += dai * pi + daf * pf
    tl.store(da_ptr + g0, dai, mask=mask)
    tl.store(da_ptr + g0 + H, daf, mask=mask)
    tl.store(da_ptr + g0 + 2 * H, dag, mask=mask)
    tl.store(da_ptr + g0 + 3 * H, dao, mask=mask)
    tl.store(dc_ptr + offs, dc_carry, mask=mask)


def _check(*ts):
    for t in ts:
        assert t is None or t.is_contiguous(), "the fused LSTM kernels take contiguous tensors"


def forward_step(pre, rec, c_prev, peep, h_out, c_out, gates_out=None):
    """One fused LSTM step; ``rec`` None at the first step, ``peep`` None or ``(p_i, p_f, p_o)``,
    ``gates_out`` None for inference."""
    _check(pre, rec, c_prev, h_out, c_out, gates_out)
    H = c_out.shape[-1]
    n = c_out.numel()
    block = ew_block(n)
    pi, pf, po = peep if peep is not None else (c_out, c_out, c_out)
    _lstm_fwd_kernel[(triton.cdiv(n, block),)](
        pre, rec if rec is not None else pre, c_prev, pi, pf, po, h_out, c_out,
        gates_out if gates_out is not None else pre, n, H,
        HAS_REC=rec is not None, PEEP=peep is not None, STORE=gates_out is not None, BLOCK=block)


def backward_step(dh_out, dh_rec, dc_next, gates, c_prev, c, peep, da_out, dc_out):
    """One fused LSTM backward step; ``dh_out``/``dh_rec``/``dc_next`` may be None (zero)."""
    _check(dh_out, dh_rec, dc_next, gates, c_prev, c, da_out, dc_out)
    H = c.shape[-1]
    n = c.numel()
    block = ew_block(n)
    pi, pf, po = peep if peep is not None else (c, c, c)
    _lstm_bwd_kernel[(triton.cdiv(n, block),)](
        dh_out if dh_out is not None else c, dh_rec if dh_rec is not None else c,
        dc_next if dc_next is not None else c, gates, c_prev, c, pi, pf, po, da_out, dc_out, n, H,
        HAS_DHO=dh_out is not None, HAS_DHR=dh_rec is not None, HAS_DC=dc_next is not None,
        PEEP=peep is not None, BLOCK=block)
