"""batchinv.runtime.allow_dynamic_shared: when it raises a kernel's shared-memory limit."""

from __future__ import annotations

import pytest

from batchinv import runtime


class RecordingKernel:
    """Stands in for a native RawKernel: a limit per device that starts at CUDA's
    default, and the calls made."""

    def __init__(self, static_shared: int = 0) -> None:
        self.default = 48 * 1024 - static_shared
        self.limits: dict[int, int] = {}
        self.raised: list[tuple[int, int]] = []
        self.attribute_reads = 0

    def attributes(self, device):
        self.attribute_reads += 1
        return {"max_dynamic_shared_bytes": self.limits.get(device, self.default)}

    def set_max_dynamic_shared_memory(self, bytes_, device=None):
        self.limits[device] = bytes_
        self.raised.append((bytes_, device))


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(runtime, "_DYNAMIC_SHARED_LIMITS", {})


def test_sizes_within_the_default_limit_raise_nothing():
    kernel = RecordingKernel()
    runtime.allow_dynamic_shared(kernel, 48 * 1024, 0)
    runtime.allow_dynamic_shared(kernel, 1024, 0)
    assert kernel.raised == []
    assert kernel.attribute_reads == 1  # the limit is read once, then remembered


def test_static_shared_memory_lowers_the_default():
    kernel = RecordingKernel(static_shared=4096)
    runtime.allow_dynamic_shared(kernel, 48 * 1024 - 4096, 0)
    assert kernel.raised == []
    runtime.allow_dynamic_shared(kernel, 48 * 1024, 0)
    assert kernel.raised == [(48 * 1024, 0)]


def test_a_larger_size_later_raises_again_and_a_smaller_one_does_not():
    kernel = RecordingKernel()
    runtime.allow_dynamic_shared(kernel, 100_000, 0)
    runtime.allow_dynamic_shared(kernel, 80_000, 0)
    runtime.allow_dynamic_shared(kernel, 200_000, 0)
    runtime.allow_dynamic_shared(kernel, 200_000, 0)
    assert kernel.raised == [(100_000, 0), (200_000, 0)]


def test_each_device_has_its_own_limit():
    kernel = RecordingKernel()
    runtime.allow_dynamic_shared(kernel, 100_000, 0)
    runtime.allow_dynamic_shared(kernel, 100_000, 1)
    assert kernel.raised == [(100_000, 0), (100_000, 1)]
