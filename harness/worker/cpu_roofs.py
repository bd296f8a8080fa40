"""The CPU's GEMM peaks, measured at run start in a worker: an ``n`` x ``n`` x ``n`` product's best
GFLOP/s through one library, in the worker's thread settings.

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


def gemm_rate(dtype: str, library: str = "numpy", n: int = 1024, seconds: float = 0.5, threads: int = 1) -> float:
    """Best GFLOP/s of an ``n`` x ``n`` x ``n`` ``dtype`` product through ``library`` in this process
    (``threads``: for a library that takes them per call; the others inherit the worker's settings).
    A library that cannot run the product here raises a HarnessError starting ``unavailable:``."""
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
    ``dtype|threads=N|library`` for each library a mixed-precision roof was measured through."""
    return f"{dtype}|threads={threads}" + (f"|{library}" if library else "")


def read_peak_key(key: str) -> tuple[str, int, str | None]:
    """A key of ``gemm_peak_gflops`` read back: ``(dtype, threads, library or None)``, as :func:`peak_key` wrote it."""
    match = _PEAK_KEY.fullmatch(key)
    if match is None:
        raise HarnessError(f"gemm_peak_gflops: expected a key dtype|threads=N[|library], got {key!r}")
    return match["dtype"], int(match["threads"]), match["library"]


_PEAK_KEY = re.compile(r"(?P<dtype>[^|]+)\|threads=(?P<threads>\d+)(?:\|(?P<library>[^|]+))?")


def roof_library(peaks: dict, dtype: str, threads: int) -> str | None:
    """The library the roof ``peak_key(dtype, threads)`` was measured through: NumPy in float32 and
    float64, the fastest of the per-library rates under mixed precision (None: not measured)."""
    if dtype not in REDUCED_DTYPES:
        return "numpy" if peak_key(dtype, threads) in peaks else None
    rates = library_rates(peaks, dtype, threads)
    return max(rates, key=rates.get) if rates else None


def library_rates(peaks: dict, dtype: str, threads: int) -> dict[str, float]:
    """The rates a mixed-precision roof was measured at, per library (``dtype|threads=N|library``)."""
    prefix = peak_key(dtype, threads) + "|"
    return {k[len(prefix):]: v for k, v in peaks.items() if k.startswith(prefix) and v is not None}
