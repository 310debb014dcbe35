"""How often the Hopper kernel's rescale skip (session 10) can fire: the share of a warp's
rescale steps (every block that does not start a split) in which no row of the warp has a
block max above its running max of the split, i.e. every alpha is exactly 1.

A model of the kernel's bookkeeping on the benchmark's data (randn Q, K; GQA 32/8, d = 128,
bf16 inputs, scores in fp32 on the CPU, not the kernel's bits): 128-row tiles of 32 query
positions x the 4 query heads of one kv head, warps of 16 rows (4 positions x 4 heads), 128-key
blocks, the running max restarting at every 1024-key split.  One sequence and one kv head per
case (the statistics do not depend on the batch).

    python reports/attn_rescale/skip_fraction.py
"""

from __future__ import annotations

import torch

HQ, HKV, D = 32, 8, 128
PACK = HQ // HKV
BLOCK, SPLIT_BLOCKS = 128, 8


def skip_share(seq: int, causal: bool, seed: int = 0) -> tuple[int, int]:
    """(skipped, total) warp rescale steps of one kv head's 4 query heads of one sequence."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(PACK, seq, D, generator=gen).bfloat16().float()
    k = torch.randn(seq, D, generator=gen).bfloat16().float()
    blocks = -(-seq // BLOCK)
    # Block max of each (head, query) row: [PACK, seq, blocks]; invisible keys -inf.
    block_max = torch.empty(PACK, seq, blocks)
    for b in range(blocks):
        s = q @ k[b * BLOCK : (b + 1) * BLOCK].T  # [PACK, seq, keys]
        if causal:
            keys = torch.arange(b * BLOCK, b * BLOCK + s.shape[-1])
            s = s.masked_fill(keys[None, None, :] > torch.arange(seq)[None, :, None], -torch.inf)
        block_max[..., b] = s.max(-1).values
    # Warp w: query positions 4w .. 4w + 3, all PACK heads (16 rows).
    rows = block_max.permute(1, 0, 2).reshape(seq // 4, 4 * PACK, blocks)
    skipped = total = 0
    for w in range(rows.shape[0]):
        last_query = 4 * w + 3
        # Blocks the warp's tile computes: the tile (32 positions) decides, as in the kernel.
        tile_last = (last_query // 32) * 32 + 31
        end = min(blocks, tile_last // BLOCK + 1) if causal else blocks
        run = torch.full((4 * PACK,), -torch.inf)
        for b in range(end):
            mx = rows[w, :, b]
            if b % SPLIT_BLOCKS == 0:
                run = torch.full((4 * PACK,), -torch.inf)
                if b > 0:  # a split start zeroes acc: no rescale to skip
                    run = torch.maximum(run, mx)
                    continue
            grew = (mx > run).any().item() or b == 0 and bool((mx > -torch.inf).any())
            total += 1
            skipped += not grew
            run = torch.maximum(run, mx)
    return skipped, total


def main() -> None:
    torch.set_num_threads(1)
    for seq, causal in [(4096, True), (2048, True), (4096, False)]:
        skipped, total = skip_share(seq, causal)
        print(
            f"S={seq} causal={causal}: {skipped} of {total} warp rescale steps skippable "
            f"({skipped / total:.1%})"
        )


if __name__ == "__main__":
    main()
