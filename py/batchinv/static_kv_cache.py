"""A KV cache of fixed shape whose lengths live on the device: the cache a captured decode uses.

``KVCache`` keeps its lengths on the host so that eager calls never wait for the GPU; a step
captured in a CUDA graph cannot read host values that change between replays, so this cache
keeps them on the device and every step reads and advances them there.

Storage: ``k, v [layers, slots + 1, capacity, Hkv, d]`` (one allocation each) and one
``lengths [slots + 1]`` int32 device vector that all layers share (they hold the same tokens).
Slot ``slots`` is the *pad slot*: the rows a batch is padded with to reach its CUDA-graph bucket
use it, so they compute but never touch a sequence's storage.  One extra row after the storage
of every layer is the *scratch row*: writes that must not happen (a failed check) go there.

Key ``i`` of a slot sits at absolute position ``i``, as in ``KVCache``: a row attends to exactly
the keys, at the same positions and through the same kernels, that it would see in a one-shot
prefill, so its bits do not depend on the cache, the batch or the schedule.

Failure atomicity: the appends of a step are predicated on a device status word
(``DeviceStatus``): if any check of the step failed (a token id out of range, a slot past its
capacity), every write of every layer goes to the scratch row and no length advances, so the
cache is left exactly as it was.  The appends (``index_copy_``, or the fused q/k norm + RoPE
kernel of ``qk_norm_rope_attention_with_static_kv_cache``) write to the step plan's rows,
where that predicate lives.  The host reads the status at its next synchronisation and
raises (``DeviceStatus.raise_if_failed``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from .registry import BackendNotImplementedError
from .validation import (
    check_cache_settings,
    check_rms_norm_args,
    check_rope_args,
    check_same_device,
    check_tensor,
)


class DeviceStatus:
    """Failed device-side checks, as bits of one int32 word on the device.

    Captured code cannot raise: a check ORs its bit into the word instead, and later writes
    are predicated on ``ok()``.  ``raise_if_failed`` (a host sync) turns a set bit into the
    Python error of that check, naming the op and the argument.
    """

    CHECKS = {
        1: (IndexError, "embedding: an id in input_ids is outside [0, vocab_size)"),
        2: (ValueError, "attention_with_static_kv_cache: a slot would grow past the capacity"),
    }

    def __init__(self, device: torch.device | str):
        self.word = torch.zeros(1, dtype=torch.int32, device=device)

    def record(self, bit: int, failed: Tensor) -> None:
        """ORs ``bit`` into the word where the bool tensor ``failed`` has any True."""
        if bit not in self.CHECKS:
            raise ValueError(f"unknown status bit {bit}")
        self.word.bitwise_or_(failed.any().to(torch.int32) * bit)

    def ok(self) -> Tensor:
        """A bool device scalar: no check has failed."""
        return self.word[0] == 0

    def clear(self) -> None:
        self.word.zero_()

    def raise_if_failed(self) -> None:
        """Reads the word (one host sync) and raises the first failed check's error."""
        word = int(self.word.item())
        for bit, (error, message) in self.CHECKS.items():
            if word & bit:
                raise error(message)


