"""Runs :mod:`harness.verify.check` for many backends, each in the environment it lives in."""

from __future__ import annotations

import sys

from harness.verify.check import CaseResult, check_backend
from harness.spec.errors import HarnessError
from harness.spec.model import DTYPES
from harness.spec.status import Status

CASE_TIMEOUT_S = 300.0  # a first Theano compile takes ~20 s; a case beyond this is stuck


def default_backends() -> list[str]:
    """Every registered backend and variant that is available here."""
    import backends

    return [r.full_name for r in backends.list_backends() if r.available]


def _report(progress, i: int, n: int, res: CaseResult, seconds: float) -> None:
    """One line per case, so a slow backend shows where it is."""
    if progress is not None and res.case != "*":
        progress.print(f"  [{i}/{n}] {res.status:<11} {res.case} [{res.dtype}] {seconds:.1f} s", highlight=False,
                       markup=False)


def _check_isolated(full_name: str, cases: list, quick: bool, device: str,
                    representative: bool = False, threads: int = 1, progress=None,
                    indices: list[int] | None = None) -> list[CaseResult]:
    """Check a backend that lives in an isolated environment through a worker there (the runner's protocol),
    one request per case: the worker gets the run's thread settings and each case a timeout."""
    from harness.worker import measure
    from harness.worker import protocol
    from harness.run.client import WorkerFailure, WorkerProcess, worker_environment
    from harness.config import DEFAULT_ENV

    # dtype None: the check runs float32 and float64 cases in one process, so no flag may pin one
    environment, env = worker_environment(full_name, device, None, threads, DEFAULT_ENV)
    worker = WorkerProcess(environment, env, f"check {full_name}")
    results: list[CaseResult] = []
    indices = list(range(len(cases))) if indices is None else indices
    try:
        for n, i in enumerate(indices, 1):
            start = measure.clock_ns()
            try:
                reply = worker.request(protocol.Check(full_name, device, quick, representative, i), CASE_TIMEOUT_S)
            except WorkerFailure as exc:
                results.append(CaseResult(full_name, cases[i].label, cases[i].dtype, Status.ERROR,
                                          f"check worker failed ({exc.status}): {exc}"))
                break
            got = [CaseResult(**r) for r in reply.body.results]
            results += got
            if any(r.case == "*" for r in got):  # the backend or device is out: nothing per case
                break
            for r in got:
                _report(progress, n, len(indices), r, measure.elapsed_s(start))
    finally:
        worker.close()
    return results


def run_conformance(names: list[str] | None, quick: bool = False, device: str = "cpu", progress=None,
                    representative: bool = False, match: str | None = None,
                    dtype: str | None = None) -> list[CaseResult]:
    """Check each ``name[:variant]`` (default: every available one); returns all case results.

    ``quick`` runs the pairwise-covering subset, ``representative`` only a handful of cases,
    ``match`` only the cases whose label contains that text, ``dtype`` only that dtype's; ``progress`` (a rich console)
    gets a line per backend and per case."""
    import setuptools  # noqa: F401  (before any distutils import; see tests/conftest.py)

    from harness.worker import measure
    from harness.verify.check import case_list

    import backends

    names = names or default_backends()
    cases = case_list(quick, representative)
    if dtype is not None and dtype not in DTYPES:
        raise HarnessError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if match is not None and not any(match in c.label for c in cases):
        raise HarnessError(f"--match: no case label contains {match!r}")
    indices = [i for i, c in enumerate(cases)
               if (match is None or match in c.label) and (dtype is None or c.dtype == dtype)]
    if not indices:
        raise HarnessError(f"--dtype: no {dtype} case among the {'--match ' + repr(match) + ' ' if match else ''}"
                           f"cases of the {'quick ' if quick else 'whole '}matrix")
    results: list[CaseResult] = []
    for full in names:
        full = backends.validate_name(full)
        try:
            environment = backends.environment_of(full)  # a pinned name's, or the class's (theano)
        except HarnessError as exc:  # known but broken here (a plugin that fails to import): a result, not a crash
            results.append(CaseResult(full, "*", "*", Status.UNAVAILABLE, str(exc)))
            continue
        if progress is not None:
            progress.print(f"checking {full} ({len(indices)} cases) ...", highlight=False, markup=False)
        # an engine of another revision loads in a worker of its own: never two builds of one module in a process
        if environment is not None or backends.ref(full).revision is not None:
            try:
                results += _check_isolated(full, cases, quick, device, representative,
                                           progress=progress, indices=indices)
            except HarnessError as exc:
                results.append(CaseResult(full, "*", "*", Status.UNAVAILABLE, str(exc)))
            continue
        picked = [cases[j] for j in indices]
        if quick and not representative:
            picked = _quick_fallback(full, device, match, dtype, progress) or picked
        start = measure.clock_ns()
        for i, res in enumerate(check_backend(full, device=device, cases=picked), 1):
            _report(progress, i, len(picked), res, measure.elapsed_s(start))
            results.append(res)
            start = measure.clock_ns()
    return results


def _quick_fallback(full: str, device: str, match: str | None, dtype: str | None, progress) -> list | None:
    """The cases ``--quick`` checks ``full`` on when it supports none of the quick subset's
    (:func:`harness.verify.check.supported_subset`), filtered as the others are; None: the quick subset."""
    from harness.verify.check import supported_subset

    subset = supported_subset(full, device)
    picked = [c for c in subset or () if (match is None or match in c.label) and (dtype is None or c.dtype == dtype)]
    if not picked:
        return None
    if progress is not None:
        progress.print(f"  {full} supports none of the quick subset's cases: checking {len(picked)} cases of the "
                       f"whole matrix it supports instead", highlight=False, markup=False)
    return picked


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `harness check`")
