"""The spec layer: what a network, a problem and a correct answer are.

The bottom of the house and the only part of ``harness`` that ``backends/`` imports:
the model and problem types (:mod:`.model`), the NumPy reference maths (:mod:`.reference`),
the tasks' data (:mod:`.data`), the conformance tolerances (:mod:`.tolerance`), the one
exception type (:mod:`.errors`), the folders the harness keeps environments and caches
in (:mod:`.environments`) and the one rule for every file it writes (:mod:`.writes`). It imports nothing above it. The model types are importable from
here too (``from harness.spec import ModelSpec, Problem``).
"""

from harness.spec.model import *  # noqa: F401,F403  (the layer's public types)
