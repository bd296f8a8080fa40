"""The pipelines compiled: ahead of time into Python extension modules kept on disk (a later process
loads one in milliseconds), or by Halide's JIT where no C++ compiler is at hand."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from importlib.metadata import version
from pathlib import Path

from backends.halide_pipelines.elman import ElmanGraph
from harness.spec.model import Problem


def aot_dir() -> Path:
    """Where ahead-of-time compiled pipelines live, shared by every process of the harness."""
    from harness.spec.environments import cache_dir

    return cache_dir("halide")


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """One hash of this package's sources: a cached module built from other Funcs, schedules or build
    flags is never loaded."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _runtime_object(hl, folder: Path) -> Path:
    """Halide's runtime compiled once for this target, linked into every extension module."""
    target = hl.get_host_target()
    tag = hashlib.sha256(repr((version("halide"), str(target))).encode()).hexdigest()[:16]
    path = folder / f"halide_runtime_{tag}.o"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            obj = Path(tmp) / path.name
            hl.compile_standalone_runtime(str(obj), target)
            os.replace(obj, path)
    return path


def _build_extension(hl, pipeline, inputs, name: str, folder: Path) -> Path:
    """Compile ``pipeline`` ahead of time into the Python extension module ``folder/name``; returns its path."""
    cxx = shutil.which("c++") or shutil.which("g++")
    include = Path(sysconfig.get_paths()["include"])
    if cxx is None or not (include / "Python.h").exists():
        raise RuntimeError("building a Halide extension needs a C++ compiler and Python's headers")
    runtime = _runtime_object(hl, folder)
    final = folder / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        obj, src, lib = Path(tmp) / (name + ".o"), Path(tmp) / (name + ".py.cpp"), Path(tmp) / final.name
        files = {hl.OutputFileType.object: str(obj), hl.OutputFileType.python_extension: str(src)}
        pipeline.compile_to(files, inputs, name, hl.get_host_target().with_feature(hl.TargetFeature.NoRuntime))
        # the wrapper only unpacks arguments: -O1 compiles it in a third of -O2's time
        cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{include}", f"-I{Path(hl.__file__).parent / 'include'}",
               f"-DHALIDE_PYTHON_EXTENSION_MODULE_NAME={name}", str(src), str(obj), str(runtime), "-o", str(lib),
               "-lpthread", "-ldl"]
        subprocess.run(cmd, check=True, capture_output=True)
        os.replace(lib, final)  # atomic: a concurrent worker sees the whole module or none
    return final


def _load_extension(path: Path, name: str):
    """The pipeline function of a built extension module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


class Pipelines:
    """Compiled pipelines for one problem structure: inference and the training step.

    With ``aot``, each pipeline is compiled ahead of time into a Python extension module
    under :func:`aot_dir` (named by a hash of this file, the Halide version and target, the
    schedule and the problem's structure) and later processes load it in milliseconds;
    without a C++ compiler it falls back to the JIT. ``how[which]`` says which happened.
    """

    def __init__(self, hl, problem: Problem, fast: bool, threads: int, aot: bool):
        self.hl, self.problem, self.fast, self.threads, self.aot = hl, problem, fast, threads, aot
        self._compiled: dict[str, object] = {}
        self.how: dict[str, str] = {}

    def _name(self, which: str) -> str:
        p = self.problem
        parts = (_source_digest(), version("halide"), str(self.hl.get_host_target()), self.fast, self.fast and self.threads > 1,
                 which, p.model, p.input_size, p.output_size, p.tokens, p.dtype)
        return f"rnn_halide_{which}_" + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]

    def get(self, which: str):
        """The compiled ``forward`` or ``train`` pipeline, compiled (or loaded) on first use."""
        if which in self._compiled:
            return self._compiled[which]
        hl = self.hl
        name = self._name(which)
        built = aot_dir() / (name + sysconfig.get_config_var("EXT_SUFFIX"))
        if self.aot and built.exists():
            self._compiled[which], self.how[which] = _load_extension(built, name), "aot-load"
            return self._compiled[which]
        graph = ElmanGraph(hl, self.problem, which == "train", self.fast, self.threads)
        pipeline = hl.Pipeline(graph.outputs)
        if self.aot:
            try:
                path = _build_extension(hl, pipeline, graph.inputs, name, aot_dir())
                self._compiled[which], self.how[which] = _load_extension(path, name), "aot-build"
                return self._compiled[which]
            except (OSError, RuntimeError, subprocess.CalledProcessError):
                pass  # no compiler, headers or writable cache here: the JIT computes the same
        self._compiled[which] = pipeline.compile_to_callable(graph.inputs, hl.get_jit_target_from_environment())
        self.how[which] = "jit"
        return self._compiled[which]
