"""Every argument check of batchinv's ops and references, in one place.

A public op (``batchinv.<op>``) validates its arguments once, here, before it dispatches to
a backend; the references (``batchinv.reference``), which users also call directly, run the
same checks.  Every failure names the argument, says what was expected and what was given.
Checks never convert, broadcast or copy: a caller that passes the wrong thing gets an error.
Checks that read tensor values (ids, positions, sequence lengths) say so: on a GPU they cost
a device synchronisation.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

# Head dims of the attention reference: even, 2 <= d <= MAX_HEAD_DIM.
MAX_HEAD_DIM = 256
# Every integer below 2^24 is exact in fp32, so angle = position * inv_freq has one rounding
# and distinct positions stay distinct.  Callers pass the model's max_position_embeddings.
MAX_EXACT_POSITION = 1 << 24
DEFAULT_MAX_POSITION = MAX_EXACT_POSITION


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    value: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | Iterable[int] | None = None,
    contiguous: bool = False,
) -> Tensor:
    """Checks that ``value`` is a tensor with an allowed dtype and rank; returns it."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            raise TypeError(
                f"{name} must have dtype in ({_dtype_names(dtypes)}), got "
                f"{str(value.dtype).removeprefix('torch.')}"
            )
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(value.shape)}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return value


def check_same_device(**tensors: Tensor) -> torch.device:
    """Checks that all named tensors live on one device; returns it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on one device"
            )
    return first.device


def check_same_dtype(**tensors: Tensor) -> torch.dtype:
    """Checks that all named tensors share one dtype; returns it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                "mixed dtypes are not supported"
            )
    return first.dtype


def check_dim_size(name: str, t: Tensor, dim: int, expected: int, what: str) -> None:
    """Checks ``t.shape[dim] == expected``; ``what`` says where ``expected`` comes from."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({expected}), got shape {tuple(t.shape)}"
        )


def check_index_range(name: str, index: Tensor, upper: int, *, allowed: int | None = None) -> None:
    """Checks ``0 <= index < upper`` (``allowed`` is a sentinel such as ignore_index).

    Reading the tensor's values synchronises with the device; callers on the GPU do this
    check in the kernel instead and report through ``report_bad_index``.
    """
    if index.numel() == 0:
        return
    bad = (index < 0) | (index >= upper)
    if allowed is not None:
        bad &= index != allowed
    if bool(bad.any()):
        position = int(bad.reshape(-1).nonzero()[0, 0])
        report_bad_index(name, index, position, upper)


def report_bad_index(name: str, index: Tensor, flat_position: int, upper: int) -> None:
    """Raises the error for an out-of-range entry at ``flat_position`` of ``index``."""
    value = int(index.reshape(-1)[flat_position])
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_position), index.shape))
    raise IndexError(
        f"{name}[{', '.join(map(str, where))}] = {value} is outside the valid range [0, {upper})"
    )


def check_int(name: str, value: object) -> int:
    """``value`` as a Python int: an ``int`` (a numpy integer too) or a one-element tensor of
    an integer dtype; a bool, a float (even 2.0), a string or a float tensor is a TypeError
    naming ``name``.  Nothing is rounded or parsed."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_floating_point():
            raise TypeError(
                f"{name} must be an int, got a tensor of dtype "
                f"{str(value.dtype).removeprefix('torch.')} and shape {tuple(value.shape)}"
            )
        if value.is_complex():
            raise TypeError(f"{name} must be an int, got a complex tensor")
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def int_list(name: str, values: object) -> list[int]:
    """A 1-d integer tensor or a sequence of ints as a list of Python ints; a scalar, a
    string, a bool, a float or a float tensor is a TypeError naming ``name`` (or its entry)."""
    if isinstance(values, Tensor):
        check_tensor(name, values, dtypes=INDEX_DTYPES, ndim=1)
        return values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        raise TypeError(
            f"{name} must be a sequence of ints or a 1-d integer tensor, got "
            f"{type(values).__name__}"
        )
    return [check_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


# ----------------------------------------------------------------------------- linear


def check_linear_args(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> None:
    """Validates ``x [..., in]``, ``weight [out, in]`` and ``bias [out]`` (or None)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, ndim=1)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension [..., in_features], got a 0-d tensor")
    named = {"x": x, "weight": weight} | ({"bias": bias} if bias is not None else {})
    check_same_device(**named)
    check_same_dtype(**named)
    check_dim_size("x", x, -1, weight.shape[1], "weight.shape[1] (in_features)")
    if weight.shape[1] == 0:
        # Every backend rejects it (the GPU GEMM has no empty reduction): one answer everywhere.
        raise ValueError(
            f"in_features must be >= 1, got weight of shape {tuple(weight.shape)} and x of "
            f"shape {tuple(x.shape)} (an empty reduction)"
        )
    if bias is not None:
        check_dim_size("bias", bias, 0, weight.shape[0], "weight.shape[0] (out_features)")


# ----------------------------------------------------------------------------- embedding


def check_embedding_args(ids: Tensor, weight: Tensor, *, check_values: bool = True) -> None:
    """Validates ``ids`` and ``weight``; ``check_values`` reads the ids (a device sync)."""
    check_tensor("ids", ids, dtypes=INDEX_DTYPES)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    check_same_device(ids=ids, weight=weight)
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (vocabulary size 0)")
    if check_values:
        check_index_range("ids", ids, weight.shape[0])


# ----------------------------------------------------------------------------- rms_norm


_FP32_ROUNDS_TO_ZERO = 2.0**-150


def check_eps(eps: object) -> None:
    """``eps`` must be a Python number, finite, and > 0 after rounding to fp32."""
    if isinstance(eps, bool) or not isinstance(eps, int | float):
        raise TypeError(f"eps must be a Python float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    # An eps that rounds to 0 in fp32 would give 0/0 = NaN on an all-zero row: one at most
    # half the smallest fp32 subnormal (2**-149) does (the tie rounds to the even 0).
    if eps <= _FP32_ROUNDS_TO_ZERO:
        raise ValueError(f"eps must be > 0 in float32, got {eps!r} which rounds to 0")


def check_rms_norm_args(x: Tensor, weight: Tensor, eps: float) -> None:
    """Validates the arguments of ``rms_norm`` (no value is read from the tensors)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=1)
    check_same_device(x=x, weight=weight)
    check_same_dtype(x=x, weight=weight)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"x must have a non-empty last (normalised) dimension, got shape {tuple(x.shape)}"
        )
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"weight must have shape x.shape[-1:] = {tuple(x.shape[-1:])}, "
            f"got {tuple(weight.shape)}"
        )
    check_eps(eps)


