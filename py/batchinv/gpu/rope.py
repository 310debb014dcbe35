"""Rotary position embedding on CUDA/HIP: launches ``kernels_cu/rope.cu``.

``inv_freq`` is computed on the host by the reference's ``rope_inv_freq`` (HF's fp32
formula) and cached on the device, so both backends rotate by the same frequencies; the
angle ``position * inv_freq`` and its cos/sin are computed in the kernel per token.

Out-of-range position ids are found by the kernel itself (it never computes their angles,
fills those tokens' outputs with NaN and records the first bad token), so a bad id becomes a
Python IndexError.  Reading that flag synchronises with the device once per call;
``check_positions=False`` skips the read (bad tokens then come back as NaN), and under
CUDA-graph capture or ``device_checks.deferred()`` the kernel writes the device's persistent
flag, read by ``device_checks.raise_device_errors()``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import device_checks
from ..reference.rope import rope_inv_freq
from ..runtime import current_raw_stream, kernel_for, launch
from ..validation import report_bad_index

THREADS = 128  # kThreads in kernels_cu/rope.cu
_MAX_GRID_X = 2**31 - 1
_MAX_SHARED_BYTES = 48 * 1024  # the cos/sin table of one token, without opting in
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_INDEX_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}


@functools.cache
def inv_freq_on(device: torch.device, head_dim: int, theta: float) -> Tensor:
    """The reference's fp32 ``inv_freq`` copied to ``device`` once."""
    return rope_inv_freq(head_dim, theta).to(device)


def _heads_view(t: Tensor, tokens: int) -> Tensor:
    """``[tokens, heads, head_dim]`` with unit stride along head_dim (a copy only if needed)."""
    view = t.reshape(tokens, t.shape[-2], t.shape[-1])
    if view.shape[-1] > 1 and view.stride(-1) != 1:
        view = view.contiguous()
    return view


