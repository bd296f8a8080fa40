"""The BLAS a worker runs, and which BLAS makes a backend's training step faster.

:func:`kernels` names every BLAS (and OpenMP) library loaded in this process with the kernel it
chose (OpenBLAS's core type, BLIS's and MKL's architecture), its version and threads: each worker
reports it, so a run records the kernel that actually ran, not the one the CPU would suggest.
It asks threadpoolctl where that is installed and reads the loaded libraries itself otherwise
(an isolated environment on numpy 1.23 need not hold threadpoolctl).

``python -m harness.worker.blas_probe --kernels`` prints, as one JSON line, the kernels of the BLAS
libraries a worker of this environment loads (NumPy's, SciPy's where installed): harness/run/envs.py runs it
with and without ``OPENBLAS_CORETYPE`` to find a build older than the CPU and the core type it knows.

``python -m harness.worker.blas_probe --backend theano --ldflags "openblas=-L... -l..."`` compiles
the sgd_step at the WildML shape once per ``blas__ldflags`` value given, times the
variants in alternating steps and prints one JSON line with the medians. harness/run/envs.py
runs it with one value per process, alternating processes, at each thread count
(``OPENBLAS_NUM_THREADS`` of the process). Benchmarks proper go through the runner.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import ctypes
import re

from harness.worker import lifeline

# the symbols that name an OpenBLAS build's kernel, by the prefixes builds give them (NumPy's wheels ship
# scipy_openblas with a prefix and, for 64-bit integers, a 64_ suffix)
_CORENAME = [f"{prefix}get_corename{suffix}" for prefix in ("openblas_", "scipy_openblas_", "scipy_openblas64_")
             for suffix in ("", "64_")]
_CONFIG = [name.replace("corename", "config") for name in _CORENAME]
_BLAS_FILE = re.compile(r"lib(scipy_)?openblas[^/]*\.so[^/]*$|libmkl_rt[^/]*\.so|libblis[^/]*\.so")


def kernels() -> list:
    """Every BLAS and OpenMP library loaded in this process: ``internal_api`` (openblas, mkl, blis, ...),
    ``architecture`` (the kernel it runs: ``Haswell``, ``SkylakeX``, ``Zen``; None where the library does
    not say), ``version``, ``num_threads``, ``filepath`` and ``source`` (``threadpoolctl`` or
    ``loaded libraries``, the fallback where threadpoolctl is not installed: OpenBLAS's kernel only)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return _loaded_openblas()
    try:
        found = threadpool_info()
    except Exception as exc:  # a library threadpoolctl cannot read must not cost the cell
        return [{"internal_api": "unknown", "architecture": None, "error": f"{type(exc).__name__}: {exc}",
                 "source": "threadpoolctl"}]
    keep = ("user_api", "internal_api", "architecture", "version", "num_threads", "threading_layer", "filepath")
    return [dict({k: info.get(k) for k in keep}, source="threadpoolctl") for info in found]


def _loaded_openblas() -> list:
    """OpenBLAS libraries mapped into this process, each asked for its kernel through its own symbols."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split(None, 5)[5].strip() for line in fh if len(line.split(None, 5)) == 6}
    except OSError:
        return []
    out = []
    for path in sorted(p for p in paths if _BLAS_FILE.search(p)):
        entry = {"user_api": "blas", "internal_api": "openblas" if "openblas" in path else path.rsplit("/", 1)[-1],
                 "architecture": None, "version": None, "num_threads": None, "threading_layer": None,
                 "filepath": path, "source": "loaded libraries"}
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            out.append(entry)
            continue
        for names, key in ((_CORENAME, "architecture"), (_CONFIG, "version")):
            for name in names:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    value = fn()
                    entry[key] = value.decode("utf-8", "replace").strip() if value else None
                    break
        out.append(entry)
    return out


def environment_kernels() -> list:
    """:func:`kernels` once NumPy and every OpenBLAS this environment's wheels bring (``numpy.libs``,
    ``scipy.libs``, ``scipy_openblas32``) are loaded: the builds a worker of the environment may run,
    whatever its backend imports. Nothing where NumPy is not installed."""
    import sysconfig
    from pathlib import Path

    try:
        import numpy  # noqa: F401
    except ImportError:
        return []
    found = []
    for folder in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        found += sorted(Path(folder).glob("*.libs/*.so*")) + sorted(Path(folder).glob("scipy_openblas*/lib/*.so"))
    for path in found:
        if "openblas" in path.name and _BLAS_FILE.search(path.name):
            try:
                ctypes.CDLL(str(path))
            except OSError:  # a library that does not load here is not one a worker runs
                pass
    return kernels()


def probe(full_name: str, ldflags: dict[str, str], n_steps: int = 40) -> dict:
    """Median sgd_step time (ms) per ``blas__ldflags`` value at vocab 8000, hidden 100, T 20, batch 1, float32."""
    import numpy as np

    import backends
    from harness.worker import measure
    from harness.spec import reference
    from harness.spec.model import ModelSpec, Problem

    model = ModelSpec(kind="elman", hidden=100, bias=False)
    problem = Problem(model, 8000, 8000, True, "float32", 1, 20)
    params = reference.init_params(model, 8000, 8000, seed=0, dtype="float32")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 8000, size=(20, 1)), rng.integers(0, 8000, size=(20, 1))
    instances, compile_s = {}, {}
    for key, flags in ldflags.items():
        backend = backends.create(full_name)
        backend.prepare(problem, params)
        with backend.blas_ldflags(flags):
            compile_s[key] = measure.time_once(lambda: backend.warm_up((x, y)), backend.sync)[0]
        instances[key] = backend
    samples = measure.time_interleaved({k: (lambda b=b: b.sgd_step(x, y, 0.005)) for k, b in instances.items()},
                                       n_steps, syncs={k: b.sync for k, b in instances.items()})
    for backend in instances.values():
        backend.close()
    return {"backend": full_name, "threads": os.environ.get("OPENBLAS_NUM_THREADS", ""),
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()}, "compile_s": compile_s}


def main(argv=None) -> int:
    """Entry point: print the probe's result as one JSON line."""
    lifeline.die_with_parent()  # a probe outlives no harness that is building its environment
    ap = argparse.ArgumentParser(prog="python -m harness.worker.blas_probe")
    ap.add_argument("--kernels", action="store_true", help="print the loaded BLAS libraries' kernels and exit")
    ap.add_argument("--backend")
    ap.add_argument("--ldflags", action="append", help="NAME=FLAGS, repeated")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    if args.kernels:
        print(json.dumps(environment_kernels()), flush=True)
        return 0
    if not (args.backend and args.ldflags):
        ap.error("--backend and --ldflags are required without --kernels")
    if os.environ.get("HARNESS_CPUS"):  # the cores a worker of its thread count is confined to, as the worker does
        os.sched_setaffinity(0, {int(c) for c in os.environ["HARNESS_CPUS"].split(",")})
    ldflags = dict(item.split("=", 1) for item in args.ldflags)
    print(json.dumps(probe(args.backend, ldflags, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
