"""Benchmarks run only on request: ``pytest benchmarks/`` (the default test paths leave them out)."""
