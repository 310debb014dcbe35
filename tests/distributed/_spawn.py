"""Run a function on W local processes joined by ``torch.distributed`` and collect results.

``run_world(fn, world, tmp_path, *args)`` starts ``world`` processes
(``torch.multiprocessing.spawn``), each joining one process group through a ``file://``
rendezvous in ``tmp_path`` (gloo on the CPU; ``backend="nccl"`` puts rank r on GPU r; gloo
with ``cuda=True`` puts rank r on GPU ``r % device_count``, so more ranks than GPUs), runs
``fn(rank, world, *args)`` and saves the dict it returns; the parent loads and returns the
dicts in rank order, so comparisons happen in the test process.  ``fn`` must be a module-level
function (the children import it).  A worker's exception fails the test with its traceback;
a hang past ``timeout_s`` kills the workers and fails rather than blocking the suite.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast stays off on the GPU machines (docs/distributed.md); children inherit these.
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Set on import: the multi-GPU test files import this module before any process group exists,
# also when they run as scripts under torchrun.
for _key, _value in NCCL_SAFE_ENV.items():
    os.environ.setdefault(_key, _value)


def _entry(
    rank: int,
    world: int,
    backend: str,
    rendezvous: str,
    out_dir: str,
    fn: Callable[..., dict],
    args: tuple,
    cuda: bool,
) -> None:
    torch.set_num_threads(1)  # W processes share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    elif cuda:  # gloo with CUDA tensors: ranks share the GPUs round robin
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(
    fn: Callable[..., dict],
    world: int,
    tmp_path: Path,
    *args,
    backend: str = "gloo",
    cuda: bool = False,
    timeout_s: float = 120.0,
) -> list[dict]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]`` computed by ``world``
    processes of one process group; see the module doc."""
    for key, value in NCCL_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    run_dir = Path(tmp_path) / f"world{world}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    rendezvous = f"file://{run_dir / 'rendezvous'}"
    context = mp.spawn(
        _entry,
        args=(world, backend, rendezvous, str(run_dir), fn, args, cuda),
        nprocs=world,
        join=False,
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{world} workers did not finish within {timeout_s:.0f} s")
    return [torch.load(run_dir / f"rank{rank}.pt") for rank in range(world)]
