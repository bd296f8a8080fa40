"""The NumPy reference, under the name users import it by (``harness.reference.init_params``,
``harness.reference.loss_and_grads``): it lives in the spec layer, :mod:`harness.spec.reference`."""

from harness.spec.reference import *  # noqa: F401,F403
from harness.spec.reference import __all__  # noqa: F401
