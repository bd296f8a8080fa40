"""The worker side: what runs in a benchmark cell's own process, in whatever environment its
backend needs (the main one, Theano's numpy 1.23, a pinned ``jax@0.4.38``).

The protocol between runner and worker (:mod:`.protocol`), the worker that serves it
(:mod:`.worker`, started as ``python -m harness.worker``), the one clock loop (:mod:`.measure`), children that
die with their parent (:mod:`.lifeline`), the GEMM peaks a worker measures (:mod:`.cpu_roofs`,
:mod:`.gpu_roofs`) and the BLAS probe run in an environment being built (:mod:`.blas_probe`).

It imports nothing but the standard library, numpy, PyYAML and the layers below it (spec,
backends, verify): ``tests/test_layers.py`` holds it to that, lazy imports included.
"""
