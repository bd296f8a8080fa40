"""The configs: a YAML file to validated cells, before anything runs.

The schema of every key (:mod:`.schema`, pydantic), the strict YAML reader (:mod:`.strict_yaml`),
sweeps (:mod:`.sweeps`), the cells a config expands into and the memory they need (:mod:`.cells`),
and :func:`load_config`, which reads a file into a :class:`RunConfig` (:mod:`.loader`). Imports the
spec layer and the backends' registry (names, variants, devices), nothing of the worker or the runner.
"""

from harness.config.cells import Cell, RunConfig, estimate_bytes, memory_limit_mb
from harness.config.loader import config_fingerprint, load_config
from harness.config.schema import DEFAULT_ENV, RawConfig, TimingConfig, TrainConfig
from harness.config.sweeps import SWEEPABLE

__all__ = ["DEFAULT_ENV", "SWEEPABLE", "Cell", "RawConfig", "RunConfig", "TimingConfig", "TrainConfig",
           "config_fingerprint", "estimate_bytes", "load_config", "memory_limit_mb"]