def check_fused_add_rms_norm_args(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """Validates ``fused_add_rms_norm``: ``residual`` must match ``x`` exactly."""
    check_tensor("residual", residual, dtypes=FLOAT_DTYPES)
    check_rms_norm_args(x, weight, eps)
    check_same_device(x=x, residual=residual)
    check_same_dtype(x=x, residual=residual)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
        )


# ----------------------------------------------------------------------------- silu_mul


def check_silu_mul_args(gate: Tensor, up: Tensor) -> None:
    """``gate`` and ``up``: same shape ``[..., I]`` (I > 0), dtype and device."""
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    check_tensor("up", up, dtypes=FLOAT_DTYPES)
    check_same_device(gate=gate, up=up)
    check_same_dtype(gate=gate, up=up)
    if gate.dim() == 0 or gate.shape[-1] == 0:
        raise ValueError(
            f"gate must have a non-empty last dimension, got shape {tuple(gate.shape)}"
        )
    if up.shape != gate.shape:
        raise ValueError(
            f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}"
        )


def check_silu_mul_fused_args(gate_up: Tensor) -> None:
    """``gate_up: [..., 2 * I]`` with I > 0."""
    check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES)
    if gate_up.dim() == 0 or gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            "gate_up must have an even, non-empty last dimension [..., 2 * I], got shape "
            f"{tuple(gate_up.shape)}"
        )


# ----------------------------------------------------------------------------- rope


def _check_number(name: str, value: object, *, integer: bool) -> None:
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds):
        want = "int" if integer else "float"
        raise TypeError(f"{name} must be a Python {want}, got {type(value).__name__}")


def check_rope_params(head_dim: int, theta: float, max_position: int) -> None:
    """Validates the scalar parameters: even ``head_dim`` > 0, ``theta`` > 0, ``max_position``."""
    _check_number("head_dim", head_dim, integer=True)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be even and > 0 (rotate-half pairs), got {head_dim}")
    _check_number("theta", theta, integer=False)
    if not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"theta must be a finite number > 0, got {theta!r}")
    _check_number("max_position", max_position, integer=True)
    if not 1 <= max_position <= MAX_EXACT_POSITION:
        raise ValueError(
            f"max_position must be in [1, {MAX_EXACT_POSITION}] (positions must be exact in "
            f"float32), got {max_position}"
        )


