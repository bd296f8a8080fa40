"""rnn-harness: one RNN spec, many backends, honest timings.

Importing this package is cheap: results loading (pandas) and every backend
library are imported only when used.
"""

from harness.spec.errors import HarnessError

__version__ = "0.1.0"
__all__ = ["HarnessError", "load_run", "load_runs", "__version__"]


def load_run(path):
    """Load one results folder: ``.meta`` (dict), ``.timings`` and ``.curves`` (DataFrames)."""
    from harness.results.store import load_run as _load_run

    return _load_run(path)


def load_runs(paths):
    """Load several results folders and concatenate them with a ``run_id`` column."""
    from harness.results.store import load_runs as _load_runs

    return _load_runs(paths)
