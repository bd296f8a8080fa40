"""Device functions shared by the kernels: the spec's nonlinearities and their derivatives.

``tanh`` is written from ``exp`` of a non-positive argument (no overflow, no libdevice call),
so the same code runs compiled and under the interpreter, in float32 and float64.
"""

import triton
import triton.language as tl

# Elman nonlinearities (the order of ModelSpec.activation's choices; a constexpr in the kernels)
ACT_CODES = {"tanh": 0, "relu": 1, "sigmoid": 2}


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def act(x, ACT: tl.constexpr):
    if ACT == 0:
        y = tanh(x)
    elif ACT == 1:
        y = tl.maximum(x, 0.0)
    else:
        y = sigmoid(x)
    return y


@triton.jit
def act_grad(h, ACT: tl.constexpr):
    """d act / d a in terms of the output ``h = act(a)``."""
    if ACT == 0:
        d = 1.0 - h * h
    elif ACT == 1:
        d = tl.where(h > 0, 1.0, 0.0).to(h.dtype)
    else:
        d = h * (1.0 - h)
    return d
