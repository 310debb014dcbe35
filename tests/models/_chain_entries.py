"""What the tests of the chain's optional op-table entries (``add_rms_norm``, the fused
q/k-norm + RoPE step, ``linear_group``) share on the CPU: the inputs, an entry that counts its
calls, and the three prefill forms."""

from __future__ import annotations

import torch

IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9, 7]])
SEQLENS = torch.tensor([7, 4])
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]


class Counting:
    """An op table entry that counts its calls, or refuses them (a call where a gradient is
    needed, when the entry must not run there)."""

    def __init__(self, fn, *, refuse: bool = False):
        self.fn, self.refuse, self.calls = fn, refuse, 0

    def __call__(self, *args, **kwargs):
        if self.refuse:
            raise AssertionError("an optional entry ran where a gradient is needed")
        self.calls += 1
        return self.fn(*args, **kwargs)


def forwards(model, ops):
    """Logits of a padded prefill, a packed (varlen) prefill and a chunked prefill."""
    padded = model(IDS, seqlens=SEQLENS, ops=ops)
    cu_seqlens = torch.tensor([0, 7, 11])
    packed = model(torch.cat([IDS[0], IDS[1, :4]]), cu_seqlens=cu_seqlens, ops=ops)
    chunked = model.prefill_chunked(IDS, [3, 1, 3], ops=ops)
    return padded, packed, chunked
