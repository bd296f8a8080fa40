"""The results layer: what a run leaves on disk and everything that reads it.

The columns (:mod:`.schema`), the rows made from a group's outcomes (:mod:`.rows`), the run
folder (:mod:`.store`: written atomically, loaded by ``harness.load_run``), labels, plots,
the report, ``compare``, pytest-benchmark import/export and the CPU/GPU table
(:mod:`.devices`). It imports the layers below (spec, backends, verify, config, worker, run) and
nothing above.
"""
