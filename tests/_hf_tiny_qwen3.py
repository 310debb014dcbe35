"""A tiny random Hugging Face Qwen3ForCausalLM and the batch-invariance sweep, shared by the
chain parity tests (tests/chain) and the integration tests (tests/integrations)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=512,
    # Larger than HF's 0.02 so attention is far from uniform and every weight matters.
    initializer_range=0.2,
)

# For the CUDA tests: head dim 128 (a size the CUDA attention kernels take), GQA 4:1.
CUDA_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    num_hidden_layers=2,
    vocab_size=1024,
    max_position_embeddings=1024,
)


def make_hf_model(attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        **(TINY_CONFIG | overrides), attn_implementation=attn_implementation
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF initialises norm weights to 1; random ones check that each is applied.
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
    return model


def token_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@dataclass
class Case:
    name: str
    ids: torch.Tensor  # [B, S]
    mask: torch.Tensor | None  # [B, S] (1 = token) or None
    row: int  # where the target sequence sits


def sweep_cases(target: torch.Tensor) -> list[Case]:
    """The target ``[L]`` in batches of 1, 3 and 5 at different rows, with different
    neighbours, and right-padded (attention mask) among longer and shorter sequences."""
    length = target.numel()
    cases = []
    for batch, row, seed in ((3, 0, 10), (3, 2, 11), (3, 1, 12), (5, 3, 13)):
        ids = token_ids(batch, length, seed)
        ids[row] = target
        cases.append(Case(f"batch {batch}, row {row}, neighbours {seed}", ids, None, row))
    for batch, row, lengths, seed in (
        (1, 0, [length + 5], 20),
        (3, 1, [length + 4, length, 3], 21),
        (5, 2, [2, length + 7, length, length - 4, length + 1], 22),
    ):
        width = max(lengths)
        ids = token_ids(batch, width, seed)
        ids[row, :length] = target
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        mask[row, length:] = 0
        cases.append(Case(f"padded batch {batch}, row {row}, lengths {lengths}", ids, mask, row))
    return cases


def logits(model, ids, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def assert_packed_row_matches_alone(model, lengths: tuple[int, ...], device="cpu") -> None:
    """A trainer's packed row (the sequences one after another, ``position_ids`` restarting
    at each): each sequence's logits equal its logits alone, bit for bit, and a backward
    through the packed row reaches every weight with finite gradients."""
    from batchinv.contract import assert_bitwise_equal

    seqs = [token_ids(1, n, seed=30 + i)[0].to(device) for i, n in enumerate(lengths)]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        start = 0
        for seq in seqs:
            alone = model(input_ids=seq[None], use_cache=False).logits[0]
            assert_bitwise_equal(packed[start : start + seq.numel()], alone)
            start += seq.numel()
    out = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
    out.logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and bool(g.isfinite().all()) for g in grads)
