"""PyTensor: Theano's graph (``scan``, ``grad``, one function with SGD updates) in the
main environment, compiled by one of three linkers.

Variants: ``c`` (the C VM linker, its C code linked against OpenBLAS through the shim in
backends/blas), ``numba`` (PyTensor 3's default; its cache persists under the harness
cache so its long first compile is paid once) and ``jax``. The graph is
:class:`backends.theano_backend.ScanGraphBackend`'s, so the two libraries run the same
program.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import sys
import warnings
from types import SimpleNamespace

import numpy as np

from backends.theano_backend import ScanGraphBackend, graph_compiler_flags, merge_flags

_MODES = {"c": None, "numba": "NUMBA", "jax": "JAX"}
_NEEDS = {"c": None, "numba": "numba", "jax": "jax"}


def cache_dir():
    """PyTensor's compile and Numba caches, shared by every process of the harness."""
    from harness.spec.environments import cache_dir as _cache_dir

    return _cache_dir("pytensor")


def blas_ldflags() -> tuple[str, str]:
    """``(blas__ldflags, reason)``: the OpenBLAS shim of this environment, built on first use."""
    from backends import blas

    sites = [p for p in sys.path if p.endswith("site-packages")]
    info = blas.build_shim(cache_dir() / "blas", sites)
    return info["ldflags"], info["reason"] or info["library"]


def pytensor_flags(dtype: str | None = None) -> str:
    """The ``PYTENSOR_FLAGS`` this backend runs with: persistent compiledir, BLAS, compiler."""
    return graph_compiler_flags(cache_dir(), blas_ldflags()[0], dtype)


def _import_pytensor():
    if "pytensor" not in sys.modules:
        os.environ["PYTENSOR_FLAGS"] = merge_flags(pytensor_flags(), os.environ.get("PYTENSOR_FLAGS"))
        os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_dir() / "numba"))
    import pytensor

    return pytensor


class PytensorBackend(ScanGraphBackend):
    """PyTensor 3 with the C (cvm), Numba or JAX linker."""

    name = "pytensor"
    package = "pytensor"
    variants = ("c", "numba", "jax")
    compile_heavy = True

    def availability(self) -> tuple[bool, str]:
        if importlib.util.find_spec("pytensor") is None:
            return False, "unavailable: pytensor is not installed (pip install pytensor)"
        needed = _NEEDS[self.variant]
        if needed and importlib.util.find_spec(needed) is None:
            return False, f"unavailable: the {self.variant} linker needs {needed}, which is not installed"
        if self.variant == "c" and shutil.which("g++") is None:
            return False, "unavailable: the C linker needs a C++ compiler (g++) on PATH"
        return True, ""

    @classmethod
    def environment_variables(cls, variant: str, threads: int, device: str, dtype: str) -> dict[str, str]:
        env = {"PYTENSOR_FLAGS": pytensor_flags(dtype), "NUMBA_CACHE_DIR": str(cache_dir() / "numba")}
        if variant == "jax":  # XLA on the threads asked for (its Eigen pool would take every core)
            from backends.jax_backend import JaxBackend

            env.update(JaxBackend.environment_variables("default", threads, device, dtype))
        return env

    def versions(self) -> dict[str, str]:
        out = {"numpy": np.__version__}
        if "pytensor" in sys.modules:
            pytensor = sys.modules["pytensor"]
            out["pytensor"] = pytensor.__version__
            out["blas__ldflags"] = pytensor.config.blas__ldflags
        if self.variant == "c":
            out["blas"] = blas_ldflags()[1] or "numpy C-API"
        needed = _NEEDS[self.variant]
        if needed and needed in sys.modules:
            out[needed] = sys.modules[needed].__version__
        return out

    def prepare(self, problem, params, device="cpu", threads=1) -> None:
        if self.variant == "jax":
            import jax

            # float64 needs x64; but with x64 on, PyTensor's JAX sums of float32 return their
            # float64 accumulator (and scan then rejects the mixed carry), so follow the dtype
            from backends.jax_backend import use_precision

            use_precision(problem.dtype, jax, switch_off=True)
            # ... and, with x64 off, JAX warns each time that cast truncates to float32: intended
            warnings.filterwarnings("ignore", message="Explicitly requested dtype float64", category=UserWarning)
        super().prepare(problem, params, device, threads)

    def _compile_flags(self) -> dict:
        flags = super()._compile_flags()
        if "blas__ldflags" not in os.environ.get("PYTENSOR_FLAGS", ""):
            # pytensor was imported before this backend could set its flags: link the BLAS anyway
            flags["blas__ldflags"] = blas_ldflags()[0]
        return flags

    def _mode(self):
        from pytensor.compile.mode import Mode, get_mode

        if self.variant == "c":
            return Mode(linker="cvm", optimizer="fast_run")
        return get_mode(_MODES[self.variant])

    def _step_rows(self, lib, W, ids):
        rows = W[ids]
        if self.problem.batch == 1:
            # PyTensor's AdvancedIncSubtensor1 (the gather's gradient) rejects a one-row
            # increment as "runtime broadcasting" unless that row count is static
            rows = lib.tensor.specify_shape(rows, (1, None))
        return rows

    def _library(self) -> SimpleNamespace:
        pytensor = _import_pytensor()
        import pytensor.tensor as pt
        from pytensor.gradient import disconnected_grad

        # PyTensor 3 returns the outputs alone when asked to; 2.x (pytensor@2.30.3) returns (outputs, updates)
        # as Theano does
        new_scan = "return_updates" in inspect.signature(pytensor.scan).parameters

        def scan(fn, **kwargs):
            if new_scan:
                outputs = pytensor.scan(fn, strict=True, return_updates=False, **kwargs)
            else:
                outputs, updates = pytensor.scan(fn, strict=True, **kwargs)
                assert not updates, "the RNN step has no random state or shared updates"
            return outputs if isinstance(outputs, list) else [outputs]

        def tensor_input(name, dtype, shape):
            # JAX traces with concrete shapes only (inputs and parameters alike); the other
            # linkers take any T and B
            return pt.tensor(name, dtype=dtype, shape=shape if self.variant == "jax" else (None,) * len(shape))

        def shared(value, name):
            return pytensor.shared(value, name=name, shape=value.shape if self.variant == "jax" else None)

        return SimpleNamespace(tensor=pt, shared=shared, scan=scan, grad=pytensor.grad,
                               config=pytensor.config, function=pytensor.function, sigmoid=pt.sigmoid,
                               disconnected_grad=disconnected_grad, input=tensor_input)
