"""The roofs a cell's GFLOP/s is read against, measured in a worker of their own: the CPU's NumPy
GEMM peak per dtype and thread count, and the GPU's GEMM rates and memory bandwidth."""

from __future__ import annotations

from harness.run import protocol
from harness.run.client import WorkerFailure, WorkerProcess, worker_environment


def gemm_peaks(cells, known: dict[str, float], say=None, record=None) -> dict[str, float]:
    """The GEMM peaks (GFLOP/s, keyed ``dtype|threads=N``) of the CPU cells' settings not in ``known``."""
    found: dict[str, float] = {}
    # keyed by the master dtype: NumPy has no bfloat16/float16 GEMM, mixed-precision cells read float32's
    for dtype, threads, extra in {(c.problem.master_dtype, c.threads): (c.problem.master_dtype, c.threads, c.env)
                                  for c in cells if c.problem.device == "cpu"}.values():
        key = f"{dtype}|threads={threads}"
        if key in known or key in found:
            continue
        _, env = worker_environment("numpy", "cpu", dtype, threads, extra)
        w = WorkerProcess(None, env, "gemm-peak", record=record)
        try:
            found[key] = w.request(protocol.GemmPeak(dtype, 1024), 120).body.gflops
        except WorkerFailure as exc:
            if say is not None:
                say(f"warning: GEMM peak measurement failed: {exc}")
        finally:
            w.close()
    return found


def gpu_roofs(cells, say=None, record=None) -> dict | None:
    """The GPU's GEMM rates and bandwidth when any of ``cells`` runs on the GPU (None: none does, or
    no GPU or torch here: the GPU cells then say why themselves)."""
    gpu_cells = [c for c in cells if c.problem.device == "gpu"]
    if not gpu_cells:
        return None
    _, env = worker_environment("torch", "gpu", "float32", 1, gpu_cells[0].env)
    w = WorkerProcess(None, env, "gpu-roofs", record=record)
    try:
        return dict(w.request(protocol.GpuRoofs(), 300).body.rates)
    except WorkerFailure as exc:
        if say is not None:
            say(f"note: GPU roofs not measured: {str(exc).splitlines()[0]}")
        return None
    finally:
        w.close()
