"""A recording stand-in for a native kernel, for the host-path tests on the CPU."""

from __future__ import annotations

import torch


class FakeKernel:
    """A kernel that records each launch as ``(name, grid, block, args, shared_mem, stream,
    programmatic)``, its pointers as ints (the general path passes tensors, the kept paths
    their addresses)."""

    def __init__(self, name: str, launches: list):
        self.name = name
        self._launches = launches

    def __call__(
        self, grid, block, args, shared_mem=0, stream=None, device=None, programmatic=False
    ):
        args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        record = (self.name, tuple(grid), tuple(block), args, shared_mem, stream, programmatic)
        self._launches.append(record)

    def attributes(self, device_index):
        return {"max_dynamic_shared_bytes": 1 << 20, "static_shared_bytes": 0}

    def set_max_dynamic_shared_memory(self, nbytes, device=None):
        pass
