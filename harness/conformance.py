"""Runs :mod:`harness.check` for many backends, each in the environment it lives in."""

from __future__ import annotations

import sys

from harness.check import CaseResult, check_backend
from harness.errors import HarnessError

CASE_TIMEOUT_S = 300.0  # a first Theano compile takes ~20 s; a case beyond this is stuck


def default_backends() -> list[str]:
    """Every registered backend and variant that is available here."""
    import backends

    return [r.full_name for r in backends.list_backends() if r.available]


def _check_isolated(full_name: str, environment: str, quick: bool, device: str, representative: bool = False,
                    threads: int = 1) -> list[CaseResult]:
    """Check a backend that lives in an isolated environment through a worker there (the runner's protocol):
    the worker gets the run's thread settings and the check a timeout per case."""
    from harness import protocol
    from harness.check import all_cases, representative_cases
    from harness.client import WorkerFailure, WorkerProcess, worker_environment
    from harness.config import DEFAULT_ENV

    n_cases = len(representative_cases() if representative else all_cases(quick))
    # dtype None: the check runs float32 and float64 cases in one process, so no flag may pin one
    environment, env = worker_environment(full_name, device, None, threads, DEFAULT_ENV)
    worker = WorkerProcess(environment, env, f"check {full_name}")
    try:
        reply = worker.request(protocol.Check(full_name, device, quick, representative), CASE_TIMEOUT_S * max(1, n_cases))
        return [CaseResult(**r) for r in reply["results"]]
    except WorkerFailure as exc:
        return [CaseResult(full_name, "*", "*", "error", f"check worker failed ({exc.status}): {exc}")]
    finally:
        worker.close()


def run_conformance(names: list[str] | None, quick: bool = False, device: str = "cpu", progress=None,
                    representative: bool = False) -> list[CaseResult]:
    """Check each ``name[:variant]`` (default: every available one); returns all case results.

    ``quick`` runs the pairwise-covering subset, ``representative`` only a handful of cases."""
    import setuptools  # noqa: F401  (before any distutils import; see tests/conftest.py)

    from harness.check import representative_cases

    import backends

    names = names or default_backends()
    results: list[CaseResult] = []
    for full in names:
        full = backends.validate_name(full)
        try:
            cls = backends.backend_class(backends.split_name(full)[0])
        except HarnessError as exc:  # known but broken here (a plugin that fails to import): a result, not a crash
            results.append(CaseResult(full, "*", "*", "unavailable", str(exc)))
            continue
        if progress is not None:
            progress.print(f"checking {full} ...", highlight=False)
        if cls.environment is not None:
            try:
                results += _check_isolated(full, cls.environment, quick, device, representative)
            except HarnessError as exc:
                results.append(CaseResult(full, "*", "*", "unavailable", str(exc)))
            continue
        cases = representative_cases() if representative else None
        results += list(check_backend(full, quick=quick, device=device, cases=cases))
    return results


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `harness check`")
