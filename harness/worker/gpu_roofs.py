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
    import torch

    from harness.worker import measure

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    dev, sync = torch.device("cuda"), torch.cuda.synchronize
    rates = {"device": torch.cuda.get_device_name(0)}
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype, tf32 in (("gemm_fp32_gflops", torch.float32, False), ("gemm_tf32_gflops", torch.float32, True),
                                  ("gemm_fp64_gflops", torch.float64, False), ("gemm_bf16_gflops", torch.bfloat16, False),
                                  ("gemm_fp16_gflops", torch.float16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
            c = torch.empty_like(a)
            torch.mm(a, b, out=c)
            rates[name] = measure.best_rate(lambda: torch.mm(a, b, out=c), 2.0 * n ** 3, seconds, sync) / 1e9
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    src = torch.empty(copy_mib * 2 ** 20 // 4, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    # a copy reads and writes every byte
    rates["bandwidth_gbs"] = measure.best_rate(lambda: dst.copy_(src), 2.0 * src.numel() * 4, seconds, sync) / 1e9
    return rates
