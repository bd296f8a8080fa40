"""One kernel per element-wise operation (what ``cuda:naive`` launches), and the SGD update.

``unary`` and ``binary`` each launch one kernel over a 2-D view with unit column stride (one
gate's columns of a ``(B, 4H)`` matrix, as ``cuda:grouped`` hands them); ``binary(..., row=True)``
broadcasts a length-``ncols`` vector (a bias or a peephole) over the rows of the first operand.
``sgd_`` is the update every variant uses: ``p -= lr * clip(g)``, with ``lr`` read from a device
scalar so that a captured CUDA graph replays with the current learning rate.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.cuda import ew_block
from backends.cuda.activations import sigmoid, tanh

UNARY = {"sigmoid": 0, "tanh": 1, "relu": 2, "dsigmoid": 3, "dtanh": 4, "drelu": 5}
BINARY = {"add": 0, "sub": 1, "mul": 2}


@triton.jit
def _unary_kernel(x_ptr, sx, out_ptr, so, n, ncols, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // ncols
    col = offs % ncols
    x = tl.load(x_ptr + r * sx + col, mask=mask, other=0.0)
    if OP == 0:
        y = sigmoid(x)
    elif OP == 1:
        y = tanh(x)
    elif OP == 2:
        y = tl.maximum(x, 0.0)
    elif OP == 3:  # derivatives take the activation's output
        y = x * (1.0 - x)
    elif OP == 4:
        y = 1.0 - x * x
    else:
        y = tl.where(x > 0, 1.0, 0.0).to(x.dtype)
    tl.store(out_ptr + r * so + col, y, mask=mask)


@triton.jit
def _binary_kernel(a_ptr, sa, b_ptr, sb, out_ptr, so, n, ncols, OP: tl.constexpr, ROW: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // ncols
    col = offs % ncols
    a = tl.load(a_ptr + r * sa + col, mask=mask, other=0.0)
    if ROW:
        b = tl.load(b_ptr + col, mask=mask, other=0.0)
    else:
        b = tl.load(b_ptr + r * sb + col, mask=mask, other=0.0)
    if OP == 0:
        y = a + b
    elif OP == 1:
        y = a - b
    else:
        y = a * b
    tl.store(out_ptr + r * so + col, y, mask=mask)


@triton.jit
def _sgd_kernel(p_ptr, g_ptr, lr_ptr, clip_ptr, n, CLIP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if CLIP:
        clip = tl.load(clip_ptr)
        g = tl.minimum(tl.maximum(g, -clip), clip)
    lr = tl.load(lr_ptr)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    tl.store(p_ptr + offs, p - lr * g, mask=mask)


def _grid(n: int, block: int):
    return (triton.cdiv(n, block),)


def _rows(t):
    """A 2-D view's row stride; columns must be unit-stride (a column slice of a row-major matrix is)."""
    assert t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1), "element-wise kernels take 2-D row-major views"
    return t.stride(0)


def unary(op: str, x, out=None):
    """``out = op(x)`` elementwise over a 2-D view (e.g. one gate's columns), one launch."""
    out = x.new_empty(x.shape) if out is None else out
    n = x.numel()
    block = ew_block(n)
    _unary_kernel[_grid(n, block)](x, _rows(x), out, _rows(out), n, x.shape[1], OP=UNARY[op], BLOCK=block)
    return out


def binary(op: str, a, b, out=None, row: bool = False):
    """``out = a (op) b`` elementwise over 2-D views, one launch; ``row``: ``b`` is a vector over the columns."""
    if row:
        assert b.dim() == 1 and b.shape[0] == a.shape[1] and b.is_contiguous()
    else:
        assert a.shape == b.shape, (a.shape, b.shape)
    out = a.new_empty(a.shape) if out is None else out
    n = a.numel()
    block = ew_block(n)
    _binary_kernel[_grid(n, block)](a, _rows(a), b, 0 if row else _rows(b), out, _rows(out), n, a.shape[1],
                                    OP=BINARY[op], ROW=row, BLOCK=block)
    return out


def sgd_(p, g, lr, clip=None):
    """In place ``p -= lr * clip(g, -clip, clip)``; ``lr`` and ``clip`` (None: no clipping) one-element
    device tensors of ``p``'s dtype (a Python float argument would reach the kernel as float32)."""
    assert p.is_contiguous() and g.is_contiguous() and p.shape == g.shape
    n = p.numel()
    block = ew_block(n)
    _sgd_kernel[_grid(n, block)](p, g, lr, lr if clip is None else clip, n, CLIP=clip is not None, BLOCK=block)
    return p
