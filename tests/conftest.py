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