def check_rope_args(
    q: Tensor,
    k: Tensor,
    position_ids: Tensor,
    *,
    theta: float,
    head_dim: int | None = None,
    max_position: int = DEFAULT_MAX_POSITION,
    check_values: bool = True,
    names: tuple[str, str] = ("q", "k"),
) -> None:
    """Validates ``rope``'s arguments; ``check_values`` reads the position ids (a device sync).

    ``names`` are the names reported for ``q`` and ``k`` (the backward passes its grads).
    """
    q_name, k_name = names
    check_tensor(q_name, q, dtypes=FLOAT_DTYPES)
    check_tensor(k_name, k, dtypes=FLOAT_DTYPES)
    check_tensor("position_ids", position_ids, dtypes=INDEX_DTYPES)
    check_same_device(**{q_name: q, k_name: k, "position_ids": position_ids})
    check_same_dtype(**{q_name: q, k_name: k})
    for name, t in ((q_name, q), (k_name, k)):
        if t.dim() < 3:
            raise ValueError(
                f"{name} must be [*tokens, heads, head_dim] with at least one token dimension, "
                f"got shape {tuple(t.shape)}"
            )
        if t.shape[-2] == 0:
            raise ValueError(f"{name} must have at least one head, got shape {tuple(t.shape)}")
    if head_dim is None:
        head_dim = q.shape[-1]
    check_rope_params(head_dim, theta, max_position)
    for name, t in ((q_name, q), (k_name, k)):
        if t.shape[-1] != head_dim:
            raise ValueError(
                f"{name}.shape[-1] must equal head_dim ({head_dim}), got shape {tuple(t.shape)}"
            )
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(
            f"{q_name} and {k_name} must have the same token dimensions, got "
            f"{q_name} {tuple(q.shape)} and {k_name} {tuple(k.shape)}"
        )
    if position_ids.shape != q.shape[:-2]:
        raise ValueError(
            f"position_ids must have shape {q_name}.shape[:-2] = {tuple(q.shape[:-2])}, "
            f"got {tuple(position_ids.shape)}"
        )
    if check_values:
        check_index_range("position_ids", position_ids, max_position)


# ---------------------------------------------------------------------- log_softmax, token_logprobs


