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
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from harness.spec import environments, writes
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


#: git's own limits on a name: a ref is a file under .git/refs, so each '/'-part is a file name (NAME_MAX
#: bytes) and the whole a path (PATH_MAX); a longer text names nothing, and is refused before any subprocess
PART_MAX, REVISION_MAX = 255, 4096


def check_revision(text: str) -> str:
    """``text`` if it can name a git revision; HarnessError otherwise (no options, no ranges, nothing longer
    than git's limits). The message quotes ``text`` once, cut."""
    from harness.spec.model import short_repr

    if len(text) > REVISION_MAX or any(len(part.encode()) > PART_MAX for part in text.split("/")):
        raise HarnessError(f"expected a git revision after '{PREFIX}' (a commit, branch, tag or HEAD~1) of at most "
                           f"{PART_MAX} characters between slashes and {REVISION_MAX} in all, got {len(text)} "
                           f"characters")
    if not _REVISION.fullmatch(text) or ".." in text:
        raise HarnessError(f"expected a git revision after '{PREFIX}' (a commit, branch, tag or HEAD~1), got "
                           f"{short_repr(text)}")
    return text


def _git(args: list[str], root: Path, binary: bool = False):
    if shutil.which("git") is None:
        raise HarnessError("git is not on PATH: an engine at another revision is built from the project's git history")
    proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=not binary)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace") if binary else proc.stderr
        said = " ".join(args)
        said = said if len(said) <= 120 else f"{said[:100]}... ({len(said)} characters)"
        raise HarnessError(f"git {said}: {_last_line(err) or f'exit {proc.returncode}'}")
    return proc.stdout


def resolve(revision: str, root: Path | None = None) -> str:
    """The full commit hash ``revision`` names in the project's history; HarnessError when it names none or
    the commit has no engine (``backends/native/module.cpp``)."""
    from harness.spec.model import short_repr

    root = root or project_root()
    check_revision(revision)
    try:
        commit = _git(["rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], root).strip()
    except HarnessError as exc:
        raise HarnessError(f"{short_repr(revision)} names no commit in {root} ({exc})") from None
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


#: the code whose change retries a build that failed (a newer harness may build or load it differently)
BUILD_CODE = ("native_build.py", "native_backend.py")


def harness_digest() -> str:
    """Eight hex digits of the code that builds and loads an engine: a failure recorded by other code is retried."""
    h = hashlib.sha256()
    for name in BUILD_CODE:
        with contextlib.suppress(OSError):
            h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:8]


def _folder(commit: str) -> Path:
    """The build folder of ``commit``; HarnessError when it is a symbolic link (a build writes only into a
    folder of its own: :mod:`harness.spec.writes`)."""
    target = build_dir(commit)
    writes.check_no_links(target.parent, target)
    return target


def _marker(commit: str) -> dict | None:
    """The build's marker read as data: a mapping of this commit, None where missing or malformed."""
    try:
        path = _folder(commit) / MARKER
        writes.check_target(path)
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, HarnessError):
        return None
    return record if isinstance(record, dict) and record.get("commit") == commit else None


def failed(commit: str) -> str | None:
    """The reason a build of ``commit`` by this code failed, as recorded (None: none recorded, or recorded by
    other code: a newer harness tries again; removing the build folder does too)."""
    record = _marker(commit)
    if record is None or not isinstance(record.get("failed"), str) or record.get("harness") != harness_digest():
        return None
    return record["failed"]


def built(commit: str) -> dict | None:
    """The finished build's record (module path, facts, build time), or None where it is not built: a marker
    that is missing or malformed, records a failure, or names a module outside its own build folder (or one
    that is not a regular file there) counts as no build."""
    record = _marker(commit)
    if record is None or not isinstance(record.get("module"), str) or not isinstance(record.get("facts"), dict):
        return None
    folder = Path(os.path.realpath(_folder(commit)))
    module = Path(os.path.realpath(record["module"]))
    if folder not in module.parents or not module.is_file():
        return None
    return {**record, "module": str(module)}


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
    with writes.open_private(log, "a") as f:
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
    if failed(commit) is not None:
        raise _failure(commit, failed(commit))
    ok, why = can_build()
    if not ok:
        raise HarnessError(why)
    import nanobind

    with _lock(commit):
        record = built(commit)
        if record is not None:
            return record
        if failed(commit) is not None:
            raise _failure(commit, failed(commit))
        target = _folder(commit)
        shutil.rmtree(target, ignore_errors=True)
        writes.make_folder(target / "src", below=target.parent)
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
            with writes.open_private(log, "a") as f:
                f.write(f"$ probe {modules[0]}\n{proc.stdout}{proc.stderr}\n")
            reason = _last_line(proc.stderr) or f"exit {proc.returncode}"
            # remembered: the next run says why at once instead of building it again
            writes.write_file(target / MARKER, json.dumps({"commit": commit, "failed": reason, "harness": harness_digest(),
                                                           "key": build_key(), "log": str(log)}, indent=2), below=target)
            raise _failure(commit, reason)
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
        record = {"commit": commit, "module": str(modules[0]), "facts": facts, "key": build_key(),
                  "built_s": round(time.monotonic() - started, 1)}
        writes.write_file(target / MARKER, json.dumps(record, indent=2), below=target)
        return record


def _last_line(text: str, limit: int = 200) -> str:
    """A traceback's exception line (``TypeError: ...``; else its last line), cut to ``limit`` characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt): ", line)]
    last = raised[-1] if raised else lines[-1] if lines else ""
    return last if len(last) <= limit else last[:limit - 3] + "..."


def _failure(commit: str, reason: str) -> HarnessError:
    return HarnessError(f"the engine of {commit[:SHORT]} does not load: {reason} (remembered in "
                        f"{build_dir(commit) / MARKER}; remove that folder to try again)")


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
