"""The CPU's roofs, measured at run start in a worker: an ``n`` x ``n`` x ``n`` product's best
GFLOP/s through one library, in the worker's thread settings, and beside it the hardware's own
multiply-add peak (``fma``: the native engine's tight kernel of the widest FMA this CPU has, no
memory traffic; float32 and bfloat16). A cell's roof is the higher of the two: what the cores
can do, or what a library showed them doing, whichever a run found larger.

float32 and float64 go through NumPy (its BLAS, what the NumPy baseline and most backends call).
NumPy has no bfloat16 or float16 product, so a mixed-precision roof is measured through each
library that has one, each in its own backend's worker environment (threads as its cells get them),
and the run keeps the fastest: JAX (``jnp.dot`` of low-type inputs with
``preferred_element_type=float32``, what its mixed-precision cells run), PyTorch (``torch.mm`` of
low-type inputs, whose result is the low type: the same products at the same rate, rounded once
more) and, for bfloat16 on a CPU with AVX512-BF16, the native engine's own GEMM. Where no library
has fast kernels for the type on this CPU (no AVX512-BF16, no AVX512-FP16) the roof is low, and
says so: that is what the type offers here.

Heavy libraries are imported only by the worker that measures through them.
"""

from __future__ import annotations

import re

from backends import products
from harness.worker import measure
from harness.spec.errors import HarnessError
from harness.spec.model import REDUCED_DTYPES

#: the libraries a mixed-precision roof is measured through, fastest taken (each needs its backend)
LOW_PRECISION_LIBRARIES = ("jax", "torch", "native")
#: the hardware peak's name among the libraries: the native engine's FMA kernel (backends/native/fma_peak.hpp)
HARDWARE = "fma"
#: the types the hardware peak is measured in (the engine has an FMA kernel for each)
HARDWARE_DTYPES = ("float32", "bfloat16")
#: the backend whose worker environment (threads) each library's rate is measured in
BACKEND_OF = {HARDWARE: "native"}


def roof_libraries(dtype: str) -> tuple[str, ...]:
    """What ``dtype``'s roof is measured through, the highest rate taken: NumPy's GEMM (float32,
    float64) or each low-precision library's, and the hardware FMA peak where the engine has a kernel."""
    libraries = LOW_PRECISION_LIBRARIES if dtype in REDUCED_DTYPES else ("numpy",)
    return libraries + ((HARDWARE,) if dtype in HARDWARE_DTYPES else ())


def fma_rate(dtype: str, seconds: float = 0.3, threads: int = 1) -> float:
    """GFLOP/s of the native engine's FMA kernel in ``dtype`` on ``threads`` threads at once (the best of
    runs over ``seconds``); a HarnessError starting ``unavailable:`` where it cannot run here."""
    if dtype not in HARDWARE_DTYPES:
        raise HarnessError(f"unavailable: the native engine has no {dtype} multiply-add kernel")
    try:
        from backends import _native
    except ImportError as exc:
        raise HarnessError(f"unavailable: the native engine is not built here ({exc})") from None
    if not hasattr(_native, "fma_peak"):
        raise HarnessError("unavailable: this native engine has no FMA peak kernel")
    out = _native.fma_peak(dtype, threads, seconds)
    if not out["kernel"]:
        raise HarnessError(f"unavailable: this CPU has no {dtype} multiply-add kernel in the native engine")
    return float(out["gflops"])


def gemm_rate(dtype: str, library: str = "numpy", n: int = 1024, seconds: float = 0.5, threads: int = 1) -> float:
    """Best GFLOP/s of an ``n`` x ``n`` x ``n`` ``dtype`` product through ``library`` in this process
    (``threads``: for a library that takes them per call; the others inherit the worker's settings).
    A library that cannot run the product here raises a HarnessError starting ``unavailable:``.
    ``library`` HARDWARE: the FMA peak (:func:`fma_rate`) instead of a product."""
    if library == HARDWARE:
        return fma_rate(dtype, seconds, threads)
    if library not in products.LIBRARIES:
        raise HarnessError(f"no GEMM peak is measured through {library!r} (known: {', '.join(products.LIBRARIES)})")
    if library == "numpy" and dtype in REDUCED_DTYPES:
        raise HarnessError(f"NumPy has no {dtype} product: measure it through {', '.join(LOW_PRECISION_LIBRARIES)}")
    try:
        call = products.LIBRARIES[library](dtype, n, threads)
    except ImportError as exc:
        raise HarnessError(f"unavailable: {library} is not installed here ({exc})") from None
    call()  # compile (JAX) and warm the caches
    return measure.best_rate(call, 2.0 * n ** 3, seconds) / 1e9


def peak_key(dtype: str, threads: int, library: str | None = None) -> str:
    """The key of a peak in a run's ``gemm_peak_gflops``: ``dtype|threads=N`` for the roof a cell reads,
    ``dtype|threads=N|library`` for each library (and HARDWARE) the roof was measured through."""
    return f"{dtype}|threads={threads}" + (f"|{library}" if library else "")


def read_peak_key(key: str) -> tuple[str, int, str | None]:
    """A key of ``gemm_peak_gflops`` read back: ``(dtype, threads, library or None)``, as :func:`peak_key` wrote it."""
    match = _PEAK_KEY.fullmatch(key)
    if match is None:
        raise HarnessError(f"gemm_peak_gflops: expected a key dtype|threads=N[|library], got {key!r}")
    return match["dtype"], int(match["threads"]), match["library"]


_PEAK_KEY = re.compile(r"(?P<dtype>[^|]+)\|threads=(?P<threads>\d+)(?:\|(?P<library>[^|]+))?")


def roof_library(peaks: dict, dtype: str, threads: int) -> str | None:
    """What the roof ``peak_key(dtype, threads)`` was measured through: the highest of its per-library
    rates (HARDWARE: the FMA peak); NumPy for a float32 or float64 roof of a run that kept no
    per-library rates (before the hardware peak); None: not measured."""
    rates = library_rates(peaks, dtype, threads)
    if rates:
        return max(rates, key=rates.get)
    return "numpy" if dtype not in REDUCED_DTYPES and peak_key(dtype, threads) in peaks else None


def library_rates(peaks: dict, dtype: str, threads: int) -> dict[str, float]:
    """The rates a roof was measured at, per library (``dtype|threads=N|library``)."""
    prefix = peak_key(dtype, threads) + "|"
    return {k[len(prefix):]: v for k, v in peaks.items() if k.startswith(prefix) and v is not None}
