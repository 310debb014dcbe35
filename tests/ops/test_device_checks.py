"""``batchinv.device_checks``: value checks deferred to a device word, raised at a sync."""

from __future__ import annotations

import pytest
import torch

from batchinv import device_checks


def test_a_recorded_failure_raises_once_naming_the_op():
    device_checks.record(device_checks.ROPE_POSITIONS, torch.tensor([False, True]))
    with pytest.raises(IndexError, match="rope: position_ids"):
        device_checks.raise_device_errors("cpu")
    device_checks.raise_device_errors("cpu")  # cleared: nothing left to raise


def test_passing_checks_raise_nothing():
    device_checks.record(device_checks.EMBEDDING_IDS, torch.tensor([False, False]))
    device_checks.record(device_checks.TOKEN_LOGPROBS_TARGETS, torch.zeros(0, dtype=torch.bool))
    device_checks.raise_device_errors()


def test_deferred_nests():
    assert not device_checks.deferring()
    with device_checks.deferred():
        with device_checks.deferred():
            assert device_checks.deferring()
        assert device_checks.deferring()
    assert not device_checks.deferring()


def test_unknown_bit():
    with pytest.raises(ValueError, match="unknown device check"):
        device_checks.record(1 << 40, torch.tensor([True]))


def _kernel_writes(flag: torch.Tensor, first_bad_position: int) -> None:
    # What a failing embedding or RoPE kernel leaves in a clear flag: its atomicMin of an
    # unsigned position into UINT64_MAX (-1 as int64).
    flag.copy_(torch.tensor([first_bad_position], dtype=torch.int64))


def test_a_flag_written_like_the_kernels_raises_naming_the_op_then_is_clear():
    cpu = torch.device("cpu")
    flag = device_checks.flag(device_checks.EMBEDDING_IDS, cpu)
    assert flag.tolist() == [-1]
    _kernel_writes(flag, 3)
    with pytest.raises(IndexError, match="embedding: ids .*deferred check"):
        device_checks.raise_device_errors(cpu)
    assert device_checks.flag(device_checks.EMBEDDING_IDS, cpu).tolist() == [-1]
    assert device_checks.word(cpu).tolist() == [0]
    device_checks.raise_device_errors(cpu)  # cleared: nothing left to raise


def test_flags_and_word_share_one_status_tensor_per_device():
    # raise_device_errors reads them in one sync: every flag and the word are views of it.
    cpu = torch.device("cpu")
    values = device_checks.word(cpu)._base
    assert values is not None and values.numel() == 1 + len(device_checks.FLAGGED)
    for bit in device_checks.FLAGGED:
        assert device_checks.flag(bit, cpu)._base is values
    assert device_checks.flag(device_checks.ROPE_POSITIONS, cpu) is device_checks.flag(
        device_checks.ROPE_POSITIONS, cpu
    )


def test_the_first_failed_check_in_bit_order_raises_and_everything_is_cleared():
    cpu = torch.device("cpu")
    device_checks.record(device_checks.DECODE_ATTENTION_MASK, torch.tensor([True]))
    _kernel_writes(device_checks.flag(device_checks.ROPE_POSITIONS, cpu), 0)
    with pytest.raises(IndexError, match="rope: position_ids"):
        device_checks.raise_device_errors(cpu)
    device_checks.raise_device_errors(cpu)


def test_only_flagged_checks_have_a_flag():
    with pytest.raises(ValueError, match="has no flag"):
        device_checks.flag(device_checks.DECODE_ATTENTION_MASK, torch.device("cpu"))


def test_deferred_embedding_and_rope_hand_their_kernel_the_persistent_flag(monkeypatch):
    # CPU tensors through the GPU modules' host code, each launch recorded instead of run: a
    # deferred call gives the kernel the device's flag (no fill, no check launch); an eager
    # checked call gives it a fresh flag (one fill), read at once.
    from batchinv.gpu import embedding as gpu_embedding
    from batchinv.gpu import rope as gpu_rope

    cpu = torch.device("cpu")
    passed = []  # the flag pointer each launch got
    for module in (gpu_embedding, gpu_rope):
        monkeypatch.setattr(module, "kernel_for", lambda module, name, device: name)
        monkeypatch.setattr(
            module, "launch", lambda *a, args, **k: passed.append(args[6].data_ptr())
        )
    monkeypatch.setattr(gpu_embedding, "current_raw_stream", lambda index: 0)
    monkeypatch.setattr(  # the contiguous route: pointers passed as ints
        gpu_embedding, "_forward_kernel", lambda dtype, device: lambda *a: passed.append(a[2][6])
    )
    fills = _Counting(torch.full)
    monkeypatch.setattr(torch, "full", fills)
    table, ids = torch.zeros(10, 8), torch.tensor([1, 2])
    strided_ids = torch.tensor([[1, 0], [2, 0]])[:, 0]
    q, k, positions = torch.zeros(2, 2, 4), torch.zeros(2, 1, 4), torch.tensor([0, 1])
    with device_checks.deferred():
        gpu_embedding.forward(ids, table)
        gpu_embedding.forward(strided_ids, table)  # launch_forward, the general route
        gpu_rope.forward(q, k, positions, 1e4, 8, True)
    embedding_flag = device_checks.flag(device_checks.EMBEDDING_IDS, cpu).data_ptr()
    rope_flag = device_checks.flag(device_checks.ROPE_POSITIONS, cpu).data_ptr()
    assert passed == [embedding_flag, embedding_flag, rope_flag]
    assert fills.calls == 0
    gpu_embedding.forward(ids, table)  # eager: a fresh flag, read at once (-1: nothing ran)
    gpu_rope.forward(q, k, positions, 1e4, 8, True)
    assert fills.calls == 2
    assert passed[3] not in (embedding_flag, rope_flag) and passed[4] != rope_flag
    device_checks.raise_device_errors(cpu)


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)
