"""The number types a cell computes in: :class:`DType`, with what follows from each one (SPEC.md
"Reduced precision" and "Conformance tolerances") in one place.

``float64`` and ``float32`` are computed in that type throughout. ``bfloat16`` and ``float16`` are mixed
precision: the inputs of every matrix product are rounded to them, while parameters, gradients, data,
state and element-wise maths stay in the master type, float32; float16 also scales the objective by a
static loss scale. Members are strings (``DType.FLOAT32 == "float32"``), so configs, tables and JSON
hold the plain names, and NumPy, JAX and PyTorch take them where they take a name.
"""

from __future__ import annotations

from enum import Enum

from harness.spec.errors import HarnessError


class DType(str, Enum):
    # the order configs list them in (an error message's "expected one of ...")
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value) -> "DType":
        """``value`` (a name, a member or a NumPy dtype) as a member; a HarnessError names the known ones."""
        # a NumPy dtype has a name, a scalar type (np.float32) a __name__; a member is its own name
        name = value if isinstance(value, str) else getattr(value, "name", None) or getattr(value, "__name__", None)
        try:
            return cls(name)
        except ValueError:
            raise HarnessError(f"dtype: expected one of {', '.join(NAMES)}, got {value!r}") from None

    @property
    def reduced(self) -> bool:
        """Mixed precision: only the matrix products' inputs are rounded to this type."""
        return self in (DType.BFLOAT16, DType.FLOAT16)

    @property
    def master(self) -> "DType":
        """The type parameters, gradients, data, state and element-wise maths are held in: float32 for
        the reduced types (their master copy), else the type itself."""
        return DType.FLOAT32 if self.reduced else self

    @property
    def n_bytes(self) -> int:
        """Bytes per number (what a matrix product reads of its inputs)."""
        return {DType.FLOAT64: 8, DType.FLOAT32: 4}.get(self, 2)

    @property
    def double(self) -> bool:
        """Computed in 64-bit floats (a library with a 32-bit default, such as JAX, must be told)."""
        return self is DType.FLOAT64

    @property
    def loss_scaled(self) -> bool:
        """Its steps scale the objective by the static ``train.loss_scale`` (float16's narrow range)."""
        return self is DType.FLOAT16

    @property
    def short(self) -> str:
        """The short name the bounds' text uses for a reference in this type (``bf16``, ``fp16``, ``fp32``)."""
        return {DType.FLOAT64: "fp64", DType.FLOAT32: "fp32", DType.BFLOAT16: "bf16", DType.FLOAT16: "fp16"}[self]

    @property
    def tolerance(self) -> tuple[float, float]:
        """SPEC's bound ``|got - ref| <= rtol * |ref| + atol * max|ref|`` as ``(rtol, atol)``: float32's for
        the reduced types (the bound of their float32 maths, widened by the verification's spread)."""
        return (1e-9, 1e-12) if self is DType.FLOAT64 else (1e-3, 1e-5)


#: every dtype's name, in the order configs list them
NAMES = tuple(d.value for d in DType)
#: the names of the mixed-precision types
REDUCED = tuple(d.value for d in DType if d.reduced)
