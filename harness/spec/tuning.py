"""The environment variables that steer a numerical library, and those among them that force a kernel
or a cache size: what a run records of every worker's environment and names in its answer.

A worker inherits its caller's environment. Variables such as ``OPENBLAS_CORETYPE=Haswell`` and
``OPENBLAS_L2_SIZE=512`` (set on some machines because older OpenBLAS builds misbehave on their
CPU) then decide which kernels NumPy's and the native engine's BLAS run: AVX2 kernels with a
512 KB blocking on a CPU that has AVX-512. Standard library only: the worker side reads this too.
"""

from __future__ import annotations

import re

#: name prefixes of the variables that steer a numerical library (threads, kernels, caches, allocators,
#: compilers and their flags); a variable starting with one of them is recorded with every worker
STEERING_PREFIXES = (
    "OPENBLAS_", "GOTO", "OMP_", "GOMP_", "KMP_", "MKL_", "BLIS_", "VECLIB_", "NUMEXPR_", "NPY_", "XLA_", "JAX_",
    "TF_XLA_FLAGS", "TF_ENABLE_ONEDNN_OPTS", "NUMBA_", "TORCH_", "ATEN_", "ONEDNN_", "DNNL_", "PYTENSOR_", "THEANO_", "HL_", "TRITON_", "CUBLAS_",
    "NVIDIA_TF32_", "MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD",
)

#: variables that force a kernel or a cache size regardless of what the CPU offers: name -> what it forces
FORCING = {
    "OPENBLAS_CORETYPE": "OpenBLAS's kernel",
    "OPENBLAS_L2_SIZE": "OpenBLAS's L2 blocking (KB)",
    "GOTO_L2_SIZE": "OpenBLAS's L2 blocking (KB)",
    "OPENBLAS_BUFFER_SIZE": "OpenBLAS's buffer size",
    "MKL_CBWR": "MKL's code path",
    "MKL_ENABLE_INSTRUCTIONS": "MKL's instruction set",
    "MKL_DEBUG_CPU_TYPE": "MKL's code path",
    "BLIS_ARCH_TYPE": "BLIS's kernel",
    "ONEDNN_MAX_CPU_ISA": "oneDNN's instruction set",
    "DNNL_MAX_CPU_ISA": "oneDNN's instruction set",
    "ATEN_CPU_CAPABILITY": "PyTorch's kernels",
    "NPY_DISABLE_CPU_FEATURES": "NumPy's dispatched kernels",
}
# flags inside a steering variable's value that force an instruction set (XLA's, glibc's)
_FORCING_VALUES = {
    "XLA_FLAGS": (re.compile(r"--xla_cpu_max_isa\S*"), "XLA's instruction set"),
    "GLIBC_TUNABLES": (re.compile(r"glibc\.cpu\.(hwcaps|x86_\w+)=[^:]*"), "glibc's string and memory kernels"),
}


def steers(name: str) -> bool:
    """True when ``name`` is a variable that steers a numerical library."""
    return name.startswith(STEERING_PREFIXES)


def steering(env: dict) -> dict:
    """The variables of ``env`` that steer a numerical library, sorted by name."""
    return {k: env[k] for k in sorted(env) if steers(k)}


def forces(name: str, value: str) -> str | None:
    """What the variable forces (a kernel, an instruction set, a cache size), or None when it forces nothing."""
    if name in FORCING and str(value).strip():
        return FORCING[name]
    if name in _FORCING_VALUES:
        pattern, what = _FORCING_VALUES[name]
        if pattern.search(str(value)):
            return what
    return None
