"""Benchmarks run only on request: ``pytest benchmarks/`` (the default test paths leave them out).

They run in this one process, whatever the project's ``addopts`` say: two xdist processes would time each
other's load, and pytest-benchmark turns itself off under xdist (``--benchmark-only`` then stops with
"Can't have both --benchmark-only and --benchmark-disable options"). So the commands of
docs/pytest-benchmark.md work as printed.
"""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # xdist read `-n 2` into these before any plugin is configured; its own configuration and
    # pytest-benchmark's run after this one (both are trylast) and then see no distribution
    if getattr(config.option, "numprocesses", None):
        config.option.numprocesses = 0
        config.option.dist = "no"
        config.option.tx = []