def check_positive_int(name: str, value: object) -> int:
    """Checks that ``value`` is a Python int >= 1 (bool excluded); returns it."""
    if isinstance(value, Tensor):
        raise TypeError(f"{name} must be an int, got a tensor")
    value = check_int(name, value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_log_softmax_args(x: Tensor, dim: int, out_dtype: torch.dtype, chunk_size: int) -> None:
    """Validates ``x [..., V]``, ``dim`` (last dimension only), ``out_dtype``, ``chunk_size``."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension [..., V], got a 0-d tensor")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if dim not in (-1, x.dim() - 1):
        raise ValueError(
            f"dim must be the last dimension (-1 or {x.dim() - 1}), got dim={dim} for x of "
            f"shape {tuple(x.shape)}; move the reduced dimension last first"
        )
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, bfloat16, float16, got {out_dtype}")
    check_positive_int("chunk_size", chunk_size)
    if x.shape[-1] == 0:
        raise ValueError(
            f"x.shape[-1] must be >= 1 (an empty row has no distribution), got {tuple(x.shape)}"
        )


def check_token_logprobs_args(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    ignore_index: int,
    vocab_chunk: int,
    *,
    check_values: bool = True,
) -> None:
    """Validates the arguments; ``check_values`` reads ``target_ids`` (a device sync)."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    check_tensor("lm_head_weight", lm_head_weight, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("target_ids", target_ids, dtypes=INDEX_DTYPES)
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least 1 dimension [..., H], got a 0-d tensor")
    check_same_device(hidden=hidden, lm_head_weight=lm_head_weight, target_ids=target_ids)
    check_same_dtype(hidden=hidden, lm_head_weight=lm_head_weight)
    check_dim_size("hidden", hidden, -1, lm_head_weight.shape[1], "lm_head_weight.shape[1] (H)")
    if target_ids.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target_ids must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got "
            f"{tuple(target_ids.shape)}"
        )
    if lm_head_weight.shape[0] == 0:
        raise ValueError("lm_head_weight must have at least one row (vocabulary size 0)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_positive_int("vocab_chunk", vocab_chunk)
    if check_values:
        check_index_range("target_ids", target_ids, lm_head_weight.shape[0], allowed=ignore_index)


# ----------------------------------------------------------------------------- attention


def is_supported_head_dim(head_dim: int) -> bool:
    """Head dims of the reference: even, 2 <= d <= 256 (the kernels target 64, 128, 256)."""
    return 2 <= head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0


def _check_not_empty(name: str, cu: Tensor) -> None:
    if cu.numel() < 2:
        raise ValueError(
            f"{name} must hold at least 2 entries (one sequence), got shape {tuple(cu.shape)}"
            " (empty batch)"
        )


def _check_cu_seqlens(name: str, cu: Tensor, total: int, total_what: str) -> None:
    """Value checks of a host (CPU) ``cu_seqlens``: reading it costs no device sync."""
    _check_not_empty(name, cu)
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    steps = cu[1:] - cu[:-1]
    if bool((steps < 0).any()):
        i = int((steps < 0).nonzero()[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{i}] = {int(cu[i])} > "
            f"{name}[{i + 1}] = {int(cu[i + 1])}"
        )
    if int(cu[-1]) != total:
        raise ValueError(
            f"{name}[-1] must equal the number of packed rows of {total_what} ({total}), "
            f"got {int(cu[-1])}"
        )


def _check_seqlens(name: str, seqlens: Tensor, upper: int, upper_what: str) -> None:
    """Value checks of host (CPU) ``seqlens``: reading them costs no device sync."""
    bad = (seqlens < 0) | (seqlens > upper)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}[{i}] = {int(seqlens[i])} is outside [0, {upper}] ({upper_what})")


def _check_lengths_device(q: Tensor, **lengths: Tensor | None) -> None:
    """Length tensors live on ``q``'s device or on the CPU (host lengths cost no sync)."""
    for name, t in lengths.items():
        if t is not None and t.device != q.device and t.device.type != "cpu":
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; lengths must be on q's "
                "device or on the CPU"
            )


@dataclass(frozen=True)
class LengthValues:
    """Host (CPU) copies of a call's length tensors, as checked (None where not given).

    A CPU argument is kept as it is (not copied); a GPU argument is a fresh copy."""

    cu_seqlens_q: Tensor | None = None
    cu_seqlens_k: Tensor | None = None
    seqlens_q: Tensor | None = None
    seqlens_k: Tensor | None = None


def _to_host(**lengths: Tensor | None) -> LengthValues:
    """Every length tensor on the host, with at most one device sync: the ones on a GPU are
    concatenated (int64) and copied in a single transfer; CPU ones are used as they are."""
    on_gpu = {name: t for name, t in lengths.items() if t is not None and t.device.type != "cpu"}
    host = {name: t for name, t in lengths.items() if t is not None and t.device.type == "cpu"}
    if on_gpu:
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in on_gpu.values()]).cpu()
        sizes = [t.numel() for t in on_gpu.values()]
        host.update(zip(on_gpu, flat.split(sizes), strict=True))
    return LengthValues(**host)


def check_length_values(
    q: Tensor,
    k: Tensor,
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    seqlens_q: Tensor | None = None,
    seqlens_k: Tensor | None = None,
) -> LengthValues:
    """The value checks of ``check_attention_args`` (call it first for the other checks).

    Reads all length tensors to the host together: no device sync when they are CPU tensors,
    exactly one when any is on a GPU (whatever the number of tensors and checks).  Returns the
    host copies that were checked, so that a caller builds its layout from the very values that
    passed (``batchinv.ops.attention`` does, for ``batchinv.gpu.attention``).
    """
    values = _to_host(
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        seqlens_q=seqlens_q,
        seqlens_k=seqlens_k,
    )
    if values.cu_seqlens_q is not None:
        _check_cu_seqlens("cu_seqlens_q", values.cu_seqlens_q, q.shape[0], "q")
    if values.cu_seqlens_k is not None:
        _check_cu_seqlens("cu_seqlens_k", values.cu_seqlens_k, k.shape[0], "k")
    if values.seqlens_q is not None:
        sq = q.shape[1]
        _check_seqlens("seqlens_q", values.seqlens_q, sq, f"q's sequence length Sq={sq}")
    if values.seqlens_k is not None:
        sk = k.shape[1]
        _check_seqlens("seqlens_k", values.seqlens_k, sk, f"k's sequence length Sk={sk}")
    return values


