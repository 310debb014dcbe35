"""Hugging Face transformers: a ``"batchinv"`` attention implementation and a one-call patch
for Qwen3 models (the convention of Liger-Kernel's ``apply_liger_kernel_to_qwen3``).

transformers is optional: it is imported inside the functions, and a missing install is an
``ImportError`` saying so.

``register_attention()`` registers ``batchinv_attention_forward`` with
``transformers.AttentionInterface`` under ``"batchinv"`` and HF's SDPA mask builder with
``AttentionMaskInterface`` under the same name (without a mask builder HF would pass no mask
and padding would be lost).  Load a model with ``attn_implementation="batchinv"`` afterwards,
or let ``apply_batchinv_to_qwen3`` set it.  The mask is read back into lengths by
``batchinv.integrations.attention_masks``: padding (left or right), causal, decode and chunked
prefill against a cache are routed exactly; dropout > 0, sliding windows, soft-capping and
other masks raise.

``apply_batchinv_to_qwen3(model)`` patches one loaded ``Qwen3ForCausalLM`` / ``Qwen3Model``;
``apply_batchinv_to_qwen3()`` patches the transformers Qwen3 classes, so models built
afterwards (``from_pretrained`` included) use batchinv.  It returns a function that undoes
the patch.  What each flag swaps:

- ``rms_norm``: ``Qwen3RMSNorm.forward`` -> ``batchinv.rms_norm`` (hidden, q and k norms).  HF
  rounds ``x * rsqrt`` to the input dtype before the weight; batchinv rounds once (see
  ``batchinv.reference.rms_norm``).  The weight must have the activations' dtype;
- ``rope``: ``Qwen3Attention.forward`` applies ``batchinv.rope`` from ``position_ids``
  (default rope type only) instead of HF's cos/sin tables;
- ``mlp``: ``Qwen3MLP.forward`` -> ``down(batchinv.silu_mul(gate(x), up(x)))`` (``silu`` only);
- ``linear``: every ``nn.Linear`` (q/k/v/o, gate/up/down, lm_head) -> ``batchinv.nn.Linear``
  sharing the same parameters (tied embeddings stay tied);
- ``attention``: ``config._attn_implementation = "batchinv"``.

The embedding stays ``nn.Embedding`` (a gather is bitwise the same in any batch).

``static_cache(model, max_cache_len)`` is a transformers ``StaticCache`` whose layers keep
their keys and values token-major (``[B, L, H, d]`` storage, seen by HF as ``[B, H, L, d]``
views), the layout batchinv's attention reads in place.  Pass it as ``past_key_values`` to
``generate``: decode steps then run with no host sync and no copy of the cache, so
transformers' ``torch.compile`` of the decode step (CUDA graphs) captures them.  HF's own
static cache (``cache_implementation="static"``) works too, at the cost of copying each
layer's cache per step.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import nn as batchinv_nn
from ..ops.rms_norm import rms_norm as batchinv_rms_norm
from ..ops.rope import rope as batchinv_rope
from ..ops.silu_mul import silu_mul
from ..validation import check_positive_int
from .attention_masks import attention_with_mask

ATTENTION_NAME = "batchinv"

__all__ = [
    "ATTENTION_NAME",
    "apply_batchinv_to_qwen3",
    "batchinv_attention_forward",
    "register_attention",
    "static_cache",
]


def _import_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "batchinv.integrations.transformers needs Hugging Face transformers "
            "(pip install transformers)"
        ) from err
    return transformers


# ----------------------------------------------------------------------------- attention


def batchinv_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """HF attention interface: ``query [B, Hq, Sq, d]``, ``key/value [B, Hkv, Sk, d]`` ->
    ``([B, Sq, Hq, d], None)``.  GQA is native (no ``repeat_kv``)."""
    if dropout:
        raise ValueError(
            f"batchinv attention has no dropout, got dropout={dropout} (module.training="
            f"{module.training}); set attention_dropout=0 or call model.eval()"
        )
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(f"batchinv attention does not support {name}={kwargs[name]!r}")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    # With no mask HF means: queries are the last tokens, causal unless the module is not.
    causal = bool(is_causal) and attention_mask is None
    out = attention_with_mask(q, k, v, attention_mask, causal=causal, softmax_scale=scaling)
    return out, None


def register_attention() -> None:
    """Registers ``"batchinv"`` with transformers' attention and attention-mask interfaces."""
    transformers = _import_transformers()
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    transformers.AttentionInterface.register(ATTENTION_NAME, batchinv_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# ----------------------------------------------------------------------------- static cache


def static_cache(model: nn.Module, max_cache_len: int):
    """A transformers ``StaticCache`` for ``model`` holding ``max_cache_len`` tokens per row,
    its keys and values stored token-major (module docstring)."""
    transformers = _import_transformers()
    max_cache_len = check_positive_int("max_cache_len", max_cache_len)
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "lazy_initialization") for layer in layers):
        raise TypeError(
            f"transformers {transformers.__version__}: StaticCache has no per-layer lazy "
            "initialization; batchinv.integrations.transformers.static_cache needs one"
        )
    for layer in layers:
        _store_token_major(layer)
    return cache


