"""The configs: a YAML file to validated cells, before anything runs.

The pydantic schema of every key (:mod:`.schema`), with the cells a config expands into and the
memory they need; ``load_config`` reads a file into a :class:`RunConfig`. Imports the spec layer
and the backends' registry (names, variants, devices), nothing of the worker or the runner.
"""

from harness.config.schema import (DEFAULT_ENV, SWEEPABLE, Cell, RawConfig, RunConfig, TimingConfig, TrainConfig,
                                   estimate_bytes, load_config, memory_limit_mb)

__all__ = ["DEFAULT_ENV", "SWEEPABLE", "Cell", "RawConfig", "RunConfig", "TimingConfig", "TrainConfig",
           "estimate_bytes", "load_config", "memory_limit_mb"]
