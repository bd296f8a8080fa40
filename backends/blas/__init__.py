"""Linking Theano's and PyTensor's generated C code against an optimised BLAS.

Both call the plain Fortran names (``sgemm_``, ...) through ``blas__ldflags``. The
OpenBLAS that the registries ship as a linkable library (the ``scipy-openblas32``
wheel, also bundled inside SciPy's own wheels) exports them with a ``scipy_``
prefix, so a tiny shim (``openblas_shim.c``) compiled here forwards the plain names
to it. Nothing in this module imports a heavy library.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SHIM_SOURCE = Path(__file__).with_name("openblas_shim.c")
SHIM_NAME = "rnnharness_blas"  # linked as -lrnnharness_blas
CHOICE_FILE = "blas.json"


def find_openblas(site_dirs) -> tuple[Path, str] | None:
    """``(library, prefix)`` of a prefixed LP64 OpenBLAS in these site-packages folders, or None."""
    for site in map(Path, site_dirs):
        wheel = site / "scipy_openblas32" / "lib" / "libscipy_openblas.so"
        if wheel.is_file():
            return wheel, "scipy_"
    for site in map(Path, site_dirs):
        # SciPy >= 1.13 vendors the same build (32-bit integers, scipy_ prefix)
        bundled = sorted((site / "scipy.libs").glob("libscipy_openblas-*.so"))
        if bundled:
            return bundled[0], "scipy_"
    return None


def _flag_safe(path: Path) -> bool:
    # blas__ldflags is split on spaces and the flags string itself on commas
    return not any(ch in str(path) for ch in " ,=\"'")


def build_shim(out_dir: Path, site_dirs) -> dict:
    """Compile the shim into ``out_dir`` (once; reused after) and describe it.

    Returns ``{"ldflags": ..., "library": ..., "reason": ""}``; ``ldflags`` is empty
    with a reason when no OpenBLAS or no C compiler is found.
    """
    out_dir = Path(out_dir)
    found = find_openblas(site_dirs)
    if found is None:
        return {"ldflags": "", "library": "", "reason": "no scipy-openblas library found"}
    library, prefix = found
    if not (_flag_safe(out_dir) and _flag_safe(library.parent)):
        return {"ldflags": "", "library": str(library), "reason": f"path unusable in blas__ldflags: {out_dir}"}
    target = out_dir / f"lib{SHIM_NAME}.so"
    stamp = out_dir / "shim.json"
    source_sha1 = hashlib.sha1(SHIM_SOURCE.read_bytes()).hexdigest()
    want = {"library": str(library), "prefix": prefix, "source_sha1": source_sha1}
    if not (target.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == want):
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            return {"ldflags": "", "library": str(library), "reason": "no C compiler to build the BLAS shim"}
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cc, "-O2", "-shared", "-fPIC", f"-DBLAS_PREFIX={prefix}", "-o", tmp, str(SHIM_SOURCE),
               str(library), f"-Wl,-rpath,{library.parent}", "-Wl,--no-undefined"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            tail = " ".join(proc.stderr.strip().splitlines()[-3:])
            return {"ldflags": "", "library": str(library), "reason": f"building the BLAS shim failed: {tail}"}
        os.replace(tmp, target)  # atomic, so concurrent builders never load a half-written file
        from harness.spec import writes

        writes.write_file(stamp, json.dumps(want))  # never through a link left in the cache
    return {"ldflags": f"-L{out_dir} -l{SHIM_NAME}", "library": str(library), "reason": ""}


def read_choice(folder: Path) -> dict | None:
    """The recorded BLAS decision in ``folder`` (see :func:`harness.run.envs.create_env`), or None."""
    path = Path(folder) / CHOICE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def default_threads() -> int:
    """The thread count OpenBLAS will use in this process (its variables, else every core)."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def choice_for(choice: dict | None, threads: int | None = None) -> dict:
    """The decision measured at the largest thread count not above ``threads`` (default: this process's)."""
    by_threads = (choice or {}).get("by_threads") or {}
    if not by_threads:
        return {"choice": "numpy", "ldflags": ""}
    threads = threads or default_threads()
    counts = sorted(int(k) for k in by_threads)
    below = [c for c in counts if c <= threads]
    return by_threads[str(below[-1] if below else counts[0])]


def describe(choice: dict | None) -> str:
    """One line: the choice at each measured thread count, with the probe's medians."""
    parts = []
    for threads, entry in sorted(((choice or {}).get("by_threads") or {}).items(), key=lambda kv: int(kv[0])):
        med = entry.get("median_ms")
        timing = f" (OpenBLAS {med['openblas']:.1f} ms, numpy's BLAS {med['numpy']:.1f} ms per step)" if med else ""
        parts.append(f"{threads} thread(s): {entry['choice']}{timing}")
    return "; ".join(parts) or "numpy"
