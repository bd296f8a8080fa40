"""The GPU's roofs, measured at run start in a worker: float32 GEMM rate through cuBLAS
(TF32 off, as every cell runs, and on, for reference), the bfloat16 and float16 rates (float32
accumulation, what mixed-precision cells read against) and device memory bandwidth.

GPU cells report 10+ TFLOP/s; without the card's own measured rates the figure means
nothing. Like the CPU's GEMM peak, these are best-of rates on this machine, not the
datasheet's. Needs PyTorch with CUDA; imported only by the worker that measures.
"""

from __future__ import annotations


def gpu_roofs(n: int = 4096, copy_mib: int = 512, seconds: float = 0.5) -> dict:
    """GPU 0's best float32 GEMM rate with TF32 off and on, float64, bfloat16 and float16 GEMM rates and copy
    bandwidth: ``{"device", "gemm_fp32_gflops", "gemm_tf32_gflops", "gemm_fp64_gflops", "gemm_bf16_gflops",
    "gemm_fp16_gflops", "bandwidth_gbs"}``."""
    from backends import products
    from harness.worker import measure

    rates = {"device": products.gpu_device()}
    for name, call, work, sync in products.gpu_products(n, copy_mib):
        rates[name] = measure.best_rate(call, work, seconds, sync) / 1e9
    return rates
