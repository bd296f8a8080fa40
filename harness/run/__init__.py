"""The running layer: configs to cells (:mod:`.config`), the scheduler (:mod:`.runner`), the
worker processes and their protocol (:mod:`.client`, :mod:`.worker`, :mod:`.protocol`), the
timing loop and the statistics of a speedup (:mod:`.measure`, :mod:`.stats`), executors
(:mod:`.distributed`), isolated environments (:mod:`.envs`), machine facts (:mod:`.machine`,
:mod:`.gpu_roofs`) and the process-isolated conformance check (:mod:`.conformance`).

Imports the spec, backends and verification layers; never the results layer above it.
The worker side (worker, protocol, measure, stats) runs in isolated environments too, so it
needs nothing but numpy, PyYAML and its backend.
"""
