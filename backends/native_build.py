"""The native engine at another git revision: ``native@rev:<commit>`` beside ``native``.

A backend name that pins ``rev:<commit>`` (``native@rev:4aee8db``, ``native@rev:HEAD``) runs the
engine's sources at that commit of the project's git history, built into a folder of its own
and loaded by its workers instead of the installed ``backends._native``: one run times two
engines side by side, in alternating rounds with paired intervals (``configs/native_ab.yaml``).
Only the engine changes: the sources are ``CMakeLists.txt`` and ``backends/native/`` of that
commit (``git archive``), built with CMake against this Python and nanobind; the wrapper
(``native_backend.py``), the harness and the BLAS are this checkout's.

A build is kept under ``HARNESS_HOME/native/<commit>-<key>``, the key naming what else goes
into the binary (Python, CPU flags, compiler, nanobind: ``-march=native`` code is this CPU's),
and counts as built once its ``build.json`` is written. Next to the module it records what the
engine of that commit can do (``facts``: cells, bidirectional layers, bfloat16), found by a probe
in a child process, so the runner can answer ``supports`` without loading a second engine
(two builds of one nanobind module cannot share a process: their types collide).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from harness.spec import environments
from harness.spec.errors import HarnessError

PREFIX = "rev:"
MARKER = "build.json"
#: what ``git archive`` takes from a commit: the engine's sources and the file that builds them
SOURCES = ("CMakeLists.txt", "backends/native")
#: a revision as a name may spell it: a commit, a branch or tag, HEAD~1, v1.0^
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/~^-]*")
#: hex digits of the commit kept in canonical names (the build folder uses all 40)
SHORT = 12


def project_root() -> Path:
    """The checkout the engine's history is read from (the folder that holds ``backends/``)."""
    return Path(__file__).resolve().parents[1]


def check_revision(text: str) -> str:
    """``text`` if it can name a git revision; HarnessError otherwise (no options, no ranges)."""
    if not _REVISION.fullmatch(text) or ".." in text:
        raise HarnessError(f"expected a git revision after '{PREFIX}' (a commit, branch, tag or HEAD~1), got {text!r}")
    return text


def _git(args: list[str], root: Path, binary: bool = False):
    if shutil.which("git") is None:
        raise HarnessError("git is not on PATH: an engine at another revision is built from the project's git history")
    proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=not binary)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace") if binary else proc.stderr
        raise HarnessError(f"git {' '.join(args)}: {err.strip() or f'exit {proc.returncode}'}")
    return proc.stdout


