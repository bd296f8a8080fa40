"""The roofs a cell's GFLOP/s is read against, measured in a worker of their own: the CPU's GEMM
peak and its hardware FMA peak per dtype and thread count, the higher being the roof
(:mod:`harness.worker.cpu_roofs`), and the GPU's GEMM rates and
memory bandwidth (:mod:`harness.worker.gpu_roofs`)."""

from __future__ import annotations

from harness.worker import cpu_roofs, protocol
from harness.run.client import WorkerFailure, WorkerProcess, worker_environment
from harness.spec.model import REDUCED_DTYPES


_UNAVAILABLE: set[str] = set()  # the per-library peaks a library (or the FMA kernel) could not measure here


def gemm_peaks(cells, known: dict[str, float], say=None, record=None) -> dict[str, float]:
    """The roofs (GFLOP/s, keyed :func:`cpu_roofs.peak_key`) of the CPU cells' settings whose roof is not
    in ``known``: per dtype and thread count the rate through each of :func:`cpu_roofs.roof_libraries`
    (NumPy's GEMM in float32 and float64, each low-precision library's, and the hardware FMA peak in
    float32 and bfloat16), each under its own key, and the highest as the cells' roof. Under mixed
    precision the float32 roof is measured too (drawn beside it)."""
    found: dict[str, float] = {}
    wanted = {}
    for c in cells:
        if c.problem.device != "cpu":
            continue
        p = c.problem
        for dtype in dict.fromkeys((p.master_dtype, p.dtype)):
            if cpu_roofs.peak_key(dtype, c.threads) in known:  # this run's roof, measured already
                continue
            for library in cpu_roofs.roof_libraries(dtype):
                wanted.setdefault((dtype, c.threads, library), c.env)
    clean = _clean(cells)
    for (dtype, threads, library), extra in wanted.items():
        key = cpu_roofs.peak_key(dtype, threads, library)
        if key in known or key in found or key in _UNAVAILABLE:
            continue
        rate = _measure(dtype, threads, library, extra, say, record, clean)
        if rate is not None:
            found[key] = rate
        elif library != "numpy":
            _UNAVAILABLE.add(key)  # asked once per process: the library lacks the type here
    for dtype, threads in {(d, t) for d, t, _ in wanted}:
        key = cpu_roofs.peak_key(dtype, threads)
        rates = cpu_roofs.library_rates({**known, **found}, dtype, threads)
        if rates and key not in known:
            found[key] = max(rates.values())
        elif not rates and say is not None:
            say(f"note: no {dtype} GEMM peak measured (none of {', '.join(cpu_roofs.roof_libraries(dtype))} "
                f"has the product here): {dtype} cells show no share of a roof")
    return found


def _clean(cells) -> bool:
    """Whether the roofs are measured without the caller's steering variables: when every CPU cell's worker is."""
    cpu = [c for c in cells if c.problem.device == "cpu"]
    return bool(cpu) and all(getattr(c, "clean_env", False) for c in cpu)


def peaks_again(cells, start: dict, say=None, record=None) -> dict[str, float]:
    """NumPy's GEMM peaks (float32, float64) of ``start`` measured once more, as at a run's end, under the
    plain keys (``dtype|threads=N``): a machine that got busier in between shows a lower peak
    (:func:`harness.run.guard.peak_evidence`, which reads the start's NumPy key against these). The engine's FMA
    peak and the low types' libraries are not measured again: one library's product, like for like, says what
    the machine did."""
    extra = {(c.problem.dtype, c.threads): c.env for c in cells if c.problem.device == "cpu"}
    out = {}
    for key in start:
        dtype, threads, library = cpu_roofs.read_peak_key(key)
        if library != "numpy" or dtype in REDUCED_DTYPES:
            continue
        env = next((e for (d, t), e in extra.items() if t == threads), {})
        rate = _measure(dtype, threads, "numpy", env, say, record, _clean(cells))
        if rate is not None:
            out[cpu_roofs.peak_key(dtype, threads)] = rate
    return out


def _measure(dtype: str, threads: int, library: str, extra: dict, say, record, clean: bool = False) -> float | None:
    """One peak, in a worker with ``library``'s backend environment (its thread settings; the hardware
    peak in the native backend's)."""
    _, env = worker_environment(cpu_roofs.BACKEND_OF.get(library, library), "cpu", dtype, threads, extra, clean)
    w = WorkerProcess(None, env, "gemm-peak", record=record)
    try:
        return w.request(protocol.GemmPeak(dtype, 1024, library), 120).body.gflops
    except WorkerFailure as exc:
        quiet = "unavailable:" in str(exc)  # one of several libraries (or the hardware kernel): fine
        if say is not None and not quiet:
            say(f"warning: {dtype} GEMM peak through {library} failed: {str(exc).splitlines()[0]}")
        return None
    finally:
        w.close()


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
