"""The fused GRU step: the element-wise gate maths of one step in one kernel (two around a GEMM).

Layouts (rows ``R`` = batch rows, or windows x batch rows for truncated BPTT; gates in the spec's
order r, z, n, each ``H`` wide)::

    pre        (R, 3H)   x W_ih + b, hoisted over all steps
    rec        (R, 3H)   reset after: h_prev W_hh            (R, 2H) reset before: h_prev W_hh[:, :2H]
    rec_n      (R, H)    reset before: (r * h_prev) W_hh[:, 2H:], the GEMM between the two kernels
    gates      (R, 4H)   r, z, n, then un = h_prev W_hn + b_hn (reset after) or rh = r * h_prev (reset before)
    da         (R, 4H)   reset after: dL/d [a_r + u_r, a_z + u_z, un, a_n]
               (R, 3H)   reset before: dL/d [a_r + u_r, a_z + u_z, a_n + (r h_prev) W_hn]
    h_prev, h, dh_*, dc_*, drh   (R, H)      b_hn   (H,)

Reset after (cuDNN, PyTorch): ``n = tanh(a_n + r * un)``: the recurrent product of all three gates
is one GEMM before the step, and the step is one kernel, forward and backward. The backward's
``da`` puts ``dun`` next to ``da_r, da_z``, so ``da[:, :3H]`` is the recurrent GEMMs' operand
(``dh_rec = da[:, :3H] W_hh^T``, ``dW_hh = h_prev^T da[:, :3H]``) and ``da[:, [0:2H, 3H:4H]]`` the
input weights'.

Reset before (Cho et al.): ``n = tanh(a_n + (r * h_prev) W_hn)`` needs ``r`` before its product,
so a step is ``reset_gate_step`` (r, z and rh), the GEMM ``rh W_hn``, then ``new_gate_step``; the
backward is ``new_gate_backward`` (da_z, da_n), the GEMM ``drh = da_n W_hn^T``, then
``reset_gate_backward`` (da_r). ``dh_rec = da[:, :2H] W_hh[:, :2H]^T``, ``dW_hh[:, 2H:] = rh^T da_n``.

Both write ``dc``: the part of dL/dh_prev that reaches it outside the ``dh_rec`` GEMM (``dh * z``,
and ``drh * r`` reset before), which the next backward step adds to its ``dh`` (as the LSTM carries
``dc``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.cuda import ew_block
from backends.cuda.activations import sigmoid, tanh


@triton.jit
def _gru_fwd_kernel(pre_ptr, rec_ptr, bhn_ptr, h_prev_ptr, h_ptr, gates_ptr, n, H, HAS_REC: tl.constexpr,
                    HAS_BHN: tl.constexpr, STORE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // H
    j = offs % H
    p0 = r * 3 * H + j  # gate r of unit j in row r; z, n follow at +H, +2H
    ar = tl.load(pre_ptr + p0, mask=mask, other=0.0)
    az = tl.load(pre_ptr + p0 + H, mask=mask, other=0.0)
    an = tl.load(pre_ptr + p0 + 2 * H, mask=mask, other=0.0)
    hp = tl.load(h_prev_ptr + offs, mask=mask, other=0.0)
    un = tl.zeros_like(hp)
    if HAS_REC:
        ar += tl.load(rec_ptr + p0, mask=mask, other=0.0)
        az += tl.load(rec_ptr + p0 + H, mask=mask, other=0.0)
        un += tl.load(rec_ptr + p0 + 2 * H, mask=mask, other=0.0)
    if HAS_BHN:
        un += tl.load(bhn_ptr + j, mask=mask, other=0.0)
    rg = sigmoid(ar)
    zg = sigmoid(az)
    ng = tanh(an + rg * un)
    tl.store(h_ptr + offs, (1.0 - zg) * ng + zg * hp, mask=mask)
    if STORE:
        g0 = r * 4 * H + j
        tl.store(gates_ptr + g0, rg, mask=mask)
        tl.store(gates_ptr + g0 + H, zg, mask=mask)
        tl.store(gates_ptr + g0 + 2 * H, ng, mask=mask)
        tl.store(gates_ptr + g0 + 3 * H, un, mask=mask)


@triton.jit
def _gru_reset_kernel(pre_ptr, rec_ptr, h_prev_ptr, gates_ptr, n, H, HAS_REC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // H
    j = offs % H
    p0 = r * 3 * H + j
    ar = tl.load(pre_ptr + p0, mask=mask, other=0.0)
    az = tl.load(pre_ptr + p0 + H, mask=mask, other=0.0)
    if HAS_REC:
        q0 = r * 2 * H + j
        ar += tl.load(rec_ptr + q0, mask=mask, other=0.0)
        az += tl.load(rec_ptr + q0 + H, mask=mask, other=0.0)
    rg = sigmoid(ar)
    hp = tl.load(h_prev_ptr + offs, mask=mask, other=0.0)
    g0 = r * 4 * H + j
    tl.store(gates_ptr + g0, rg, mask=mask)
    tl.store(gates_ptr + g0 + H, sigmoid(az), mask=mask)
    tl.store(gates_ptr + g0 + 3 * H, rg * hp, mask=mask)


@triton.jit
def _gru_new_kernel(pre_ptr, rec_n_ptr, h_prev_ptr, gates_ptr, h_ptr, n, H, HAS_REC: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // H
    j = offs % H
    an = tl.load(pre_ptr + r * 3 * H + j + 2 * H, mask=mask, other=0.0)
    if HAS_REC:
        an += tl.load(rec_n_ptr + offs, mask=mask, other=0.0)
    g0 = r * 4 * H + j
    zg = tl.load(gates_ptr + g0 + H, mask=mask, other=0.0)
    hp = tl.load(h_prev_ptr + offs, mask=mask, other=0.0)
    ng = tanh(an)
    tl.store(gates_ptr + g0 + 2 * H, ng, mask=mask)
    tl.store(h_ptr + offs, (1.0 - zg) * ng + zg * hp, mask=mask)


@triton.jit
def _gru_bwd_kernel(dh_out_ptr, dh_rec_ptr, dc_next_ptr, gates_ptr, h_prev_ptr, da_ptr, dc_ptr, n, H,
                    HAS_DHO: tl.constexpr, HAS_DHR: tl.constexpr, HAS_DC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // H
    j = offs % H
    g0 = r * 4 * H + j
    rg = tl.load(gates_ptr + g0, mask=mask, other=0.0)
    zg = tl.load(gates_ptr + g0 + H, mask=mask, other=0.0)
    ng = tl.load(gates_ptr + g0 + 2 * H, mask=mask, other=0.0)
    un = tl.load(gates_ptr + g0 + 3 * H, mask=mask, other=0.0)
    hp = tl.load(h_prev_ptr + offs, mask=mask, other=0.0)
    dh = tl.zeros_like(hp)
    if HAS_DHO:
        dh += tl.load(dh_out_ptr + offs, mask=mask, other=0.0)
    if HAS_DHR:
        dh += tl.load(dh_rec_ptr + offs, mask=mask, other=0.0)
    if HAS_DC:
        dh += tl.load(dc_next_ptr + offs, mask=mask, other=0.0)
    dan = dh * (1.0 - zg) * (1.0 - ng * ng)
    daz = dh * (hp - ng) * zg * (1.0 - zg)
    tl.store(da_ptr + g0, dan * un * rg * (1.0 - rg), mask=mask)
    tl.store(da_ptr + g0 + H, daz, mask=mask)
    tl.store(da_ptr + g0 + 2 * H, dan * rg, mask=mask)
    tl.store(da_ptr + g0 + 3 * H, dan, mask=mask)
    tl.store(dc_ptr + offs, dh * zg, mask=mask)


@triton.jit
def _gru_bwd_new_kernel(dh_out_ptr, dh_rec_ptr, dc_next_ptr, gates_ptr, h_prev_ptr, da_ptr, dc_ptr, n, H,
                        HAS_DHO: tl.constexpr, HAS_DHR: tl.constexpr, HAS_DC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // H
    j = offs % H
    g0 = r * 4 * H + j
    zg = tl.load(gates_ptr + g0 + H, mask=mask, other=0.0)
    ng = tl.load(gates_ptr + g0 + 2 * H, mask=mask, other=0.0)
    hp = tl.load(h_prev_ptr + offs, mask=mask, other=0.0)
    dh = tl.zeros_like(hp)
    if HAS_DHO:
        dh += tl.load(dh_out_ptr + offs, mask=mask, other=0.0)
    if HAS_DHR:
        dh += tl.load(dh_rec_ptr + offs, mask=mask, other=0.0)
    if HAS_DC:
        dh += tl.load(dc_next_ptr + offs, mask=mask, other=0.0)
    d0 = r * 3 * H + j
    tl.store(da_ptr + d0 + H, dh * (hp - ng) * zg * (1.0 - zg), mask=mask)
    tl.store(da_ptr + d0 + 2 * H, dh * (1.0 - zg) * (1.0 - ng * ng), mask=mask)
    tl.store(dc_ptr + offs, dh * zg, mask=mask)


@triton.jit
def _gru_bwd_reset_kernel(drh_ptr, gates_ptr, h_prev_ptr, da_ptr, dc_ptr, n, H, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // H
    j = offs % H
    rg = tl.load(gates_ptr + r * 4 * H + j, mask=mask, other=0.0)
    hp = tl.load(h_prev_ptr + offs, mask=mask, other=0.0)
    drh = tl.load(drh_ptr + offs, mask=mask, other=0.0)
    tl.store(da_ptr + r * 3 * H + j, drh * hp * rg * (1.0 - rg), mask=mask)
    dc = tl.load(dc_ptr + offs, mask=mask, other=0.0)
    tl.store(dc_ptr + offs, dc + drh * rg, mask=mask)


def _check(*ts):
    for t in ts:
        assert t is None or t.is_contiguous(), "the fused GRU kernels take contiguous tensors"


def _launch(kernel, n: int, *args, **constexprs):
    block = ew_block(n)
    kernel[(triton.cdiv(n, block),)](*args, BLOCK=block, **constexprs)


def forward_step(pre, rec, b_hn, h_prev, h_out, gates_out=None):
    """One fused reset-after GRU step; ``rec`` None at the first step, ``b_hn`` None without bias,
    ``gates_out`` None for inference."""
    _check(pre, rec, b_hn, h_prev, h_out, gates_out)
    n = h_out.numel()
    _launch(_gru_fwd_kernel, n, pre, rec if rec is not None else pre, b_hn if b_hn is not None else h_prev, h_prev,
            h_out, gates_out if gates_out is not None else pre, n, h_out.shape[-1],
            HAS_REC=rec is not None, HAS_BHN=b_hn is not None, STORE=gates_out is not None)


def reset_gate_step(pre, rec, h_prev, gates):
    """Reset before, first half of a step: ``r``, ``z`` and ``rh = r * h_prev`` into ``gates``;
    ``rec`` (R, 2H), None at the first step."""
    _check(pre, rec, h_prev, gates)
    n = h_prev.numel()
    _launch(_gru_reset_kernel, n, pre, rec if rec is not None else pre, h_prev, gates, n, h_prev.shape[-1],
            HAS_REC=rec is not None)


def new_gate_step(pre, rec_n, h_prev, gates, h_out):
    """Reset before, second half: ``n = tanh(a_n + rec_n)`` (into ``gates``) and ``h``; ``rec_n``
    is ``rh W_hn`` (None at the first step, where ``h_prev`` is zero)."""
    _check(pre, rec_n, h_prev, gates, h_out)
    n = h_out.numel()
    _launch(_gru_new_kernel, n, pre, rec_n if rec_n is not None else h_prev, h_prev, gates, h_out, n,
            h_out.shape[-1], HAS_REC=rec_n is not None)


def backward_step(dh_out, dh_rec, dc_next, gates, h_prev, da_out, dc_out):
    """One fused reset-after GRU backward step; ``dh_out``/``dh_rec``/``dc_next`` may be None (zero)."""
    _check(dh_out, dh_rec, dc_next, gates, h_prev, da_out, dc_out)
    n = h_prev.numel()
    _launch(_gru_bwd_kernel, n, dh_out if dh_out is not None else h_prev, dh_rec if dh_rec is not None else h_prev,
            dc_next if dc_next is not None else h_prev, gates, h_prev, da_out, dc_out, n, h_prev.shape[-1],
            HAS_DHO=dh_out is not None, HAS_DHR=dh_rec is not None, HAS_DC=dc_next is not None)


def new_gate_backward(dh_out, dh_rec, dc_next, gates, h_prev, da_out, dc_out):
    """Reset before, first half of a backward step: ``da_z``, ``da_n`` (columns H..3H of ``da_out``) and
    ``dc_out = dh * z``; ``dh_out``/``dh_rec``/``dc_next`` may be None (zero)."""
    _check(dh_out, dh_rec, dc_next, gates, h_prev, da_out, dc_out)
    n = h_prev.numel()
    _launch(_gru_bwd_new_kernel, n, dh_out if dh_out is not None else h_prev,
            dh_rec if dh_rec is not None else h_prev, dc_next if dc_next is not None else h_prev, gates, h_prev,
            da_out, dc_out, n, h_prev.shape[-1],
            HAS_DHO=dh_out is not None, HAS_DHR=dh_rec is not None, HAS_DC=dc_next is not None)


def reset_gate_backward(drh, gates, h_prev, da_out, dc):
    """Reset before, second half: from ``drh = da_n W_hn^T``, ``da_r`` (columns 0..H of ``da_out``) and
    ``dc += drh * r`` in place."""
    _check(drh, gates, h_prev, da_out, dc)
    n = h_prev.numel()
    _launch(_gru_bwd_reset_kernel, n, drh, gates, h_prev, da_out, dc, n, h_prev.shape[-1])