class StaticKVCache:
    """Per-layer key/value storage for ``slots`` sequences of up to ``capacity`` tokens each,
    with device lengths; ``layers()[i]`` is the view the model's attention of layer ``i`` uses."""

    def __init__(
        self,
        num_layers: int,
        slots: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        name: str = "static_kv_cache",
    ):
        device = check_cache_settings(
            name,
            dtype,
            device,
            num_layers=num_layers,
            slots=slots,
            capacity=capacity,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        self.name = name
        self.slots = slots
        self.capacity = capacity
        rows = (slots + 1) * capacity + 1  # every slot (pad slot included), then the scratch row
        shape = (num_layers, rows, num_kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.lengths = torch.zeros(slots + 1, dtype=torch.int32, device=device)

    @property
    def pad_slot(self) -> int:
        return self.slots

    @property
    def scratch_row(self) -> int:
        return self.k.shape[1] - 1

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def layers(self) -> list[StaticKVLayer]:
        return [StaticKVLayer(self, i) for i in range(self.num_layers)]

    def advance(self, slot_ids: Tensor, counts: Tensor, status: DeviceStatus) -> None:
        """Adds ``counts[i]`` to the length of slot ``slot_ids[i]`` (device tensors; the ids
        unique apart from the pad slot, whose length never changes) if no check has failed."""
        real = slot_ids != self.pad_slot
        step = torch.where(real & status.ok(), counts.to(torch.int32), 0)
        self.lengths.index_add_(0, slot_ids, step)

    def reset(self, slot_ids: Tensor) -> None:
        """Empties the slots ``slot_ids`` (their storage keeps stale bytes, never read)."""
        self.lengths.index_fill_(0, slot_ids, 0)


class StaticKVLayer:
    """Layer ``index`` of a ``StaticKVCache``: what ``attention_with_static_kv_cache`` appends
    to and reads; ``slot_lengths`` gives the chain its positions without a host read."""

    def __init__(self, cache: StaticKVCache, index: int):
        self.cache = cache
        self.index = index
        self.k = cache.k[index]
        self.v = cache.v[index]

    def slot_lengths(self, seq_ids: Tensor) -> Tensor:
        return self.cache.lengths[seq_ids].long()


@dataclass(frozen=True)
class StepPlan:
    """What every layer of one step shares, computed once per step on the device: where the
    new keys go (``rows``, the scratch row where nothing may be written) and the attention
    layout of the new tokens against their slots.  Layers only copy and attend."""

    seq_ids: Tensor  # [n] int64, the slots
    s_new: int  # new tokens per row (columns; row i holds seqlens_new[i] of them)
    rows: Tensor  # [n * s_new] int64 storage rows of the new keys
    q_start: Tensor  # [n] int32
    q_len: Tensor  # [n] int32, seqlens_new
    k_start: Tensor  # [n] int32, each slot's first storage row
    k_len: Tensor  # [n] int32, the lengths after the append (at most the capacity)


def plan_step(
    cache: StaticKVCache, seq_ids: Tensor, seqlens_new: Tensor, s_new: int, status: DeviceStatus
) -> StepPlan:
    """The step's plan: checks that every slot has room (else the status bit is set and every
    row of the plan is the scratch row: the step writes nothing) and lays out the new tokens
    after each slot's length.  Device ops only: no host sync."""
    device = cache.device
    q_len = seqlens_new.to(torch.int32)
    start = cache.lengths[seq_ids]
    new_lengths = start + q_len
    status.record(2, new_lengths > cache.capacity)
    column = torch.arange(s_new, device=device, dtype=torch.int32)
    k_start = seq_ids.to(torch.int32) * cache.capacity
    rows = (k_start + start)[:, None] + column[None, :]
    write = (column[None, :] < q_len[:, None]) & status.ok()
    rows = torch.where(write, rows, cache.scratch_row).reshape(-1).long()
    q_start = torch.arange(0, seq_ids.numel() * s_new, s_new, device=device, dtype=torch.int32)
    # After a failed capacity check a length may pass the storage: never read there.
    k_len = new_lengths.clamp(max=cache.capacity)
    return StepPlan(seq_ids, s_new, rows, q_start, q_len, k_start, k_len)


def attention_with_static_kv_cache(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    layer: StaticKVLayer,
    plan: StepPlan,
    *,
    softmax_scale: float | None = None,
) -> Tensor:
    """Causal attention of new tokens against a ``StaticKVCache`` layer, after appending them.

    ``q [n, S, Hq, d]``, ``k_new, v_new [n, S, Hkv, d]``: row ``i`` holds ``plan.q_len[i]``
    new tokens of slot ``plan.seq_ids[i]`` at absolute positions ``length + t``; query ``t``
    sees the slot's cached keys and the new ones up to itself.  Padding columns give zeros.
    No host sync.  The slot's length is *not* advanced here (``StaticKVCache.advance`` does
    that once per step, after every layer).  The host checks (shapes, dtypes, the scale) run
    before the append, so a call that raises has written nothing.
    """
    cache = layer.cache
    _check_static_call(q, k_new, v_new, cache, plan, softmax_scale)
    n, s_new, hq, d = q.shape
    heads = cache.num_kv_heads
    scale = _kernel_scale(q, softmax_scale)  # a bad scale raises before the append
    layer.k.index_copy_(0, plan.rows, k_new.reshape(n * s_new, heads, d))
    layer.v.index_copy_(0, plan.rows, v_new.reshape(n * s_new, heads, d))
    return _attend(q, layer, plan, softmax_scale, scale)


def qk_norm_rope_attention_with_static_kv_cache(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    eps: float,
    position_ids: Tensor,
    layer: StaticKVLayer,
    plan: StepPlan,
    *,
    theta: float,
    max_position: int,
    softmax_scale: float | None = None,
) -> Tensor:
    """``attention_with_static_kv_cache`` of the heads as projected: q and k_new are first
    normed per head (``rms_norm`` with ``q_norm_weight`` / ``k_norm_weight``) and rotated
    (``rope`` at ``position_ids``, which are not checked: the decode step's positions are cache
    lengths, kept below ``max_position`` by the capacity checks).

    On CUDA the norms, the rotation and the append are one kernel (``kernels_cu/
    qk_norm_rope.cu``) with the bits of the ops it replaces: the same q, the same cache
    contents, so the same attention output.  Elsewhere (the CPU, a head_dim or dtype without a
    fused entry, a call that needs gradients) the unfused ops run.  No host sync.
    """
    cache = layer.cache
    _check_static_call(q, k_new, v_new, cache, plan, softmax_scale)
    check_rms_norm_args(q, q_norm_weight, eps)
    check_rms_norm_args(k_new, k_norm_weight, eps)
    head_dim = cache.head_dim
    check_rope_args(
        q,
        k_new,
        position_ids,
        theta=theta,
        head_dim=head_dim,
        max_position=max_position,
        check_values=False,
    )
    from .gpu import qk_norm_rope as fused

    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k_new, v_new, q_norm_weight, k_norm_weight)
    )
    if grad or not fused.supports(q):
        import batchinv

        q = batchinv.rms_norm(q, q_norm_weight, eps)
        k_new = batchinv.rms_norm(k_new, k_norm_weight, eps)
        q, k_new = batchinv.rope(
            q,
            k_new,
            position_ids,
            theta=theta,
            head_dim=head_dim,
            max_position=max_position,
            check_positions=False,
        )
        return attention_with_static_kv_cache(
            q, k_new, v_new, layer, plan, softmax_scale=softmax_scale
        )
    scale = _kernel_scale(q, softmax_scale)
    q = fused.qk_norm_rope_append(
        q,
        k_new,
        v_new,
        q_norm_weight,
        k_norm_weight,
        eps,
        position_ids,
        theta,
        max_position,
        layer.k,
        layer.v,
        plan.rows,
    )
    return _attend(q, layer, plan, softmax_scale, scale)