def resolve(revision: str, root: Path | None = None) -> str:
    """The full commit hash ``revision`` names in the project's history; HarnessError when it names none or
    the commit has no engine (``backends/native/module.cpp``)."""
    root = root or project_root()
    check_revision(revision)
    try:
        commit = _git(["rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], root).strip()
    except HarnessError as exc:
        raise HarnessError(f"{revision!r} names no commit in {root} ({exc})") from None
    try:
        _git(["cat-file", "-e", f"{commit}:backends/native/module.cpp"], root)
    except HarnessError:
        raise HarnessError(f"commit {commit[:SHORT]} ({revision}) has no native engine (backends/native/module.cpp)") from None
    return commit


def canonical(revision: str, root: Path | None = None) -> str:
    """The spelling a run records: the commit's first SHORT hex digits (``HEAD`` means what it meant then)."""
    return resolve(revision, root)[:SHORT]


def build_key() -> str:
    """What besides the commit goes into the binary: Python's version and ABI, the CPU (its flags:
    ``-march=native``), the compiler and nanobind; eight hex digits of their digest."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    compiler = ""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    try:
        import nanobind

        nb = nanobind.__version__
    except ImportError:
        nb = "none"
    text = "|".join([sys.version, platform.machine(), flags or platform.processor(), compiler, nb])
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def build_dir(commit: str) -> Path:
    """Where the engine of ``commit`` (a full hash) is built for this machine and Python."""
    return environments.home() / "native" / f"{commit}-{build_key()}"


def built(commit: str) -> dict | None:
    """The finished build's record (module path, facts, build time), or None where it is not built."""
    try:
        record = json.loads((build_dir(commit) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if Path(record.get("module", "")).is_file() else None


def extract(commit: str, dest: Path, root: Path | None = None) -> list[str]:
    """Write SOURCES of ``commit`` under ``dest`` (``git archive``); returns the files written."""
    data = _git(["archive", "--format=tar", commit, *SOURCES], root or project_root(), binary=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
        tar.extractall(dest, filter="data")
    return names


def can_build() -> tuple[bool, str]:
    """Cheaply: whether this machine has the tools a build needs (git, CMake, a C++ compiler, nanobind)."""
    missing = [tool for tool in ("git", "cmake") if shutil.which(tool) is None]
    if shutil.which("c++") is None and shutil.which("g++") is None:
        missing.append("a C++ compiler")
    try:
        import nanobind  # noqa: F401
    except ImportError:
        missing.append("nanobind (pip install nanobind)")
    if missing:
        return False, f"building the native engine at another revision needs {', '.join(missing)}"
    return True, ""


def _lock(commit: str):
    return environments.held_lock(environments.home() / "native", commit)


def _run(cmd: list[str], stage: str, log: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-4:])
        raise HarnessError(f"{stage} failed (exit {proc.returncode}; log {log}): {tail}")


def ensure(commit: str, root: Path | None = None) -> dict:
    """The build of ``commit`` (a full hash), made first if needed: CMake configure and build of its
    sources, then the probe of what it can do. Serialised by a file lock; a failed build leaves
    nothing that counts as built (the next call tries again)."""
    record = built(commit)
    if record is not None:
        return record
    ok, why = can_build()
    if not ok:
        raise HarnessError(why)
    import nanobind

    with _lock(commit):
        record = built(commit)
        if record is not None:
            return record
        target = build_dir(commit)
        shutil.rmtree(target, ignore_errors=True)
        (target / "src").mkdir(parents=True)
        log = target / "build.log"
        started = time.monotonic()
        extract(commit, target / "src", root)
        _run(["cmake", "-S", str(target / "src"), "-B", str(target / "build"), "-DCMAKE_BUILD_TYPE=Release",
              f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_DIR={nanobind.cmake_dir()}"], "cmake configure", log)
        _run(["cmake", "--build", str(target / "build"), "--parallel"], "cmake build", log)
        modules = sorted((target / "build").glob("_native*.so")) + sorted((target / "build").glob("_native*.pyd"))
        if not modules:
            raise HarnessError(f"the build of {commit[:SHORT]} made no _native module (log {log})")
        proc = subprocess.run([sys.executable, "-m", "backends.native_build", "--probe", str(modules[0])],
                              capture_output=True, text=True, cwd=str(project_root()))
        if proc.returncode != 0:
            raise HarnessError(f"the engine of {commit[:SHORT]} does not load: {proc.stderr.strip()[-400:]}")
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
        record = {"commit": commit, "module": str(modules[0]), "facts": facts, "key": build_key(),
                  "built_s": round(time.monotonic() - started, 1)}
        (target / MARKER).write_text(json.dumps(record, indent=2))
        return record


def probe(mod) -> dict:
    """What an engine module can do: the cells its Net32 accepts, bidirectional layers, its bfloat16 GEMM
    (and whether this CPU runs it), and its build_info. Tiny nets, built and dropped."""
    spec = {"kind": "elman", "hidden": 2, "layers": 1, "activation": "tanh", "bias": True, "peephole": False,
            "head": "softmax_xent", "output_act": "linear", "bptt": "full", "k": 0, "clip": 0.0,
            "input_size": 2, "output_size": 2, "tokens": False}

    def accepts(**changes) -> bool:
        s = spec | changes
        # the parameter count is the engine's to check: a wrong one is a ValueError after the spec is read
        try:
            mod.Net32(s, "default", 1, 1, [])
        except ValueError as exc:
            return "parameter arrays" in str(exc)
        return True

    kinds = [k for k in ("elman", "lstm", "gru") if accepts(kind=k)]
    # an engine that knows no bidirectional layers ignores the key: it would run a one-way network
    bidirectional = not accepts(bidirectional=True, bptt="truncated", k=1)
    bf16 = hasattr(mod, "bf16_cpu")
    return {"kinds": kinds, "bidirectional": bidirectional, "bf16_gemm": bf16,
            "bf16_cpu": bool(mod.bf16_cpu()) if bf16 else False, "build_info": dict(mod.build_info())}


def load(path: str):
    """The engine module at ``path`` (a build of another revision), under the installed module's name
    (its init function is ``PyInit__native``); not entered in ``sys.modules``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("backends._native", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--probe":
        from scipy.linalg import cython_blas

        mod = load(argv[1])
        capi = cython_blas.__pyx_capi__
        mod.init_blas(capi["sgemm"], capi["dgemm"], capi["sgemv"], capi["dgemv"])
        print(json.dumps(probe(mod)))
        return 0
    print("usage: python -m backends.native_build --probe MODULE_PATH", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
