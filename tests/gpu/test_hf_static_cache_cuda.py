"""Capturable decode under a Hugging Face mask (``attention_masks.decode_with_mask``) and HF
generation with batchinv's static cache under ``torch.compile`` (CUDA graphs).

The decode route reads a row's visible keys as one run on the device; it must give the packed
route's bits (which the sweep tests tie to the sequence alone), raise for masks that break its
rule, and run inside a CUDA graph.  A compiled generation must give the eager generation's
bits, token for token and logit for logit."""

from __future__ import annotations

import pytest
import torch

from _hf_tiny_qwen3 import CUDA_CONFIG, make_hf_model
from batchinv import device_checks
from batchinv.contract import assert_bitwise_equal
from batchinv.integrations import transformers as hf
from batchinv.integrations.attention_masks import decode_with_mask, packed_with_mask

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")

BF16 = dict(device="cuda", dtype=torch.bfloat16)


def _decode_case(batch: int, keys: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 1, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(batch, keys, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, keys, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    return q, k, v


def _runs_mask(batch: int, keys: int, runs) -> torch.Tensor:
    """``[B, 1, 1, keys]`` bool, row ``b`` seeing keys ``runs[b] = (first, end)``."""
    mask = torch.zeros(batch, 1, 1, keys, dtype=torch.bool, device="cuda")
    for b, (first, end) in enumerate(runs):
        mask[b, 0, 0, first:end] = True
    return mask


# Left padding, keys past the end (a static cache), a row seeing nothing, runs crossing the
# 2048-key split boundary, a whole row.
RUNS = [(3, 40), (0, 2600), (0, 0), (100, 2148), (0, 3000), (2047, 2049)]


@pytest.mark.parametrize("additive", [False, True])
def test_decode_route_gives_the_packed_route_bits(additive):
    keys = 3000
    q, k, v = _decode_case(len(RUNS), keys)
    mask = _runs_mask(len(RUNS), keys, RUNS)
    if additive:
        mask = torch.zeros(mask.shape, **BF16).masked_fill(~mask, float("-inf"))
    got = decode_with_mask(q, k, v, mask, softmax_scale=None)
    want = packed_with_mask(q, k, v, mask, softmax_scale=None)
    assert_bitwise_equal(got, want, name="decode route vs packed route")
    assert not got[2].any()  # a row that sees no key gives zeros


def test_decode_route_row_is_the_same_in_any_batch():
    q, k, v = _decode_case(len(RUNS), 3000, seed=1)
    mask = _runs_mask(len(RUNS), 3000, RUNS)
    whole = decode_with_mask(q, k, v, mask, softmax_scale=0.1)
    for b in (0, 3, 5):
        alone = decode_with_mask(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], mask[b : b + 1], softmax_scale=0.1
        )
        assert_bitwise_equal(alone, whole[b : b + 1], name=f"row {b}")


def test_eager_decode_hands_a_mask_with_holes_to_the_packed_route():
    q, k, v = _decode_case(2, 64)
    mask = _runs_mask(2, 64, [(0, 10), (0, 64)])
    mask[0, 0, 0, 5] = False
    got = decode_with_mask(q, k, v, mask, softmax_scale=None)
    want = packed_with_mask(q, k, v, mask, softmax_scale=None)
    assert_bitwise_equal(got, want, name="a mask with a hole, eager")
    bias = torch.zeros(mask.shape, **BF16).masked_fill(~mask, 0.5)  # not a 0/-inf mask
    with pytest.raises(ValueError, match="values other than 0 and -inf"):
        decode_with_mask(q, k, v, bias, softmax_scale=None)


def test_decode_route_in_a_cuda_graph_defers_its_mask_check():
    q, k, v = _decode_case(2, 300)
    mask = _runs_mask(2, 300, [(2, 250), (0, 300)])
    want = decode_with_mask(q, k, v, mask, softmax_scale=None)  # eager first: the word exists
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_with_mask(q, k, v, mask, softmax_scale=None)
    graph.replay()
    device_checks.raise_device_errors()
    assert_bitwise_equal(out, want, name="replay vs eager")
    mask[0, 0, 0, 100] = False  # a hole in row 0
    graph.replay()
    with pytest.raises(ValueError, match="attention: attention_mask of a decode row"):
        device_checks.raise_device_errors()
    assert not out[0].any()
    assert_bitwise_equal(out[1], want[1], name="the good row")


def _generate(model, ids, mask, cache, compiled: bool):
    kwargs = dict(
        max_new_tokens=12,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        past_key_values=cache,
    )
    if not compiled:
        kwargs["disable_compile"] = True
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    return out.sequences, torch.stack(out.logits)


def test_compiled_hf_generation_with_the_static_cache_gives_eager_bits():
    model = make_hf_model("sdpa", **CUDA_CONFIG).cuda().to(torch.bfloat16)
    hf.apply_batchinv_to_qwen3(model)
    ids = torch.randint(0, 1024, (3, 10), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    eager_ids, eager = _generate(model, ids, mask, hf.static_cache(model, 32), compiled=False)
    torch._dynamo.utils.counters.clear()
    for attempt in range(2):  # the first compiles and captures, the second replays
        got_ids, got = _generate(model, ids, mask, hf.static_cache(model, 32), compiled=True)
        device_checks.raise_device_errors()
        assert torch.equal(got_ids, eager_ids), f"attempt {attempt}: tokens differ"
        assert_bitwise_equal(got, eager, name=f"attempt {attempt}: logits, compiled vs eager")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
