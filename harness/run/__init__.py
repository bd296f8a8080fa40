"""The running layer, the manager's side: the scheduler (:mod:`.runner`), a comparison group's
passes and interleaved rounds (:mod:`.group`), the statistics of rounds, speedups, intervals
and the stop rule, which the results read too (:mod:`.stats`), the worker processes seen from the runner
(:mod:`.client`), executors (:mod:`.distributed`), isolated environments (:mod:`.envs`), machine
facts (:mod:`.machine`), the roofs measured in workers of their own (:mod:`.roofs`) and the
process-isolated conformance check (:mod:`.conformance`).

Imports the configs, the worker side and the layers below them; never the results layer above.
"""