def _store_token_major(layer) -> None:
    """After HF allocates a layer's ``keys``/``values [B, H, L, d]``, replace them with
    transposed views of ``[B, L, H, d]`` storage (same shape, dtype, device, zeros)."""
    allocate = layer.lazy_initialization

    def lazy_initialization(*args, **kwargs):
        allocate(*args, **kwargs)
        for name in ("keys", "values"):
            head_major = getattr(layer, name)
            b, h, length, d = head_major.shape
            storage = head_major.new_zeros((b, length, h, d))
            setattr(layer, name, storage.transpose(1, 2))
            if not torch.compiler.is_compiling():  # as HF does: fixed addresses for CUDA graphs
                torch._dynamo.mark_static_address(getattr(layer, name))

    layer.lazy_initialization = lazy_initialization


# ----------------------------------------------------------------------------- forwards


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    return batchinv_rms_norm(hidden_states, self.weight, float(self.variance_epsilon))


def _mlp_forward(self, x: Tensor) -> Tensor:
    if self.config.hidden_act != "silu":
        raise ValueError(
            f"batchinv's MLP is SwiGLU (silu), got hidden_act={self.config.hidden_act!r}"
        )
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"batchinv.rope implements the default RoPE, got rope_type={rope_type!r}")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _attention_forward(
    self,
    hidden_states: Tensor,
    position_embeddings=None,
    attention_mask: Tensor | None = None,
    cache=None,
    past_key_values=None,
    **kwargs,
):
    """``Qwen3Attention.forward`` with ``batchinv.rope`` on ``position_ids`` (HF's cos/sin
    tables are not used); the rest is HF's code path.  It imports nothing and reads no config
    (``_patch_instance`` resolved both): an import inside a ``torch.compile``d forward is a
    graph break, which splits the decode step into pieces and one recompile per layer."""
    modeling = _QWEN3_MODELING
    cache = cache if cache is not None else past_key_values
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("batchinv's RoPE needs position_ids (Qwen3Model passes them)")
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
    k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))
    v = self.v_proj(hidden_states).view(hidden_shape)
    positions = position_ids.expand(*input_shape).contiguous()
    theta = self._batchinv_rope_theta
    q, k = batchinv_rope(q, k, positions, theta=theta, head_dim=self.head_dim)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling.eager_attention_forward
    )
    out, weights = interface(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=self.sliding_window,
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


# ----------------------------------------------------------------------------- patching


# transformers' Qwen3 modeling module, for the patched attention forward (set when patching).
_QWEN3_MODELING = None


def _patch_instance(model: nn.Module, flags: dict[str, bool], undo: list[Callable]) -> None:
    global _QWEN3_MODELING
    modeling = _QWEN3_MODELING = _import_transformers().models.qwen3.modeling_qwen3
    forwards = {
        modeling.Qwen3RMSNorm: (flags["rms_norm"], _rms_norm_forward),
        modeling.Qwen3MLP: (flags["mlp"], _mlp_forward),
        modeling.Qwen3Attention: (flags["rope"], _attention_forward),
    }
    for module in model.modules():
        enabled, forward = forwards.get(type(module), (False, None))
        if enabled and "forward" not in module.__dict__:
            if forward is _attention_forward:
                # An unsupported RoPE is refused now, not mid-forward.
                module._batchinv_rope_theta = _rope_theta(module.config)
                undo.append(lambda m=module: m.__dict__.pop("_batchinv_rope_theta", None))
            module.forward = types.MethodType(forward, module)
            undo.append(lambda m=module: m.__dict__.pop("forward", None))
    if flags["linear"]:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, batchinv_nn.Linear.from_linear(child))
                    undo.append(lambda p=parent, n=name, c=child: setattr(p, n, c))
    if flags["attention"]:
        register_attention()
        config = model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        undo.append(lambda: setattr(config, "_attn_implementation", previous))


def apply_batchinv_to_qwen3(
    model: nn.Module | None = None,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    mlp: bool = True,
    linear: bool = True,
    attention: bool = True,
) -> Callable[[], None]:
    """Makes a transformers Qwen3 model use batchinv's ops (module docstring); returns undo.

    ``model``: a loaded ``Qwen3ForCausalLM`` or ``Qwen3Model`` (patched in place), or None to
    patch the transformers Qwen3 classes for every model built afterwards.
    """
    transformers = _import_transformers()
    modeling = transformers.models.qwen3.modeling_qwen3
    flags = dict(rms_norm=rms_norm, rope=rope, mlp=mlp, linear=linear, attention=attention)
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    undo: list[Callable] = []

    def revert() -> None:
        while undo:
            undo.pop()()

    if model is not None:
        if not isinstance(model, modeling.Qwen3PreTrainedModel):
            raise TypeError(f"model must be a transformers Qwen3 model, got {type(model).__name__}")
        _patch_instance(model, flags, undo)
        return revert

    for cls in (modeling.Qwen3Model, modeling.Qwen3ForCausalLM):
        original_init = cls.__dict__["__init__"]

        def patched_init(self, *args, _original=original_init, **kwargs):
            _original(self, *args, **kwargs)
            _patch_instance(self, flags, [])  # the class patch has its own undo

        cls.__init__ = patched_init
        undo.append(lambda c=cls, f=original_init: setattr(c, "__init__", f))
    return revert
