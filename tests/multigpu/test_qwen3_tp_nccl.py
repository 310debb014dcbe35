"""Qwen3 at TP = 2, 4, 8 on NCCL with the CUDA kernels equals one GPU running
``tp_compatible_ops``, bit for bit.

A Qwen3 with Qwen3-8B layer shapes (hidden 4096, 32 q / 8 kv heads of 128, intermediate
12288, vocab 151936), 2 layers, random bf16 weights.  Per world size one spawn (each NCCL size
skipped, with its reason, when fewer GPUs are present; 4 and 8 ranks also run over gloo,
sharing the GPUs present, the bytes through host memory); rank 0 also runs the single-GPU model
on its own GPU and the parent compares every rank with it:
- prefill: packed token logprobs (``Qwen3.token_logprobs``);
- decode: a padded prefill of 3 prompts into KV caches, then 4 greedy steps at batch 3 (each
  step's last-position logits and the picked tokens);
- recorded, not asserted: the stock TP model (``stock_tensor_parallel_qwen3``: ``F.linear``
  of the K shard + NCCL's bf16 ``all_reduce``, column-parallel logits gathered, the
  ``STOCK_OPS`` table otherwise) against the stock single GPU.

Run with pytest (``pytest tests/multigpu/test_qwen3_tp_nccl.py``), or as a script:
``python tests/multigpu/test_qwen3_tp_nccl.py --world 2`` (its own spawn) or
``torchrun --nproc-per-node 2 tests/multigpu/test_qwen3_tp_nccl.py`` (each rank checks itself
against its own GPU's single-GPU results).  NVLink multicast stays off
(``_spawn`` sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` on import).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
from _spawn import run_world  # noqa: E402

from batchinv.contract import assert_bitwise_equal  # noqa: E402
from batchinv.distributed.qwen3 import (  # noqa: E402
    stock_tensor_parallel_qwen3,
    tensor_parallel_qwen3,
    tp_compatible_qwen3,
)
from batchinv.models.qwen3 import Qwen3, Qwen3Config  # noqa: E402
from batchinv.models.qwen3.ops import STOCK_OPS  # noqa: E402
from batchinv.reference.qwen3_chain import qwen3_state_dict_shapes  # noqa: E402
from batchinv.shapes import QWEN3_8B_CONFIG  # noqa: E402

pytestmark = pytest.mark.cuda

WORLD_SIZES = (2, 4, 8)
SHARED_WORLD_SIZES = (4, 8)  # gloo, ranks sharing the GPUs present
CONFIG = Qwen3Config(**QWEN3_8B_CONFIG, num_hidden_layers=2)
DTYPE = torch.bfloat16
SEQUENCES = ((70, 10), (33, 5), (130, 64))  # (length, prompt length), packed for logprobs
PROMPTS = (5, 17, 9)  # decode prompt lengths, batch 3
DECODE_STEPS = 4


def _weights() -> dict[str, torch.Tensor]:
    """Random weights, the same bits on every rank (a CUDA generator from a fixed seed;
    scaled as ``random_state_dict``: N(0, 1/fan_in) matrices, norms 1 + 0.3 N(0, 1))."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for name, shape in qwen3_state_dict_shapes(CONFIG).items():
        values = torch.randn(shape, generator=generator, device="cuda")
        if len(shape) == 1:
            values = 1.0 + 0.3 * values
        elif name != "model.embed_tokens.weight":
            values /= math.sqrt(shape[1])
        weights[name] = values.to(DTYPE)
    return weights


def _token_data() -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    sequences = [
        torch.randint(0, CONFIG.vocab_size, (n,), generator=generator) for n, _ in SEQUENCES
    ]
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=generator) for n in PROMPTS]
    return sequences, [p for _, p in SEQUENCES], prompts


