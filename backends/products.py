"""The products a roof is measured through, one per library: the library code of
:mod:`harness.worker.cpu_roofs` and :mod:`harness.worker.gpu_roofs`, which time them.

Each library's product lives here, beside its backend, so that the worker side imports no library
but numpy; each is imported only by the worker that measures through it (in that backend's
environment).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from harness.spec.dtype import DType
from harness.spec.errors import HarnessError


def _numpy(dtype: str, n: int, threads: int) -> Callable[[], object]:
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n)).astype(dtype), rng.random((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    return lambda: np.matmul(a, b, out=c)


def _jax(dtype: str, n: int, threads: int) -> Callable[[], object]:
    import jax
    import jax.numpy as jnp

    low = getattr(jnp, dtype)
    rng = np.random.default_rng(0)
    a, b = (jax.device_put(jnp.asarray(rng.random((n, n)), dtype=low)) for _ in range(2))
    product = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return lambda: product(a, b).block_until_ready()


def _torch(dtype: str, n: int, threads: int) -> Callable[[], object]:
    import torch

    low = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.rand(n, n, generator=g).to(low) for _ in range(2))
    c = torch.empty(n, n, dtype=low)
    return lambda: torch.mm(a, b, out=c)


def _native(dtype: str, n: int, threads: int) -> Callable[[], object]:
    from backends import _native

    if dtype != DType.BFLOAT16:
        raise HarnessError(f"unavailable: the native engine has no {dtype} product")
    if not _native.bf16_cpu():
        raise HarnessError("unavailable: this CPU has no AVX512-BF16, so the native engine refuses bfloat16")
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    c = np.empty((n, n), np.float32)
    return lambda: _native.gemm(a, b, c, precision="bfloat16", threads=threads)


#: an ``n`` x ``n`` x ``n`` product of ``dtype`` through each library, as a call to time
LIBRARIES = {"numpy": _numpy, "jax": _jax, "torch": _torch, "native": _native}


def gpu_device() -> str:
    """GPU 0's name (RuntimeError when torch sees no CUDA device)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    return torch.cuda.get_device_name(0)


def gpu_products(n: int, copy_mib: int) -> Iterator[tuple[str, Callable[[], object], float, Callable[[], None]]]:
    """``(key, call, work, sync)`` for each rate of :func:`harness.worker.gpu_roofs.gpu_roofs`: float32 GEMM
    with TF32 off and on, float64, bfloat16 and float16 GEMM (``work`` in flops; the TF32 setting holds
    while the caller times the call), then a device copy (``work`` in bytes: it reads and writes each)."""
    import torch

    dev, sync = torch.device("cuda"), torch.cuda.synchronize
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype, tf32 in (("gemm_fp32_gflops", torch.float32, False), ("gemm_tf32_gflops", torch.float32, True),
                                  ("gemm_fp64_gflops", torch.float64, False), ("gemm_bf16_gflops", torch.bfloat16, False),
                                  ("gemm_fp16_gflops", torch.float16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
            c = torch.empty_like(a)
            torch.mm(a, b, out=c)
            yield name, (lambda a=a, b=b, c=c: torch.mm(a, b, out=c)), 2.0 * n ** 3, sync
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    src = torch.empty(copy_mib * 2 ** 20 // 4, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    # a copy reads and writes every byte
    yield "bandwidth_gbs", (lambda: dst.copy_(src)), 2.0 * src.numel() * 4, sync
