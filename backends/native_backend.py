"""The native backend: SPEC.md in C++ (``backends/native/``), built by ``pip install``.

The compiled module ``backends._native`` holds the engine; this wrapper only converts
arrays and names. The float32 per-step recurrent products (2-64 rows of h or dL/da against
W_hh or W_hh^T) run on the engine's own kernel (``native/gemm_f32.hpp``: AVX-512 or
AVX2 + FMA, chosen at run time from CPUID) with W_hh packed once per pass and reused by
every step; every other product (the input and output projections over all steps, the
weight gradients, float64, a single row) goes to the BLAS behind ``scipy.linalg.cython_blas``
(SciPy's OpenBLAS), whose function pointers are handed to the extension at first use. The
rule, measured on Zen 4 against the BLAS in the engine's own calls: the packed kernel ran
the few-row products 1.1-5x faster (16 x 4096 x 1024: 2.9x; 64 x 1760 x 1760: 1.2-1.3x),
a single row 0.3-0.8x (GEMV streams W_hh as it is); run.json records it
(``gemm_routes``). The engine parallelises with OpenMP and keeps that BLAS single-threaded.

Variants:

- ``default``: one minibatch, ONE thread team per call: the big GEMMs (input projection
  over all T, output layer, weight gradients over T*B) split as panels across the team
  with single-threaded BLAS calls, the per-step recurrence split by batch rows (no
  barrier per step) while W_hh fits in L2, by hidden units (one barrier per step)
  otherwise; phases too small to repay a split run on one thread.
- ``sync``: the minibatch's sequences split across ``threads`` workers, each with its own
  buffers; the per-worker gradients are summed and ONE SGD update applied (the spec's step,
  up to summation order).

Both time one thread against the whole team per call shape and run the faster
(``adapt_threads``; now and then a call tries the other, less often while it keeps losing): on a machine whose other cores
are busy a team loses to one thread, and more threads should never be slower.
- ``async``: a parameter server: each thread pulls the shared parameters, computes the
  gradient of one sequence at a time on its local copy and pushes ``lr * g / B`` back
  under a lock. Not the spec's SGD, so it is only run for ``workload: train``.

Mixed precision: ``bfloat16`` is the float32 engine with every product (forward and
backward, the same panels and threads) going through the bfloat16 GEMM of
``native/bf16.hpp``: both operands rounded to bfloat16 (nearest even) while they are
packed in pairs, the products summed in float32; parameters, gradients, state, element-wise
maths and the update stay float32, which is the spec's rounding and nothing more. A
recurrence packs W_hh once per pass, not once per step. The kernel is picked at run time:
AMX tiles (TDPBF16PS, ``native/gemm_amx.hpp``) where the CPU has AMX-BF16 and Linux grants
this process the tile data (Intel's server cores, whose VDPBF16PS runs at half their
float32 rate), else AVX512-BF16's VDPBF16PS (``native/gemm_bf16.hpp``: AMD Zen 4 and 5);
on a CPU with neither, bfloat16 is unsupported, since the portable kernel only emulates the
instruction (``bf16_kernel = "portable"`` accepts it anyway, for tests; "amx" and
"avx512bf16" force a unit, for A/B measurements). ``float16`` is unsupported: no float16 dot-product instruction is
used. ``benchmarks/measure_native.py --bf16`` measures bfloat16 against float32.

Revisions: ``native@rev:<commit>`` (any variant: ``native:sync@rev:HEAD``) runs the engine's sources at
that commit, built on first use into a folder of its own (``native_build.py``), through this
wrapper: two engines side by side in one run (``configs/native_ab.yaml``). What an older engine
lacks (the GRU, bidirectional layers, bfloat16) is unsupported there, as its build's probe found.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from backends.base import Backend, unsupported
from harness.spec.dtype import DType
from harness.spec.errors import HarnessError
from harness.spec.model import Problem

_INT32_MAX = 2**31 - 1
_BF16_KERNELS = ("auto", "amx", "avx512bf16", "portable")
_F32_KERNELS = ("auto", "avx512", "avx2", "blas")
_OPENMP_VERSIONS = {201511: "4.5", 201811: "5.0", 202011: "5.1", 202111: "5.2"}


@functools.cache
def _load(commit: str | None = None):
    """The compiled module with its BLAS pointers set (the installed one, or the build of ``commit``, a full
    hash, made by ``native_build.ensure``); raises if it cannot be used. One process holds one engine."""
    from scipy.linalg import cython_blas

    if commit is None:
        from backends import _native
    else:
        from backends import native_build

        record = native_build.built(commit)
        if record is None:
            raise RuntimeError(f"the native engine of {commit[:native_build.SHORT]} is not built "
                               f"(native_build.ensure builds it)")
        _native = native_build.load(record["module"])
    capi = cython_blas.__pyx_capi__
    _native.init_blas(capi["sgemm"], capi["dgemm"], capi["sgemv"], capi["dgemv"])
    return _native


def sources_newer_than(module_path: str, root: str | None = None) -> list[str]:
    """The engine's source files (``CMakeLists.txt``, ``backends/native/*``) modified after the module at
    ``module_path`` was built: an installed engine that its checkout has moved past (``pip install -e .``
    rebuilds it). Empty where the sources are not there (an installed wheel) or none is newer."""
    from pathlib import Path

    root_dir = Path(root) if root else Path(__file__).resolve().parents[1]
    try:
        built = os.stat(module_path).st_mtime
    except OSError:
        return []
    files = [root_dir / "CMakeLists.txt", *sorted((root_dir / "backends" / "native").glob("*"))]
    return [str(f.relative_to(root_dir)) for f in files if f.is_file() and f.stat().st_mtime > built]


def _gemm_rule(mod, blas: dict) -> str:
    """Which products go where, as this engine decides it here (recorded in run.json's versions)."""
    routes = ("few-row routes (SkylakeX kernels)" if blas["few_row_routes"] else "plain calls") + (
        ", single rows by GEMV" if blas.get("gemv") else "")
    if not hasattr(mod, "f32_kernel"):
        return routes
    kernel = mod.f32_kernel()
    if kernel == "blas":
        return f"float32 recurrent products: the BLAS (no own kernel runs here); BLAS {routes}"
    lo, hi = mod.f32_own_rows
    return (f"float32 per-step recurrent products of {lo}-{hi} rows: own {kernel} kernel, W_hh packed once per pass; "
            f"all other products (projections, weight gradients, float64, other batch sizes): BLAS, {routes}")


def _bf16_rule(mod) -> str:
    """The bfloat16 products' unit here: which this CPU and OS offer, and which kernel runs them."""
    units = ["AVX512-BF16 (vdpbf16ps)" if mod.bf16_cpu() else "no AVX512-BF16 on this CPU"]
    if hasattr(mod, "amx_why_not"):  # an engine older than its AMX kernel has none
        why_not = mod.amx_why_not()
        units.append("AMX-BF16 tiles (tdpbf16ps), granted" if not why_not else f"no AMX: {why_not}")
    return f"{', '.join(units)}; kernel {mod.bf16_kernel()}, every bfloat16 product (W_hh packed once per pass)"


def _engine_spec(problem: Problem) -> dict:
    m = problem.model
    return {
        "kind": m.kind,
        "hidden": m.hidden,
        "layers": m.layers,
        "activation": m.activation,
        "bias": m.bias,
        "peephole": m.peephole,
        "reset_after": m.reset_after,
        "bidirectional": m.bidirectional,
        "head": m.head,
        "output_act": m.output_act,
        "bptt": m.bptt.mode,
        "k": m.bptt.k or 0,
        "clip": float(m.clip or 0.0),
        "input_size": problem.input_size,
        "output_size": problem.output_size,
        "tokens": problem.tokens,
    }


class NativeBackend(Backend):
    """C++ engine: fused per-step kernels, all-step GEMMs through SciPy's BLAS, OpenMP threads."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "native"
    variants = ("default", "sync", "async")
    revisions = True  # native@rev:<commit>: the engine of that commit (native_build.py)

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        self._net = None
        self._names: list[str] = []
        self._dtype = np.dtype("float64")
        self._tokens = False
        self._threads = 1
        self._blas_threads_before: int | None = None
        #: multiplies the engine's minimum work per thread split; 0 splits every phase,
        #: which lets tests reach the multi-thread code paths on tiny shapes
        self.split_scale = 1.0
        #: how a recurrence split across threads is shared: "auto" (by size), "batch"
        #: (sequences per thread, no barrier per step) or "hidden" (units per thread,
        #: one barrier per step); tests force each to reach both code paths
        self.recurrence = "auto"
        #: collect the engine's per-phase and per-thread counters (see ``profile``)
        self.profiling = False
        #: let the engine time one thread against all ``threads`` per call shape and run
        #: the faster (now and then a call tries the other); off: every call forks the whole team
        self.adapt_threads = True
        #: the bfloat16 GEMM's kernel: "auto" (AMX tiles where granted, else AVX512-BF16 where the CPU
        #: has it; bfloat16 is refused elsewhere), "amx" or "avx512bf16" (that unit, for A/B measurements;
        #: refused where it cannot run), or "portable" (the instruction's emulation, accepted on any CPU:
        #: for tests, which check the engine's bfloat16 path on machines without the instruction)
        self.bf16_kernel = "auto"
        #: the float32 recurrent products' kernel: "auto" (AVX-512 where the CPU has it, else AVX2 +
        #: FMA), "avx512", "avx2", or "blas" (every product through the BLAS): for tests and measurements
        self.f32_kernel = "auto"

    def _build(self) -> dict | None:
        """The build record of the revision this name pins (made on first use), None for the installed engine."""
        if self.revision is None:
            return None
        from backends import native_build

        return native_build.ensure(native_build.resolve(self.revision))

    def _module(self):
        """The engine this instance runs: the installed module, or its revision's build."""
        record = self._build()
        return _load(None if record is None else record["commit"])

    def availability(self) -> tuple[bool, str]:
        """Usable when the compiled module imports and SciPy's BLAS capsules load; for a revision, when its
        build exists or could be made now (made here, once: the runner asks before any worker starts, and
        never loads a second engine into its own process)."""
        try:
            if self.revision is not None:
                self._build()
            else:
                _load()
        except Exception as exc:  # a missing or broken build is reported, never raised
            what = f"the native engine at {self.revision}" if self.revision else "native extension"
            return False, f"unavailable: {what} not usable ({type(exc).__name__}: {exc})"
        return True, ""

    def _facts(self) -> dict:
        """What the engine can do: its revision's probe (native_build.probe), or the installed one's."""
        record = self._build()
        if record is not None:
            return record["facts"]
        mod = _load()
        return {"kinds": ["elman", "lstm", "gru"], "bidirectional": True, "bf16_gemm": True, "bf16_cpu": mod.bf16_cpu(),
                "amx_why_not": mod.amx_why_not()}

    @classmethod
    def environment_variables(cls, variant: str, threads: int, device: str, dtype: str) -> dict[str, str]:
        """libgomp's idle threads otherwise spin for a while after every step, on cores the step needs."""
        return {"OMP_WAIT_POLICY": "passive"} if threads > 1 else {}

    def supports(self, problem: Problem) -> tuple[bool, str]:
        """Every model, head and bptt mode on the CPU; async only for workload train; bfloat16 where the
        CPU has AVX512-BF16 (or ``bf16_kernel`` is "portable"), float16 nowhere."""
        if problem.device != "cpu":
            return unsupported("the native backend runs on the CPU only")
        if self.revision is not None:  # an older engine may lack a cell or layer
            facts = self._facts()
            if problem.model.kind not in facts["kinds"]:
                return unsupported(f"the engine at {self.revision} has no {problem.model.kind} cell")
            if problem.model.bidirectional and not facts["bidirectional"]:
                return unsupported(f"the engine at {self.revision} has no bidirectional layers")
        if problem.reduced:
            ok, why = self._mixed_precision(problem.dtype)
            if not ok:
                return ok, why
        if self.variant == "async" and problem.workload != "train":
            return unsupported(
                "asynchronous parameter-server updates are not the spec's synchronous SGD; timed in workload train only"
            )
        m = problem.model
        widest = max(problem.input_size, problem.output_size, m.gates * m.hidden, m.directions * m.hidden)
        if (problem.seq_len + 1) * problem.batch * widest > _INT32_MAX or problem.input_size * m.gates * m.hidden > _INT32_MAX:
            return unsupported("a matrix exceeds the 32-bit BLAS index range")
        return True, ""

    def _mixed_precision(self, dtype: str) -> tuple[bool, str]:
        """bfloat16 where its GEMM runs on VDPBF16PS (or ``bf16_kernel = "portable"`` asks for the emulation)."""
        if dtype != DType.BFLOAT16:
            return unsupported(f"no {dtype} product path: the engine's low-precision GEMM multiplies bfloat16 "
                               f"(AMX TDPBF16PS or AVX512-BF16 VDPBF16PS); {dtype} would need a dot-product "
                               f"instruction of its own")
        if self.bf16_kernel not in _BF16_KERNELS:
            return unsupported(f"bf16_kernel {self.bf16_kernel!r} is not one of {', '.join(_BF16_KERNELS)}")
        try:
            facts = self._facts()
        except Exception as exc:
            return unsupported(f"native extension not usable ({type(exc).__name__}: {exc})")
        if not facts["bf16_gemm"]:
            return unsupported(f"the engine at {self.revision} has no bfloat16 GEMM")
        if self.bf16_kernel == "amx":
            why_not = facts.get("amx_why_not", "this engine has no AMX kernel")
            return (True, "") if facts["bf16_cpu"] and not why_not else unsupported(f"bf16_kernel amx: {why_not}")
        if self.bf16_kernel == "portable" or facts["bf16_cpu"]:
            return True, ""
        return unsupported("bfloat16: this CPU has no AVX512-BF16 (VDPBF16PS); the engine's portable kernel emulates "
                           "the instruction at float32 speed or worse, so a bfloat16 time would not measure bfloat16")

    def versions(self) -> dict[str, str]:
        """Compiler, flags, OpenMP, SIMD level and the BLAS the engine calls."""
        out = {"numpy": np.__version__}
        try:
            import scipy

            mod = self._module()
        except Exception:
            return out
        build, blas = mod.build_info(), mod.blas_info()
        out["scipy"] = scipy.__version__
        out["compiler"] = build["compiler"]
        out["flags"] = build.get("flags", "")
        out["openmp"] = f"OpenMP {_OPENMP_VERSIONS.get(build['openmp'], build['openmp'])} (libgomp)" \
            if "gcc" in build["compiler"] else f"OpenMP {build['openmp']}"
        out["simd"] = build["simd"]
        source = blas["config"] or "unknown BLAS"
        where = os.path.realpath(blas["library"]) if blas["library"] else "library not located: BLAS threads uncontrolled"
        out["blas"] = f"{source} via scipy.linalg.cython_blas ({where})"
        if hasattr(mod, "bf16_cpu"):  # an engine older than its bfloat16 GEMM has none
            out["bf16_gemm"] = _bf16_rule(mod)
        if self.revision is not None:
            out["engine_commit"] = self._build()["commit"]
        else:  # an A/B against another commit (native@rev:) means little if this build is not the checkout's
            newer = sources_newer_than(getattr(mod, "__file__", "") or "")
            out["engine_sources"] = (f"{', '.join(newer)} changed after this build: pip install -e . rebuilds it"
                                     if newer else "the checkout's (no source newer than the build)")
        out["gemm_routes"] = _gemm_rule(mod, blas) + (
            f"; bfloat16 products: every one on the {mod.bf16_kernel()} kernel" if hasattr(mod, "bf16_kernel") else "")
        return out

    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        """Copy the parameters into a fresh engine with up to ``threads`` OpenMP threads."""
        mod = self._module()
        self.close()
        self.problem = problem
        self._dtype = np.dtype(problem.master_dtype)  # bfloat16: float32 masters, data and state
        self._tokens = problem.tokens
        self._names = problem.model.param_names()
        arrays = [np.ascontiguousarray(params[k], dtype=self._dtype) for k in self._names]
        net_class = mod.Net32 if self._dtype == np.float32 else mod.Net64
        # the engine's threads each call the BLAS: its own pool would oversubscribe the cores
        self._blas_threads_before = mod.set_blas_threads(1)
        if hasattr(mod, "set_f32_kernel"):  # an engine older than its float32 kernel has none
            if self.f32_kernel not in _F32_KERNELS:
                raise HarnessError(f"native: f32_kernel {self.f32_kernel!r} is not one of {', '.join(_F32_KERNELS)}")
            try:
                mod.set_f32_kernel(self.f32_kernel)
            except ValueError as exc:
                raise HarnessError(f"native: {exc}") from None
        if problem.reduced:
            ok, why = self._mixed_precision(problem.dtype)
            if not ok:
                raise HarnessError(f"native: {why}")
            mod.set_bf16_kernel(self.bf16_kernel)
        spec = _engine_spec(problem) | {"split_scale": float(self.split_scale), "recurrence": self.recurrence,
                                        "adapt_threads": bool(self.adapt_threads), "bf16": problem.reduced}
        self._threads = max(1, int(threads))
        self._net = net_class(spec, self.variant, self._threads, 1, arrays)
        self._net.set_profiling(bool(self.profiling))

    def profile(self, reset: bool = False) -> dict | None:
        """The engine's counters since profiling started (None when ``profiling`` is off).

        ``phases[name]["seconds"]``: per thread, wall seconds inside the phase;
        ``["wait_seconds"]``: the part spent at barriers; ``["cpu_seconds"]``: the thread's CPU
        time in it (robust to a loaded machine, where wall time includes time off the core). ``wall_seconds`` / ``cpu_seconds``:
        per thread, wall and CPU time of its team runs (the difference is time it was
        runnable but off its core); ``barriers``, ``runs`` per thread; ``team_sizes``: team
        runs by thread count; ``steps``: SGD steps counted. ``reset`` clears the counters."""
        if self._net is None:
            return None
        out = self._net.profile()
        if reset and out is not None:
            self._net.set_profiling(True)
        return out

    def warm_up(self, batch) -> None:
        """Allocate the buffers for this batch shape and let the thread tuner time a team against
        one thread on the timed call (steps with ``lr = 0``: parameters untouched), so that
        its trials fall here and not into the timed rounds."""
        x, y = batch
        self._net.reserve(int(x.shape[0]), int(x.shape[1]))
        if not self.adapt_threads or self._threads <= 1:
            return
        mod = self._module()
        for _ in range(mod.tuner_probe_calls):
            if self.problem.workload == "forward":
                self.forward(x)
            else:
                self.sgd_step(x, y, 0.0)

    def _x(self, x) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.int64 if self._tokens else self._dtype)

    def _y(self, y) -> np.ndarray:
        dtype = np.int64 if self.problem.model.head == "softmax_xent" else self._dtype
        return np.ascontiguousarray(y, dtype=dtype)

    def forward(self, x) -> np.ndarray:
        """Softmax probabilities or the mse head's outputs, (T, B, O)."""
        return self._net.forward(self._x(x))

    def loss_and_grads(self, x, y) -> tuple[float, dict[str, np.ndarray]]:
        """Reported loss and the objective's gradients (exact on every variant)."""
        loss, grads = self._net.loss_and_grads(self._x(x), self._y(y))
        return loss, dict(zip(self._names, grads))

    def sgd_step(self, x, y, lr: float) -> float:
        """One step of the variant's training scheme; the loss before the update."""
        return self._net.sgd_step(self._x(x), self._y(y), float(lr))

    def get_params(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters."""
        return dict(zip(self._names, self._net.get_params()))

    def close(self) -> None:
        """Drop the engine and give SciPy's BLAS its thread count back."""
        self._net = None
        if self._blas_threads_before is not None:
            if self._blas_threads_before > 0:
                self._module().set_blas_threads(self._blas_threads_before)
            self._blas_threads_before = None
