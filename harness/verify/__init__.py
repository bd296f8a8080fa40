"""The verification layer: the conformance cases and how one backend is checked against
the reference in this process (:mod:`.check`), and the one rule that judges a backend's answers,
for those cases and for a cell's own step before it is timed (:mod:`.judge`). Above ``backends/``,
below the worker (which verifies every cell through :func:`.judge.verify_step`) and the running
layer (whose :mod:`harness.run.conformance` runs these checks in isolated environments)."""
