"""Conformance checks for a backend's own test suite (a plugin's, or a built-in one's).

The same cases and tolerances as ``harness check`` (:mod:`harness.verify.check`), as plain functions
that raise :class:`ConformanceError` (an ``AssertionError``, so pytest shows it as a failure)::

    # tests/test_conformance.py of a package that registers the backend "mybackend"
    from harness.testing import check_backend

    def test_matches_the_reference():
        check_backend("mybackend")              # every case of the matrix, SPEC tolerances

One test per case, with the unsupported ones skipped::

    import pytest
    from harness.testing import check_case, conformance_cases

    @pytest.mark.parametrize("case", conformance_cases(quick=True), ids=str)
    def test_case(case):
        check_case("mybackend", case)
"""

from __future__ import annotations

from harness.spec.status import CASE_FAILED, Status
from harness.verify.check import Case, CaseResult, all_cases

__all__ = ["ConformanceError", "check_backend", "check_case", "conformance_cases"]



class ConformanceError(AssertionError):
    """A backend disagrees with the reference, crashed on a case, or cannot run here at all."""


def conformance_cases(quick: bool = False) -> list[Case]:
    """The cases ``harness check`` runs (``quick``: its pairwise-covering subset); ``str(case)`` is its label."""
    return [_Labelled(**{f: getattr(c, f) for f in c.__dataclass_fields__}) for c in all_cases(quick)]


class _Labelled(Case):
    """A case whose ``str`` is its label, for readable pytest ids."""

    def __str__(self) -> str:
        return f"{self.label} {self.dtype}"


def check_backend(name: str, quick: bool = False, device: str = "cpu", cases: list[Case] | None = None) -> list[CaseResult]:
    """Check ``name[:variant]`` against the reference on the conformance matrix; return every case's result.

    Raises :class:`ConformanceError` listing the failures when any case fails or errors, when the backend
    is unavailable here, or when it supports none of the cases (a check that checked nothing). Cases it
    declares ``unsupported: <why>`` are not failures. A backend that lives in an isolated environment is
    checked there (``cases`` must then be left out)."""
    import backends
    from harness.spec.errors import HarnessError

    try:
        full = backends.validate_name(name)
        isolated = backends.environment_of(full) is not None
    except HarnessError as exc:
        raise ConformanceError(str(exc)) from None
    if cases is None:
        from harness.run.conformance import run_conformance

        results = run_conformance([full], quick=quick, device=device)
    elif isolated:
        raise ConformanceError(f"{full} runs in an isolated environment: check it on the whole matrix (cases=None)")
    else:
        from harness.verify import check

        results = list(check.check_backend(full, device=device, cases=cases))
    _raise_on_failures(full, results)
    return results


def check_case(name: str, case: Case, device: str = "cpu", skip_unsupported: bool = True) -> CaseResult:
    """Check ``name[:variant]`` on one case (from :func:`conformance_cases`) in this process.

    Raises :class:`ConformanceError` on a mismatch, a crash or an unavailable backend; an unsupported
    case calls ``pytest.skip`` with the backend's reason (``skip_unsupported=False``: returns it)."""
    import backends
    from backends.base import screen_device
    from harness.verify import check
    from harness.spec.errors import HarnessError

    try:
        backend = backends.create(name)
    except HarnessError as exc:
        raise ConformanceError(str(exc)) from None
    status, why = screen_device(backend, device)
    if status != Status.OK:
        result = CaseResult(backend.full_name, case.label, case.dtype, status, why)
    else:
        result = check.run_case(backend, case, device)
    if result.status == Status.UNSUPPORTED and skip_unsupported:
        import pytest

        pytest.skip(result.reason)
    _raise_on_failures(backend.full_name, [result])
    return result


def _raise_on_failures(full: str, results: list[CaseResult]) -> None:
    bad = [r for r in results if r.status in CASE_FAILED]
    if bad:
        lines = [f"  {r.status}: {r.case} [{r.dtype}]: {r.reason or r.worst}" for r in bad[:20]]
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise ConformanceError(f"{full}: {len(bad)} of {len(results)} conformance case(s) failed\n"
                               + "\n".join(lines) + more)
    if not any(r.status == Status.PASS for r in results):
        reasons = sorted({r.reason for r in results})
        raise ConformanceError(f"{full}: no conformance case passed (every case unsupported: {'; '.join(reasons)})")
