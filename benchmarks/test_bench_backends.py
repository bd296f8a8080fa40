"""pytest-benchmark timings of every registered backend and variant, ``forward`` and ``train_step``,
on the small cells of ``benchmarks/backends.yaml``.

    pytest benchmarks/ --benchmark-only -k numpy --benchmark-json=out.json
    harness import out.json && harness report results/<the printed run>

Each cell is built exactly as a harness worker builds it (:class:`harness.worker.worker.CellState`: the
task's data, the shared initial parameters, the backend's screening), compiled and warmed up with
the backend's ``warm_up`` and the config's warm-up calls, and every timed call ends with the
backend's ``sync()``. ``extra_info`` carries the cell's result columns, so ``harness import`` turns
the JSON into a run folder. Backends unavailable here, or that cannot run a cell, are skipped with
their reason. pytest-benchmark's own options apply (``--benchmark-json``, ``--benchmark-compare``,
``--benchmark-histogram``, ``--benchmark-group-by`` ...).

Unlike ``harness run``, everything runs in this one process, one benchmark after another: thread
counts are whatever the environment sets (run with ``OMP_NUM_THREADS=1`` and friends to match the
config's ``threads``), and machine drift between benchmarks is not cancelled by interleaving.
"""

from pathlib import Path

import pytest

import backends
from backends.base import screen
from harness.worker import protocol
from harness.results import schema
from harness.config import load_config
from harness.spec.errors import HarnessError
from harness.results.pytest_benchmark import benchmark_group, benchmark_id

pytest.importorskip("pytest_benchmark")

CONFIG = Path(__file__).resolve().parent / "backends.yaml"


def _registered() -> list[str]:
    """Every registered backend and variant, available here or not (those are skipped with their reason)."""
    names = []
    for name in backends.registry():
        try:
            variants = backends.backend_class(name).variants
        except HarnessError:  # broken here: one entry, skipped with the import error
            names.append(name)
            continue
        names += [name if v == variants[0] else f"{name}:{v}" for v in variants]
    return names


CELLS = {benchmark_id(schema.cell_columns(c)): c for c in load_config(CONFIG, backends_override=_registered()).cells()}


@pytest.mark.parametrize("cell_id", list(CELLS))
def test_backend(benchmark, cell_id):
    from harness.worker.worker import CellState

    cell = CELLS[cell_id]
    p = cell.problem
    try:
        backend = backends.create(cell.backend)
        environment = type(backend).environment
    except HarnessError as exc:
        pytest.skip(str(exc))
    status, why = screen(backend, p)
    if status != "ok":
        pytest.skip(why)
    if environment is not None:
        pytest.skip(f"{cell.backend} runs in its own environment ({environment}); time it with `harness run`")

    # the thread count is this process's, from its environment (docs/pytest-benchmark.md: OMP_NUM_THREADS etc.)
    state = CellState(protocol.Init(cell.backend, p.to_mapping(), cell.task.to_mapping(), cell.seed, cell.train.lr))
    try:
        warm = state.warmup(cell.timing.warmup)  # compile / JIT (timed as compile_s), then warm-up calls
        columns = schema.cell_columns(cell)
        benchmark.group = benchmark_group(columns)
        benchmark.extra_info.update(columns, baseline=cell.baseline, compile_s=warm.compile_s)

        def call():
            state.call()
            state.backend.sync()

        benchmark(call)
        state.check_finite()  # a diverged training loop is a failure, not a timing
    finally:
        state.backend.close()
