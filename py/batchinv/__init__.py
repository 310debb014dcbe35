"""batchinv: batch-invariant GPU kernels with strict fp32 references.

A row's result depends only on that row: not on the batch it sits in, its position, the
padding around it or the schedule that computed it.  ``batchinv.contract`` judges that
(bitwise) and the accuracy against strict fp32 references (``batchinv.reference``).
"""

from . import contract, nn, reference, registry
from .integrations.enable import enable
from .kv_cache import KVCache

# Importing an op module registers its torch.ops.batchinv.* custom ops.
from .ops.attention import attention, attention_varlen, attention_with_kv_cache
from .ops.embedding import embedding
from .ops.linear import linear, linear_path, set_linear_path
from .ops.linear_k_groups import (
    K_GROUPS,
    k_group_tree_finish,
    k_group_tree_sum,
    k_group_width,
    linear_k_group_partials,
    linear_k_groups,
)
from .ops.lm_head import lm_head, lm_head_fp32
from .ops.log_softmax import log_softmax
from .ops.rms_norm import fused_add_rms_norm, rms_norm
from .ops.rope import rope
from .ops.silu_mul import silu_mul, silu_mul_fused
from .ops.token_logprobs import token_logprobs

__version__ = "0.1.0"

__all__ = [
    "contract",
    "embedding",
    "enable",
    "linear",
    "nn",
    "reference",
    "registry",
    "__version__",
]
__all__ += ["KVCache", "attention", "attention_varlen", "attention_with_kv_cache"]
__all__ += ["fused_add_rms_norm", "log_softmax", "rms_norm", "rope", "silu_mul", "silu_mul_fused"]
__all__ += ["K_GROUPS", "k_group_tree_finish", "k_group_tree_sum", "k_group_width"]
__all__ += ["linear_k_group_partials"]
__all__ += ["linear_k_groups", "linear_path", "lm_head", "lm_head_fp32", "set_linear_path"]
__all__ += ["token_logprobs"]
