"""The fused Elman step: ``h = act(pre + rec)`` forward, ``da = (dh_out + dh_rec) * act'(h)`` backward.

``pre`` holds ``x W_xh + b_h`` (hoisted over all steps), ``rec`` the recurrent GEMM ``h W_hh``
(absent at the first step); all tensors ``(R, H)`` and contiguous.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.cuda import ew_block
from backends.cuda.activations import ACT_CODES, act, act_grad


@triton.jit
def _elman_fwd_kernel(pre_ptr, rec_ptr, h_ptr, n, HAS_REC: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(pre_ptr + offs, mask=mask, other=0.0)
    if HAS_REC:
        a += tl.load(rec_ptr + offs, mask=mask, other=0.0)
    tl.store(h_ptr + offs, act(a, ACT), mask=mask)


@triton.jit
def _elman_bwd_kernel(dh_out_ptr, dh_rec_ptr, h_ptr, da_ptr, n, HAS_DHO: tl.constexpr, HAS_DHR: tl.constexpr,
                      ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = tl.load(h_ptr + offs, mask=mask, other=0.0)
    dh = tl.zeros_like(h)
    if HAS_DHO:
        dh += tl.load(dh_out_ptr + offs, mask=mask, other=0.0)
    if HAS_DHR:
        dh += tl.load(dh_rec_ptr + offs, mask=mask, other=0.0)
    tl.store(da_ptr + offs, dh * act_grad(h, ACT), mask=mask)


def forward_step(pre, rec, h_out, activation: str):
    """One fused Elman step into ``h_out``; ``rec`` None at the first step."""
    for t in (pre, rec, h_out):
        assert t is None or t.is_contiguous()
    n = h_out.numel()
    block = ew_block(n)
    _elman_fwd_kernel[(triton.cdiv(n, block),)](pre, rec if rec is not None else pre, h_out, n,
                                                HAS_REC=rec is not None, ACT=ACT_CODES[activation], BLOCK=block)


def backward_step(dh_out, dh_rec, h, da_out, activation: str):
    """One fused Elman backward step into ``da_out``; ``dh_out``/``dh_rec`` may be None (zero)."""
    for t in (dh_out, dh_rec, h, da_out):
        assert t is None or t.is_contiguous()
    n = h.numel()
    block = ew_block(n)
    _elman_bwd_kernel[(triton.cdiv(n, block),)](dh_out if dh_out is not None else h, dh_rec if dh_rec is not None else h,
                                                h, da_out, n, HAS_DHO=dh_out is not None, HAS_DHR=dh_rec is not None,
                                                ACT=ACT_CODES[activation], BLOCK=block)