def check_attention_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    seqlens_q: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    check_values: bool = True,
    require_contiguous: bool = False,
) -> LengthValues | None:
    """Validates an attention call; varlen when ``cu_seqlens_q/k`` are given, else padded.

    Length tensors may be on ``q``'s device or on the CPU.  ``check_values`` reads
    ``cu_seqlens``/``seqlens`` (``check_length_values``: one device sync when any is on a GPU,
    none for CPU lengths) and returns their checked host copies; without it, returns None.
    ``require_contiguous`` is for kernels that need dense inputs (the reference takes any
    strides).
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    ndim = 3 if varlen else 4
    layout = "[T, H, d] (varlen)" if varlen else "[B, S, H, d] (padded)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, contiguous=require_contiguous)
        if t.dim() != ndim:
            hint = "" if varlen else " (3-d varlen inputs need cu_seqlens_q and cu_seqlens_k)"
            raise ValueError(
                f"{name} must be {layout} with {ndim} dimensions, got shape {tuple(t.shape)}{hint}"
            )
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is not None:
        if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
            raise TypeError(
                f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}"
            )
        if not math.isfinite(float(softmax_scale)):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(
            f"q and k must have the same head dim, got d={head_dim} (q) and d={k.shape[-1]} (k)"
        )
    if not is_supported_head_dim(head_dim):
        raise ValueError(
            f"head dim d={head_dim} is not supported (supported: even d with 2 <= d <= "
            f"{MAX_HEAD_DIM})"
        )
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads Hq={hq} must be a positive multiple of the number of "
            f"kv heads Hkv={hkv}"
        )

    if varlen:
        if seqlens_q is not None or seqlens_k is not None or key_padding_mask is not None:
            raise ValueError(
                "seqlens_q/seqlens_k/key_padding_mask belong to the padded layout; varlen "
                "lengths come from cu_seqlens_q/cu_seqlens_k"
            )
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu is None:
                raise ValueError("varlen attention needs both cu_seqlens_q and cu_seqlens_k")
            check_tensor(name, cu, dtypes=INDEX_DTYPES, ndim=1)
        _check_lengths_device(q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()} entries"
            )
        if check_values:
            return check_length_values(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        _check_not_empty("cu_seqlens_q", cu_seqlens_q)
        return None

    batch, sk = q.shape[0], k.shape[1]
    if batch == 0:
        raise ValueError(f"empty batch: q has shape {tuple(q.shape)}")
    check_dim_size("k", k, 0, batch, "the batch size of q")
    for name, seqlens in (("seqlens_q", seqlens_q), ("seqlens_k", seqlens_k)):
        if seqlens is not None:
            check_tensor(name, seqlens, dtypes=INDEX_DTYPES, ndim=1)
            _check_lengths_device(q, **{name: seqlens})
            check_dim_size(name, seqlens, 0, batch, "the batch size")
    if key_padding_mask is not None:
        check_tensor("key_padding_mask", key_padding_mask, dtypes=(torch.bool,), ndim=2)
        check_same_device(q=q, key_padding_mask=key_padding_mask)
        if tuple(key_padding_mask.shape) != (batch, sk):
            raise ValueError(
                f"key_padding_mask must be [B, Sk] = [{batch}, {sk}], got "
                f"{tuple(key_padding_mask.shape)}"
            )
    if not check_values:
        return None
    return check_length_values(q, k, seqlens_q=seqlens_q, seqlens_k=seqlens_k)


def token_id_lists(name: str, values, device: torch.device) -> list[Tensor]:
    """``values`` (a non-empty list of 1-D integer tensors or lists of ints) as int64 tensors
    on ``device``; a float, a bool or an empty sequence is an error naming its place."""
    if not isinstance(values, Sequence) or isinstance(values, str | bytes) or not values:
        raise TypeError(f"{name} must be a non-empty list of token id sequences")
    result = []
    for i, seq in enumerate(values):
        if not isinstance(seq, Tensor):
            if not isinstance(seq, Sequence) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in seq
            ):
                raise TypeError(f"{name}[{i}] must be a 1-D integer tensor or a list of ints")
            for j, x in enumerate(seq):
                if not -(2**63) <= x < 2**63:
                    raise ValueError(
                        f"{name}[{i}][{j}] = {x} does not fit in int64 (not a token id)"
                    )
            seq = torch.tensor(seq, dtype=torch.int64)
        t = seq
        check_tensor(f"{name}[{i}]", t, dtypes=INDEX_DTYPES, ndim=1)
        if t.numel() == 0:
            raise ValueError(f"{name}[{i}] is empty")
        result.append(t.to(device=device, dtype=torch.int64))
    return result


def check_cache_settings(
    name: str, dtype: torch.dtype, device: torch.device | str = "cpu", **sizes: int
) -> torch.device:
    """A KV cache that can run, checked where it is created: sizes are positive ints (bool
    excluded), the dtype a float dtype, the device a CPU or CUDA device (not ``meta``), and the
    head dim one the attention on that device supports (CPU: the reference's even
    ``2 <= d <= 256``; CUDA: the kernels' head dims and dtypes).  Errors name the cache and the
    argument; returns the device."""
    for arg, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype must be float32, bfloat16 or float16, got {dtype}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{name}: device {device!r} is not a torch device ({error})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device must be a CPU or CUDA device, got {device}")
    head_dim = sizes.get("head_dim")
    if head_dim is not None and not is_supported_head_dim(head_dim):
        raise ValueError(
            f"{name}: head_dim={head_dim} is not supported by attention (supported: even d with "
            f"2 <= d <= {MAX_HEAD_DIM})"
        )
    if device.type == "cuda" and torch.version.hip is None:
        from .gpu.attention import HEAD_DIMS  # lazily: gpu imports this module

        if head_dim is not None and head_dim not in HEAD_DIMS:
            raise ValueError(
                f"{name}: head_dim={head_dim} is not supported by the CUDA attention kernels "
                f"(supported: {', '.join(map(str, HEAD_DIMS))})"
            )
        if dtype not in LOW_PRECISION_DTYPES:
            raise TypeError(
                f"{name}: the CUDA attention kernels take bfloat16 or float16, got {dtype} "
                "(float32 caches run on the CPU)"
            )
    return device


def check_seqlens_new(seqlens_new: Tensor | None, s_new: int) -> None:
    """Values of a host (CPU) ``seqlens_new``: each row holds ``0 <= n <= S_new`` new tokens."""
    if seqlens_new is not None:
        _check_seqlens("seqlens_new", seqlens_new, s_new, f"the new tokens per row S_new={s_new}")


def check_kv_cache_attention_args(
    q: object,
    k_new: object,
    v_new: object,
    cache,
    *,
    seqlens_new: Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> None:
    """Every check of ``attention_with_kv_cache`` that reads no tensor value, run before the
    cache is touched (``KVCache.append_host`` then checks the slot ids, the new lengths and
    the capacity, also before it writes).  ``q`` and ``k_new`` must agree on ``[n, S_new]``:
    every backend rejects a call where they do not."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("k_new", k_new, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("v_new", v_new, dtypes=FLOAT_DTYPES, ndim=4)
    if q.shape[:2] != k_new.shape[:2]:
        raise ValueError(
            f"q and k_new must agree on [n, S_new] (one key per new token), got q "
            f"{tuple(q.shape)} and k_new {tuple(k_new.shape)}"
        )
    check_attention_args(
        q, k_new, v_new, softmax_scale=softmax_scale, causal=causal, check_values=False
    )
    if seqlens_new is not None:
        check_tensor("seqlens_new", seqlens_new, dtypes=INDEX_DTYPES, ndim=1)
        _check_lengths_device(q, seqlens_new=seqlens_new)
        check_dim_size("seqlens_new", seqlens_new, 0, q.shape[0], "the number of rows of q")
    if q.dtype != cache.dtype:
        raise TypeError(f"q has dtype {q.dtype} but {cache.name} holds {cache.dtype}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but {cache.name} is on {cache.device}")
    if tuple(k_new.shape[2:]) != (cache.num_kv_heads, cache.head_dim):
        raise ValueError(
            f"k_new must be [n, S_new, {cache.num_kv_heads}, {cache.head_dim}] for "
            f"{cache.name}, got {tuple(k_new.shape)}"
        )
