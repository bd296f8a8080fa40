"""The verification layer: the conformance cases and how one backend is checked against
the reference in this process (:mod:`.check`). Above ``backends/``, below the running layer
(whose workers verify every cell before timing it, and whose :mod:`harness.run.conformance`
runs these checks in isolated environments)."""
