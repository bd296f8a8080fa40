"""The Halide backend's pipelines (:mod:`backends.halide_backend` holds the class and its variants):
``blocks`` the inputs and the scheduled building blocks (products, gradients, row reductions, the
recurrence's domain and schedule), ``elman`` the network built from them, ``aot`` their compilation
into extension modules kept on disk. Halide is passed in as ``hl``, never imported by
``import backends.halide_pipelines``.
"""
