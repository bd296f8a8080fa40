"""The spec's mixed-precision matrix product for the backends built on torch (torch, cuda).

docs/spec.md, "Reduced precision": every matrix product's inputs (activations, weights, and in the
backward pass the gradients) are rounded to bfloat16 or float16 and the products summed in float32,
with a float32 result. On a CUDA device PyTorch has that product as one cuBLAS call,
``torch.mm(a_low, b_low, out_dtype=torch.float32)`` (``aten::mm.dtype``: low-precision operands,
float32 accumulation and output). On the CPU it has none: ``aten::mm.dtype`` has no CPU kernel, and
a low-precision ``a @ b`` there returns its result in the low type (one rounding more than the spec's,
the one autocast adds). That is the refusal's reason on every CPU; how fast that ``a @ b`` runs (slow
without AVX512-BF16, faster than float32 with it) is not.

For conformance checks on a machine without a GPU the product can be *emulated* on CPU tensors:
``a.to(low).float() @ b.to(low).float()`` is numerically the spec's product (two numbers of 8 or 11
significant bits multiply exactly in float32, and the sums are float32's), at float32's speed. It is
for checks only: the torch backend uses it when a test sets :data:`EMULATE_ON_CPU`, the cuda backend
under Triton's interpreter (device ``cpu``, which timed cells never run). The emulation is a custom
operator, so torch.compile keeps its roundings (inductor may otherwise fuse a round trip through
the low type away).

Lazy: nothing here imports torch at import time; callers hand the module in.
"""

from __future__ import annotations

from harness.spec.errors import HarnessError

#: tests only: let the torch backend run mixed precision on the CPU with the emulated product (never
#: for timed cells: a timed CPU cell would measure float32 products and call them bfloat16)
EMULATE_ON_CPU = False

#: why a CPU torch step refuses mixed precision (the torch backend's reason, said once)
#: (what holds on every host: the missing operator, not a speed, which depends on the CPU's instructions)
CPU_REASON = ("PyTorch has no CPU product of {dtype} inputs with a float32 result (aten::mm.dtype, torch.mm's "
              "out_dtype, has a CUDA kernel only); its {dtype} a @ b returns {dtype}, a rounding of every result the "
              "spec does not make (autocast's: up to 1.5x past the bound). On a GPU torch:autograd and torch:compile "
              "run the spec's product")

_emulated = None  # the custom operator, registered on first use
_checked: dict[tuple[str, str], str | None] = {}  # (device, dtype) -> why the product failed its probe, or None


def gpu_product_missing(torch) -> str | None:
    """Why this torch has no float32-output low-precision product for CUDA tensors, or None when it has
    ``aten::mm.dtype`` (whether its kernel runs is :func:`check_product`'s question, asked on the device)."""
    if "dtype" not in torch.ops.aten.mm.overloads():
        return (f"torch {torch.__version__} has no aten::mm.dtype (torch.mm(a, b, out_dtype=torch.float32): "
                f"low-precision inputs, a float32 result), the product the spec's mixed precision needs")
    return None


def _emulated_op(torch):
    """``rnn_harness::emulated_low_mm(a, b, low)``: the spec's product emulated in float32 (see the module
    docstring), an operator torch.compile calls as it is instead of tracing into it."""
    global _emulated
    if _emulated is None:
        # the schema said outright: this module's annotations are strings (``from __future__ import annotations``)
        @torch.library.custom_op("rnn_harness::emulated_low_mm", mutates_args=(),
                                 schema="(Tensor a, Tensor b, ScalarType low) -> Tensor")
        def emulated_low_mm(a, b, low):
            return torch.mm(a.to(low).to(torch.float32), b.to(low).to(torch.float32))

        @emulated_low_mm.register_fake
        def _(a, b, low):
            return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)

        _emulated = emulated_low_mm
    return _emulated


def raw_product(torch, low, device, emulate: bool = False):
    """``mm(a, b) -> float32``: the product of ``a`` and ``b`` rounded to ``low``, summed in float32.

    On CUDA ``torch.mm(..., out_dtype=torch.float32)``; on the CPU the emulation, only when ``emulate``
    (conformance checks), else a HarnessError saying why the CPU has no such product."""
    if device.type == "cuda":
        missing = gpu_product_missing(torch)
        if missing:
            raise HarnessError(f"unsupported: {missing}")
        f32 = torch.float32
        return lambda a, b: torch.mm(a.to(low), b.to(low), out_dtype=f32)
    if not emulate:
        raise HarnessError("unsupported: " + CPU_REASON.format(dtype=str(low).replace("torch.", "")))
    op = _emulated_op(torch)
    return lambda a, b: op(a, b, low)


def check_product(torch, mm, low, device) -> None:
    """Run ``mm`` once on tiny tensors of ``device`` and raise a HarnessError unless it is the spec's
    product: its inputs rounded (``1 + 2^-20`` counts as 1), its sum and result float32 (``1 + 2^-12``,
    which neither low type holds, survives), a transposed operand read as such. Once per device and type."""
    key = (str(device), str(low))
    if key not in _checked:
        f32 = torch.float32
        a = torch.tensor([[1.0 + 2.0 ** -20, 1.0], [2.0, -3.0]], dtype=f32, device=device)
        b = torch.tensor([[1.0, 0.5], [2.0 ** -12, 0.25]], dtype=f32, device=device)
        want = torch.tensor([[1.0 + 2.0 ** -12, 0.75], [2.0 - 3 * 2.0 ** -12, 0.25]], dtype=f32)
        try:
            got = [mm(a, b), mm(a, b.t().contiguous().t())]
            ok = all(g.dtype == f32 and torch.equal(g.cpu(), want) for g in got)
            _checked[key] = None if ok else (f"the product {low} x {low} -> float32 on {device} gave "
                                             f"{got[0].cpu().tolist()} ({got[0].dtype}), not the exact "
                                             f"{want.tolist()}: it does not round its inputs only")
        except Exception as exc:  # the op exists but has no kernel for this device or these types
            _checked[key] = (f"torch.mm(..., out_dtype=torch.float32) on {low} tensors failed on {device}: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if _checked[key] is not None:
        raise HarnessError(f"unsupported: {_checked[key]}")


def autograd_product(torch, mm):
    """``product(a, b, b_low=None)``: ``mm`` (a :func:`raw_product`) as an autograd function whose backward
    products round their operands too, as the reference's do: ``dA = mm(g, B^T)``, ``dB = mm(A^T, g)``, the
    gradient ``g`` rounded with the rest. ``b_low``: ``b`` already rounded (a weight rounded once for every
    step of a sequence), used in place of rounding ``b`` again; it takes no gradient."""

    class LowPrecisionProduct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, b_low):
            low = b_low if b_low is not None else b
            ctx.save_for_backward(a, low)
            return mm(a, low)

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            ga = mm(g, b.t()) if ctx.needs_input_grad[0] else None
            gb = mm(a.t(), g) if ctx.needs_input_grad[1] else None
            return ga, gb, None

    def product(a, b, b_low=None):
        return LowPrecisionProduct.apply(a, b, b_low)

    return product
