"""The GPU's roofs, measured at run start in a worker: float32 GEMM rate through cuBLAS
(TF32 off, as every cell runs, and on, for reference) and device memory bandwidth.

GPU cells report 10+ TFLOP/s; without the card's own measured rates the figure means
nothing. Like the CPU's GEMM peak, these are best-of rates on this machine, not the
datasheet's. Needs PyTorch with CUDA; imported only by the worker that measures.
"""

from __future__ import annotations


def gpu_roofs(n: int = 4096, copy_mib: int = 512, seconds: float = 0.5, clock=None) -> dict:
    """``{"device", "gemm_fp32_gflops", "gemm_tf32_gflops", "bandwidth_gbs"}`` of GPU 0.

    ``clock(fn, sync, seconds)`` returns the best seconds of one call of ``fn`` (the harness's
    one timing loop, with ``sync`` before every clock read)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    c = torch.empty(n, n, device=dev)
    before = torch.backends.cuda.matmul.allow_tf32
    rates = {}
    try:
        for name, tf32 in (("gemm_fp32_gflops", False), ("gemm_tf32_gflops", True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            best_s = clock(lambda: torch.mm(a, b, out=c), sync, seconds)
            rates[name] = 2.0 * n ** 3 / best_s / 1e9
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    src = torch.empty(copy_mib * 2 ** 20 // 4, device=dev)
    dst = torch.empty_like(src)
    best_s = clock(lambda: dst.copy_(src), sync, seconds)
    rates["bandwidth_gbs"] = 2.0 * src.numel() * 4 / best_s / 1e9  # a copy reads and writes every byte
    rates["device"] = torch.cuda.get_device_name(0)
    return rates
