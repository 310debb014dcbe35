"""batchinv: batch-invariant GPU kernels with strict fp32 references.

A row's result depends only on that row: not on the batch it sits in, its position, the
padding around it or the schedule that computed it.  ``batchinv.contract`` judges that
(bitwise) and the accuracy against strict fp32 references (``batchinv.reference``).
"""

from . import contract, nn, reference, registry
from .ops.embedding import embedding
from .ops.linear import linear

__version__ = "0.1.0"

__all__ = ["contract", "embedding", "linear", "nn", "reference", "registry", "__version__"]
