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
