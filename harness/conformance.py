"""Runs :mod:`harness.check` for many backends, each in the environment it lives in."""

from __future__ import annotations

import json
import subprocess
import sys

from harness.check import CaseResult, check_backend
from harness.errors import HarnessError


def default_backends() -> list[str]:
    """Every registered backend and variant that is available here."""
    import backends

    return [r.full_name for r in backends.list_backends() if r.available]


def _check_isolated(full_name: str, environment: str, quick: bool, device: str, representative: bool = False) -> list[CaseResult]:
    from harness import envs

    python = envs.ensure_env(environment)
    cmd = [str(python), "-m", "harness.check", "--backend", full_name, "--device", device]
    if quick:
        cmd.append("--quick")
    if representative:
        cmd.append("--representative")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=envs.worker_environ(environment))
    results = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            results.append(CaseResult(**json.loads(line)))
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        results.append(CaseResult(full_name, "*", "*", "error", f"check process exited {proc.returncode}: {tail}"))
    return results


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
        cls = backends.backend_class(backends.split_name(full)[0])
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