@torch.no_grad()
def _run(model: Qwen3) -> dict:
    """Packed token logprobs, and a decode of ``DECODE_STEPS`` greedy steps (on the CPU)."""
    sequences, prompt_lens, prompts = _token_data()
    out = {"logprobs": [t.cpu() for t in model.token_logprobs(sequences, prompt_lens)]}
    batch, width = len(prompts), max(PROMPTS)
    ids = torch.zeros(batch, width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : p.numel()] = p
    ids, seqlens = ids.cuda(), torch.tensor(PROMPTS, device="cuda")
    caches = model.new_caches(batch, width + DECODE_STEPS + 1)
    rows = torch.arange(batch, device="cuda")
    last = model(ids, seqlens=seqlens, caches=caches)[rows, seqlens - 1]
    steps, tokens = [last], []
    for _ in range(DECODE_STEPS):
        token = last.float().argmax(dim=-1)
        tokens.append(token)
        last = model(token[:, None], caches=caches)[:, 0]
        steps.append(last)
    out["decode_logits"] = torch.stack(steps).cpu()
    out["decode_tokens"] = torch.stack(tokens).cpu()
    torch.cuda.synchronize()
    return out


def _rank_checks(rank: int, world: int, every_rank_single: bool = False) -> dict:
    whole = Qwen3(CONFIG, _weights())
    out = {"tp": _run(tensor_parallel_qwen3(whole))}
    out["stock_tp"] = _run(stock_tensor_parallel_qwen3(whole))
    if every_rank_single or rank == 0:
        out["one"] = _run(tp_compatible_qwen3(whole))
        out["stock_one"] = _run(Qwen3(CONFIG, whole.hf_state_dict(), ops=STOCK_OPS))
    return out


def _assert_equal_one(result: dict, one: dict, label: str) -> None:
    for i, (got, expected) in enumerate(zip(result["logprobs"], one["logprobs"], strict=True)):
        assert_bitwise_equal(got, expected, name=f"{label} token logprobs of sequence {i}")
    assert_bitwise_equal(result["decode_logits"], one["decode_logits"], name=f"{label} decode")
    assert torch.equal(result["decode_tokens"], one["decode_tokens"]), label


def _stock_report(result: dict, one: dict, world: int) -> str:
    got, expected = torch.cat(result["logprobs"]), torch.cat(one["logprobs"])
    diff = float((got - expected).abs().max())
    return (
        f"stock TP={world} token logprobs: bitwise one GPU = {torch.equal(got, expected)}, "
        f"max |diff| = {diff:.4g}; decode logits bitwise = "
        f"{torch.equal(result['decode_logits'], one['decode_logits'])}"
    )


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_qwen3_tp_equals_one_gpu(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} present")
    results = run_world(_rank_checks, world, tmp_path, backend="nccl", timeout_s=600)
    one = results[0]
    for rank, result in enumerate(results):
        _assert_equal_one(result["tp"], one["one"], f"TP={world} rank {rank}")
    print(_stock_report(one["stock_tp"], one["stock_one"], world))  # recorded, not asserted


@pytest.mark.parametrize("world", SHARED_WORLD_SIZES)
def test_qwen3_tp_with_ranks_sharing_gpus_equals_one_gpu(world, tmp_path):
    """More ranks than GPUs: gloo moves the bytes (through host memory) and the ranks share
    the GPUs round robin; every rank's arithmetic is the NCCL run's, on its shard."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    results = run_world(_rank_checks, world, tmp_path, backend="gloo", cuda=True, timeout_s=600)
    one = results[0]
    for rank, result in enumerate(results):
        _assert_equal_one(result["tp"], one["one"], f"TP={world} (gloo) rank {rank}")
    print(_stock_report(one["stock_tp"], one["stock_one"], world))  # recorded, not asserted


def _torchrun_main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    try:
        result = _rank_checks(rank, world, every_rank_single=True)
        _assert_equal_one(result["tp"], result["one"], f"TP={world} rank {rank}")
        print(f"rank {rank}: TP={world} Qwen3 equals one GPU bit for bit")
        if rank == 0:
            print(_stock_report(result["stock_tp"], result["stock_one"], world))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        _torchrun_main()
    else:
        import argparse
        import tempfile

        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--world", type=int, default=torch.cuda.device_count())
        world = parser.parse_args().world
        with tempfile.TemporaryDirectory() as tmp:
            results = run_world(_rank_checks, world, Path(tmp), backend="nccl", timeout_s=600)
        for rank, result in enumerate(results):
            _assert_equal_one(result["tp"], results[0]["one"], f"TP={world} rank {rank}")
        print(_stock_report(results[0]["stock_tp"], results[0]["stock_one"], world))
        print(f"world {world}: TP Qwen3 equals one GPU bit for bit")
