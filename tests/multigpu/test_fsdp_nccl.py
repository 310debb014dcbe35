"""FSDP (``torch.distributed.fsdp.fully_shard``) over batchinv's Qwen3 at world 2, on NCCL.

Each rank trains on its own data; FSDP gathers the weights for the forward and
reduce-scatters the gradients.  Per rank, against the same model on one GPU with that
rank's data:
- ``Qwen3.token_logprobs`` (a packed batch) and the loss: bitwise equal (asserted): FSDP
  moves the weights' bytes, the forward is batchinv's;
- the gradients of two FSDP runs in the same process: bitwise equal (asserted);
- the FSDP gradient against the average of the ranks' one-GPU gradients, rounded once to
  bf16: recorded, not asserted (the reduce-scatter's order and arithmetic are NCCL's);
- a transformers Qwen3 patched by ``apply_batchinv_to_qwen3``, each decoder layer and the
  root under ``fully_shard``: forward logits bitwise equal to one GPU (asserted).

``Qwen3``'s chain reads its parameters by name, not through submodule calls, so only the
root is wrapped (the whole model is gathered for the forward) and ``token_logprobs`` is
registered with ``register_fsdp_forward_method``.

Run with pytest (``pytest tests/multigpu/test_fsdp_nccl.py``) or as a script:
``python tests/multigpu/test_fsdp_nccl.py --world 2``.  NVLink multicast stays off
(``_spawn`` sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` on import).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_TESTS / "distributed"))
sys.path.insert(0, str(_TESTS))
from _spawn import run_world  # noqa: E402

from _hf_tiny_qwen3 import CUDA_CONFIG, make_hf_model  # noqa: E402
from batchinv.contract import assert_bitwise_equal  # noqa: E402
from batchinv.models.qwen3 import Qwen3, Qwen3Config, random_state_dict  # noqa: E402

pytestmark = pytest.mark.cuda

WORLD = 2
DTYPE = torch.bfloat16
CONFIG = Qwen3Config(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
)
SEQUENCES = ((70, 6), (33, 3), (129, 40))  # (length, prompt length) of each rank's batch
HF_IDS = (2, 48)  # [batch, seq] of the transformers forward


def _rank_data(rank: int) -> tuple[list[torch.Tensor], list[int], torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    sequences = [
        torch.randint(0, CONFIG.vocab_size, (n,), generator=generator) for n, _ in SEQUENCES
    ]
    hf_ids = torch.randint(0, CUDA_CONFIG["vocab_size"], HF_IDS, generator=generator)
    return sequences, [p for _, p in SEQUENCES], hf_ids


def _train_step(model, sequences, prompt_lens) -> tuple[list[torch.Tensor], torch.Tensor]:
    logprobs = model.token_logprobs(sequences, prompt_lens)
    loss = -torch.cat(logprobs).mean()
    loss.backward()
    return [t.detach().cpu() for t in logprobs], loss.detach().cpu()


def _fsdp_checks(rank: int, world: int, device_type: str = "cuda") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from batchinv.integrations.transformers import apply_batchinv_to_qwen3

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else "cpu"
    mesh = init_device_mesh(device_type, (world,))
    weights = random_state_dict(CONFIG, seed=0, dtype=DTYPE, device=device)
    sequences, prompt_lens, hf_ids = _rank_data(rank)
    out: dict = {}

    single = Qwen3(CONFIG, weights)
    out["one/logprobs"], out["one/loss"] = _train_step(single, sequences, prompt_lens)
    out["one/grads"] = {name: p.grad.cpu() for name, p in single.named_parameters()}
    del single

    model = Qwen3(CONFIG, weights)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "token_logprobs")
    for run in (0, 1):
        model.zero_grad(set_to_none=True)
        out[f"fsdp{run}/logprobs"], out[f"fsdp{run}/loss"] = _train_step(
            model, sequences, prompt_lens
        )
        # full_tensor() is a collective: every rank walks the parameters in the same order.
        out[f"fsdp{run}/grads"] = {
            name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()
        }
    del model
    if importlib.util.find_spec("transformers") is None:
        return out  # the HF test skips, with its reason

    def hf_model():
        hf = make_hf_model("sdpa", seed=1, **CUDA_CONFIG).to(device=device, dtype=DTYPE)
        apply_batchinv_to_qwen3(hf)
        return hf

    hf_ids = hf_ids.to(device)
    with torch.no_grad():
        out["one/hf_logits"] = hf_model()(hf_ids).logits.cpu()
        hf = hf_model()
        for layer in hf.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(hf, mesh=mesh)
        out["fsdp/hf_logits"] = hf(hf_ids).logits.cpu()
    return out


def _assert_forward(result: dict, label: str) -> None:
    for run in (0, 1):
        pairs = zip(result[f"fsdp{run}/logprobs"], result["one/logprobs"], strict=True)
        for i, (got, expected) in enumerate(pairs):
            assert_bitwise_equal(got, expected, name=f"{label} run {run} logprobs {i}")
        assert_bitwise_equal(result[f"fsdp{run}/loss"], result["one/loss"], name=f"{label} loss")


def _assert_grads_run_to_run(result: dict, label: str) -> None:
    for name, grad in result["fsdp0/grads"].items():
        assert_bitwise_equal(result["fsdp1/grads"][name], grad, name=f"{label} grad {name}")


def _grad_report(results: list[dict]) -> list[str]:
    """How the FSDP gradient compares with the ranks' one-GPU gradients averaged in fp32
    and rounded once (recorded: NCCL decides the reduce-scatter's arithmetic)."""
    lines = []
    fsdp = results[0]["fsdp0/grads"]
    equal = 0
    worst = 0.0
    for name, grad in fsdp.items():
        stacked = torch.stack([r["one/grads"][name].float() for r in results])
        expected = (stacked.sum(0) / len(results)).to(grad.dtype)
        equal += int(torch.equal(grad, expected))
        worst = max(worst, float((grad.float() - expected.float()).abs().max()))
    lines.append(
        f"FSDP world {len(results)}: {equal} of {len(fsdp)} gradients bitwise equal to the "
        f"one-GPU gradients' mean rounded once; max |diff| = {worst:.4g}"
    )
    return lines


def _check(results: list[dict]) -> list[str]:
    for rank, result in enumerate(results):
        _assert_forward(result, f"rank {rank}")
        _assert_grads_run_to_run(result, f"rank {rank}")
    for rank, result in enumerate(results[1:], start=1):  # every rank holds the same grads
        for name, grad in results[0]["fsdp0/grads"].items():
            assert_bitwise_equal(result["fsdp0/grads"][name], grad, name=f"rank {rank} {name}")
    return _grad_report(results)


def _assert_hf(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        name = f"rank {rank} HF logits"
        assert_bitwise_equal(result["fsdp/hf_logits"], result["one/hf_logits"], name=name)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """One spawn for both tests."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, {torch.cuda.device_count()} present")
    tmp = tmp_path_factory.mktemp("fsdp")
    return run_world(_fsdp_checks, WORLD, tmp, backend="nccl", timeout_s=600)


def test_fsdp_qwen3_equals_one_gpu(results):
    for line in _check(results):
        print(line)  # recorded, not asserted


def test_fsdp_patched_transformers_qwen3_equals_one_gpu(results):
    pytest.importorskip("transformers")
    _assert_hf(results)


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=WORLD)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(
            _fsdp_checks, args.world, Path(tmp), args.device, backend=backend, timeout_s=600
        )
    for line in _check(results):
        print(line)
    if "fsdp/hf_logits" in results[0]:
        _assert_hf(results)
    else:
        print("transformers is not installed: the patched transformers Qwen3 was not run")
    print(f"world {args.world}: FSDP forward equals one device bit for bit")