def _kernel_scale(q: Tensor, softmax_scale: float | None) -> float | None:
    """The attention kernels' scale (None on the CPU, whose reference takes softmax_scale)."""
    if q.device.type == "cpu":
        return None
    from .gpu import attention as gpu

    return gpu.scale_of(softmax_scale, q.shape[-1])


def _attend(
    q: Tensor, layer: StaticKVLayer, plan: StepPlan, softmax_scale: float | None, scale
) -> Tensor:
    """Attention of ``q [n, S, Hq, d]`` against the layer's storage, after the append."""
    cache = layer.cache
    n, s_new, hq, d = q.shape
    heads = cache.num_kv_heads
    if q.device.type == "cpu":
        return _reference_attend(q, layer, plan, softmax_scale)
    from .gpu import attention as gpu

    layout = gpu.Layout(plan.q_start, plan.q_len, plan.k_start, plan.k_len, s_new, cache.capacity)
    rows = layer.k.shape[0]
    out, _ = gpu.forward(
        q.reshape(n * s_new, hq, d),
        layer.k.view(rows, heads, d),
        layer.v.view(rows, heads, d),
        layout,
        True,
        scale,
        # A decode step covers every query row; only padded prefill rows need zeros first.
        prefill_zero=s_new > 1,
    )
    return out.reshape(n, s_new, hq, d)


def _check_static_call(q, k_new, v_new, cache: StaticKVCache, plan: StepPlan, softmax_scale):
    """What ``attention_with_static_kv_cache`` checks on the host before it appends: reads no
    tensor value (capture-safe); the values (slots' room, token ids) are the plan's device
    checks."""
    check_tensor("q", q, dtypes=(cache.dtype,), ndim=4)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_tensor(name, t, dtypes=(cache.dtype,), ndim=4)
    check_same_device(cache=cache.k, q=q, k_new=k_new, v_new=v_new)
    n, s_new, hq, d = q.shape
    want = (n, s_new, cache.num_kv_heads, cache.head_dim)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be {list(want)} for {cache.name}, got {tuple(t.shape)}")
    if d != cache.head_dim or hq % cache.num_kv_heads:
        raise ValueError(
            f"q must be [n, S, Hq, {cache.head_dim}] with Hq a multiple of "
            f"{cache.num_kv_heads} for {cache.name}, got {tuple(q.shape)}"
        )
    if (plan.seq_ids.numel(), plan.s_new) != (n, s_new):
        raise ValueError(
            f"q holds [{n}, {s_new}] new tokens but the step's plan is for "
            f"[{plan.seq_ids.numel()}, {plan.s_new}]"
        )
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(
                f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}"
            )
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if q.device.type != "cpu" and torch.version.hip:
        raise BackendNotImplementedError("attention_with_static_kv_cache has no HIP kernels")


def _reference_attend(q, layer, plan, softmax_scale):
    """The strict reference on the slots' storage rows (CPU: reading lengths costs nothing)."""
    from .reference.attention import attention

    cache = layer.cache
    shape = (cache.slots + 1, cache.capacity, cache.num_kv_heads, cache.head_dim)
    storage_k, storage_v = layer.k[:-1].view(shape), layer.v[:-1].view(shape)
    longest = max(1, int(plan.k_len.max()))
    ids = plan.seq_ids.long()
    return attention(
        q,
        storage_k[ids, :longest],
        storage_v[ids, :longest],
        causal=True,
        softmax_scale=softmax_scale,
        seqlens_q=torch.minimum(plan.q_len, plan.k_len).long(),
        seqlens_k=plan.k_len.long(),
    )
