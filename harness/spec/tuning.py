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


# -- an OpenBLAS older than the CPU ---------------------------------------------------------------------------
# An OpenBLAS build picks its kernel by the CPU's family and model; on a model newer than the build it falls
# back to a generic SSE kernel (Prescott) though the CPU has AVX2 or AVX-512: GEMMs at a fraction of what the
# CPU gives. OPENBLAS_CORETYPE names the kernel instead (the one variable every build reads, whatever its
# symbols' prefix), and a build that does not know the name it is given keeps its own pick.

CORETYPE = "OPENBLAS_CORETYPE"
#: OpenBLAS's core types without AVX2 (lower case): what a build falls back to on a CPU it does not know
GENERIC_CORES = frozenset({
    "katmai", "coppermine", "northwood", "prescott", "banias", "atom", "core2", "penryn", "dunnington", "nehalem",
    "opteron", "opteron_sse3", "barcelona", "bobcat", "nano", "generic",
})
# the flags each core type's kernels need, as /proc/cpuinfo names them
_CORE_NEEDS = {
    "SkylakeX": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"},
    "Zen": {"avx2", "fma"},
    "Haswell": {"avx2", "fma"},
}


def is_generic(architecture) -> bool:
    """True when an OpenBLAS kernel name is one of its generic, pre-AVX2 core types (Prescott, Core2, ...)."""
    return bool(architecture) and str(architecture).strip().lower() in GENERIC_CORES


def wants_better(flags) -> bool:
    """True when a CPU with these flags has AVX2 or AVX-512, where a generic kernel leaves most of it unused."""
    return bool({"avx2", "avx512f"} & set(flags))


def core_types(flags, vendor: str = "") -> list[str]:
    """The ``OPENBLAS_CORETYPE`` values for a CPU with these flags, best first: SkylakeX where it has AVX-512
    (Intel), Zen on AMD, Haswell where it has AVX2; a build takes the first one it knows."""
    flags = set(flags)
    amd = "amd" in vendor.lower()
    order = ["Zen", "Haswell"] if amd else ["SkylakeX", "Haswell"]
    return [core for core in order if _CORE_NEEDS[core] <= flags]


def is_openblas(lib: dict) -> bool:
    """True for a BLAS entry (:func:`harness.worker.blas_probe.kernels`) of an OpenBLAS build."""
    return lib.get("user_api") in (None, "blas") and "openblas" in str(lib.get("internal_api") or "").lower()


def library_text(lib: dict) -> str:
    """``OpenBLAS 0.3.20`` of a BLAS entry (threadpoolctl gives the bare version, the library's own config
    string starts ``OpenBLAS 0.3.20 DYNAMIC_ARCH ...``)."""
    words = str(lib.get("version") or "").split()
    version = words[1] if words[:1] == ["OpenBLAS"] and len(words) > 1 else (words[0] if words else "")
    return f"OpenBLAS {version}".strip()


def generic_libraries(blas) -> list[dict]:
    """The OpenBLAS builds of a worker's BLAS entries that run a generic kernel."""
    return [lib for lib in blas or [] if is_openblas(lib) and is_generic(lib.get("architecture"))]


def choose_core_type(flags, vendor: str, alone: list, tried: dict) -> str | None:
    """The core type to set: the first of :func:`core_types` under which every OpenBLAS build that ran a
    generic kernel by itself (``alone``, their BLAS entries) runs that very kernel (``tried``: core type ->
    the BLAS entries reported with it set). None where none needs one, the CPU has neither AVX2 nor AVX-512,
    or no core type takes in every such build."""
    fallen = {lib.get("filepath") for lib in generic_libraries(alone)}
    if not fallen or not wants_better(flags):
        return None
    for core in core_types(flags, vendor):
        ran = {lib.get("filepath"): str(lib.get("architecture") or "").lower() for lib in tried.get(core) or []}
        if all(ran.get(path) == core.lower() for path in fallen):
            return core
    return None


def _joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def fallback_lines(meta: dict) -> list[str]:
    """What the Answer says of OpenBLAS builds older than the run's CPU, from run.json's ``worker_environment``:
    per backend whose workers got a core type from the harness, ``theano's OpenBLAS 0.3.20 does not know this
    CPU: its workers run SkylakeX by OPENBLAS_CORETYPE``; per backend whose workers still ran a generic kernel
    on a CPU with AVX2 or AVX-512, which kernel and build."""
    flags = (meta.get("machine") or {}).get("cpu_flags") or []
    fixed: dict[str, tuple[str, list[str]]] = {}
    left: dict[str, list[str]] = {}
    for key, entry in (meta.get("worker_environment") or {}).items():
        backend = key.rpartition("|threads=")[0] or key
        var = (entry.get("variables") or {}).get(CORETYPE) or {}
        if var.get("fixes") and not var.get("removed"):
            builds = fixed.setdefault(backend, (var.get("value", ""), []))[1]
            builds += [library_text(lib) for lib in var["fixes"] if library_text(lib) not in builds]
        if wants_better(flags):
            ran = left.setdefault(backend, [])
            ran += [t for t in (f"{library_text(lib)}'s {lib.get('architecture')}"
                                for lib in generic_libraries(entry.get("blas"))) if t not in ran]
    out = []
    for backend, (core, builds) in fixed.items():
        versions = [b.split(" ", 1)[-1] for b in builds]
        what = f"OpenBLAS {_joined(versions)} do" if len(versions) > 1 else f"{builds[0] if builds else 'OpenBLAS'} does"
        out.append(f"{backend}'s {what} not know this CPU: its workers run {core} by {CORETYPE}.")
    isa = "AVX-512" if "avx512f" in flags else "AVX2"
    for backend, ran in left.items():
        if ran:
            out.append(f"{backend}'s workers ran a generic kernel ({_joined(ran)}) on a CPU with {isa}: its times "
                       f"are below what this CPU gives.")
    return out
