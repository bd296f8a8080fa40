"""Shared fixtures: the test backends (tests/fake_backends.py) registered for runner and workers."""

import os
from pathlib import Path

import pytest

# setuptools swaps in its own distutils when it is imported first; if some library imports
# the standard library's distutils earlier in the same process (PyTensor's C linker, Theano),
# a later setuptools import (torch.compile's inductor) fails its own consistency assertion.
import setuptools  # noqa: E402,F401  (must come before any distutils import)

TESTS = Path(__file__).resolve().parent
FAKE = "ref=fake_backends:RefBackend,bad=fake_backends:BadBackend"


@pytest.fixture
def fake_backends(monkeypatch):
    """Register the test backends in this process and in every worker it starts."""
    monkeypatch.setenv("HARNESS_BACKENDS", FAKE)
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.fixture
def write_config(tmp_path):
    """Write a YAML config text to a file and return its path."""

    def write(text: str, name: str = "cfg.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


@pytest.fixture
def run_config(tmp_path):
    """Run a config into a folder as ``harness run`` does (harness.run.session.run_into) and load it:
    ``run_config(config, out=tmp_path / "run", peaks=None, executor=None, progress=None, name_group=None)``;
    ``config`` is a path or a loaded RunConfig, ``peaks`` GEMM peaks taken as measured (the run then times
    none), ``progress`` and ``name_group`` what ``harness run`` passes for its progress line."""
    from harness.config import load_config
    from harness.config.cells import RunConfig
    from harness.results.store import RunStore, load_run
    from harness.run.runner import new_run_meta
    from harness.run.session import run_into

    def run(config, out: Path | None = None, peaks: dict | None = None, executor=None, progress=None,
            name_group=None):
        cfg = config if isinstance(config, RunConfig) else load_config(config)
        out = tmp_path / "run" if out is None else Path(out)
        meta = new_run_meta(cfg)
        if peaks:
            meta["gemm_peak_gflops"] = dict(peaks)
        store = RunStore.create(out, meta)
        try:
            run_into(cfg, store, progress, executor, name_group=name_group)
        finally:
            store.close()
        return load_run(out)

    return run