def launch_rotation(
    q: Tensor,
    k: Tensor,
    position_ids: Tensor,
    theta: float,
    max_position: int,
    inverse: bool,
    *,
    want_flag: bool = True,
    flag: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launches the rotation (``inverse``: its transpose, the backward); returns
    ``(q_out, k_out, first_bad [1] int64)`` without reading the flag (no synchronisation).
    The kernel writes ``flag`` if given (a deferred check's persistent flag), else a fresh
    one; ``want_flag=False`` passes a shared scratch flag instead (one fill kernel less),
    whose value is then meaningless."""
    head_dim = q.shape[-1]
    tokens = position_ids.numel()
    q3, k3 = _heads_view(q, tokens), _heads_view(k, tokens)
    q_out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k3.shape, dtype=k.dtype, device=k.device)
    if flag is not None:
        first_bad = flag
    elif want_flag:
        first_bad = torch.full((1,), -1, dtype=torch.int64, device=q.device)  # UINT64_MAX
    else:
        first_bad = device_checks.unread_flag(q.device)
    if tokens > 0:
        if tokens > _MAX_GRID_X:
            raise ValueError(
                f"position_ids has {tokens} tokens; at most {_MAX_GRID_X} are supported"
            )
        shared = 2 * (head_dim // 2) * 4
        if shared > _MAX_SHARED_BYTES:
            raise ValueError(
                f"head_dim must be at most {_MAX_SHARED_BYTES // 4} on the GPU, got {head_dim}"
            )
        positions = position_ids.reshape(-1).contiguous()
        name = f"rope_{_SUFFIX[q.dtype]}_{_INDEX_SUFFIX[positions.dtype]}"
        launch(
            kernel_for("rope", name, q.device),
            q.device,
            grid=(tokens,),
            block=(THREADS,),
            args=(
                q_out,
                k_out,
                q3,
                k3,
                positions,
                inv_freq_on(q.device, head_dim, float(theta)),
                first_bad,
                tokens,
                q3.shape[1],
                k3.shape[1],
                head_dim,
                q3.stride(0),
                q3.stride(1),
                k3.stride(0),
                k3.stride(1),
                max_position,
                1 if inverse else 0,
            ),
            shared_mem=shared,
        )
    return q_out.reshape(q.shape), k_out.reshape(k.shape), first_bad


def forward(
    q: Tensor,
    k: Tensor,
    position_ids: Tensor,
    theta: float,
    max_position: int,
    check_positions: bool,
) -> tuple[Tensor, Tensor]:
    """``(q_rot, k_rot)``, new tensors; with ``check_positions``, IndexError for a position
    outside [0, max_position) (the op validated everything else)."""
    # Under CUDA-graph capture or device_checks.deferred() (no sync allowed), the kernel writes
    # the device's persistent flag, which accumulates over calls: no launch added.
    deferred = check_positions and device_checks.deferring(q.device)
    flag = device_checks.flag(device_checks.ROPE_POSITIONS, q.device) if deferred else None
    q_rot, k_rot, first_bad = launch_rotation(
        q,
        k,
        position_ids,
        theta,
        max_position,
        inverse=False,
        want_flag=check_positions,
        flag=flag,
    )
    if check_positions and not deferred and position_ids.numel() > 0:
        token = int(first_bad.item())  # the one synchronisation: a bad position must raise here
        if token != -1:
            report_bad_index("position_ids", position_ids, token, max_position)
    return q_rot, k_rot


@functools.cache
def _rotation_kernel(
    dtype: torch.dtype, index_dtype: torch.dtype, head_dim: int, device: torch.device
) -> tuple:
    """``(kernel, shared bytes)`` of a rotation of ``head_dim``-wide heads (``launch_rotation``'s
    choice, looked up once)."""
    shared = 2 * (head_dim // 2) * 4
    if shared > _MAX_SHARED_BYTES:
        raise ValueError(
            f"head_dim must be at most {_MAX_SHARED_BYTES // 4} on the GPU, got {head_dim}"
        )
    name = f"rope_{_SUFFIX[dtype]}_{_INDEX_SUFFIX[index_dtype]}"
    return kernel_for("rope", name, device), shared


def backward(
    grad_q_rot: Tensor, grad_k_rot: Tensor, position_ids: Tensor, theta: float, max_position: int
) -> tuple[Tensor, Tensor]:
    """``(grad_q, grad_k)``: the inverse rotation (positions were checked by the forward).

    Contiguous gradients and positions (what a trainer's backward hands over) take one native
    call with pointers as ints and the gradients allocated in their final shape, the same
    kernel and arguments as ``launch_rotation``, hence the same bits; other layouts take
    ``launch_rotation``."""
    if not (
        grad_q_rot.is_contiguous() and grad_k_rot.is_contiguous() and position_ids.is_contiguous()
    ):
        grad_q, grad_k, _ = launch_rotation(
            grad_q_rot, grad_k_rot, position_ids, theta, max_position, inverse=True, want_flag=False
        )
        return grad_q, grad_k
    grad_q = torch.empty_like(grad_q_rot)
    grad_k = torch.empty_like(grad_k_rot)
    tokens = position_ids.numel()
    if tokens == 0:
        return grad_q, grad_k
    if tokens > _MAX_GRID_X:
        raise ValueError(f"position_ids has {tokens} tokens; at most {_MAX_GRID_X} are supported")
    device = grad_q_rot.device
    head_dim = grad_q_rot.shape[-1]
    q_heads, k_heads = grad_q_rot.shape[-2], grad_k_rot.shape[-2]
    kernel, shared = _rotation_kernel(grad_q_rot.dtype, position_ids.dtype, head_dim, device)
    index = device.index
    kernel(
        (tokens,),
        (THREADS,),
        (
            grad_q.data_ptr(),
            grad_k.data_ptr(),
            grad_q_rot.data_ptr(),
            grad_k_rot.data_ptr(),
            position_ids.data_ptr(),
            inv_freq_on(device, head_dim, float(theta)).data_ptr(),
            device_checks.unread_flag(device).data_ptr(),
            tokens,
            q_heads,
            k_heads,
            head_dim,
            q_heads * head_dim,  # contiguous [tokens, heads, head_dim]: the strides
            head_dim,
            k_heads * head_dim,
            head_dim,
            max_position,
            1,  # inverse: the backward
        ),
        shared,
        current_raw_stream(index),
        index,
        False,
    )
    return grad_q, grad_k
