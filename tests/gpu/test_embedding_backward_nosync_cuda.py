"""The embedding backward's sync-free path (the runs kernel, which finds the runs of equal ids
in the sorted ids): bitwise the ``torch.unique_consecutive`` path, no host sync, and captured
in a CUDA graph, replayed with new ids, the eager bits."""

from __future__ import annotations

import pytest
import torch

import batchinv
from _streams import capture_graph
from batchinv.contract import assert_bitwise_equal, deterministic_context
from batchinv.gpu import embedding as gpu_embedding
from batchinv.host_syncs import count_host_syncs, sync_debug_mode
from batchinv.reference.embedding import embedding_backward

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
# 1 and 1024 ids: the one-CTA sort kernel; SORT_MAX_IDS its largest case; one more and 16384:
# torch.sort.
TOKENS = (1, 1024, gpu_embedding.SORT_MAX_IDS, gpu_embedding.SORT_MAX_IDS + 1, 16384)
VOCAB, HIDDEN = 3000, 257  # three column blocks, the last one partial
EXTREME_VOCAB = 4096


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _ids(tokens, vocab, id_dtype, seed, out_of_range=False):
    """Random ids with a heavily repeated one (a padding token) and, if asked, ids outside
    ``[0, vocab)`` on both sides, in ``id_dtype``."""
    ids = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=_seeded(seed))
    ids[::7] = 3 % vocab
    if out_of_range:
        big = 2**40 if id_dtype == torch.int64 else 2**31 - 1
        bad = torch.tensor([-1, vocab, big, -1, vocab], device=DEVICE)
        ids[: min(tokens, 5)] = bad[: min(tokens, 5)]
        ids[tokens // 2 :: 11] = vocab
    return ids.to(id_dtype)


def _grad(tokens, hidden, dtype, seed):
    return torch.randn(tokens, hidden, device=DEVICE, generator=_seeded(seed)).to(dtype)


@pytest.mark.parametrize("tokens", (1, 2, 3, 33, 1000, 1024, 1025, 4097, 8192))
def test_sort_kernel_gives_the_stable_sort(tokens):
    # embedding_sort_ids against torch.sort(stable=True) of the same ids with every id outside
    # [0, vocab) written as -1: the same ids and positions (heavy repeats, out-of-range ids on
    # both sides, sizes on both sides of powers of two), and for strided ids.
    assert tokens <= gpu_embedding.SORT_MAX_IDS
    ids = _ids(tokens, VOCAB, torch.int64, seed=20 + tokens, out_of_range=True)
    for case, view in (("contiguous", ids), ("strided", torch.stack([ids, -ids], 1)[:, 0])):
        assert gpu_embedding.sort_ids_applies(view.numel(), VOCAB)
        got_ids, got_positions = gpu_embedding.sort_ids(view, VOCAB)
        valid = (view >= 0) & (view < VOCAB)
        want_ids, want_positions = torch.sort(torch.where(valid, view, -1), stable=True)
        assert torch.equal(got_ids, want_ids), case
        assert torch.equal(got_positions, want_positions), case


def _both(ids, grad, vocab, dtype):
    static = gpu_embedding.backward(ids, grad, vocab, dtype, segments="static")
    unique = gpu_embedding.backward(ids, grad, vocab, dtype, segments="unique")
    return static, unique


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_static_segments_give_the_unique_paths_bits(dtype, id_dtype, tokens):
    ids = _ids(tokens, VOCAB, id_dtype, seed=1)
    grad = _grad(tokens, HIDDEN, dtype, seed=2)
    static, unique = _both(ids, grad, VOCAB, dtype)
    assert_bitwise_equal(static, unique, name="static vs unique segments")
    if tokens <= 1024:  # the CPU reference is slow at 16k tokens
        assert_bitwise_equal(static.cpu(), embedding_backward(ids.cpu(), grad.cpu(), VOCAB, dtype))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_of_range_ids_are_dropped_as_on_the_unique_path(dtype, id_dtype, tokens):
    ids = _ids(tokens, VOCAB, id_dtype, seed=3, out_of_range=True)
    grad = _grad(tokens, HIDDEN, dtype, seed=4)
    static, unique = _both(ids, grad, VOCAB, dtype)
    torch.cuda.synchronize()  # a store out of bounds would surface here
    assert_bitwise_equal(static, unique, name="static vs unique segments")
    if tokens <= 1024:
        assert_bitwise_equal(static.cpu(), embedding_backward(ids.cpu(), grad.cpu(), VOCAB, dtype))


@pytest.mark.parametrize(
    "ids",
    (
        [5] * 4096,  # one run: one position starts it, 4095 are inside it
        list(range(EXTREME_VOCAB)),  # every position starts a run
        [-1, EXTREME_VOCAB, 2**40, -1],  # only out-of-range ids: nothing written
    ),
    ids=("all equal", "all distinct", "only out of range"),
)
def test_extreme_segment_counts(ids):
    ids = torch.tensor(ids, device=DEVICE)
    grad = _grad(ids.numel(), HIDDEN, torch.bfloat16, seed=5)
    static, unique = _both(ids, grad, EXTREME_VOCAB, torch.bfloat16)
    assert_bitwise_equal(static, unique)
    want = embedding_backward(ids.cpu(), grad.cpu(), EXTREME_VOCAB, torch.bfloat16)
    assert_bitwise_equal(static.cpu(), want)
    if bool(((ids < 0) | (ids >= EXTREME_VOCAB)).all()):
        assert not bool(static.any())


def test_full_vocabulary_at_16k_tokens():
    vocab, hidden, tokens = 151936, 4096, 16384
    ids = _ids(tokens, vocab, torch.int64, seed=6)
    grad = _grad(tokens, hidden, torch.bfloat16, seed=7)
    static, unique = _both(ids, grad, vocab, torch.bfloat16)
    assert_bitwise_equal(static, unique, name="151936 x 4096, 16384 tokens")


@pytest.mark.parametrize("dtype", DTYPES)
def test_ctas_that_walk_several_runs_give_the_same_bits(dtype):
    # hidden 4097: 33 column blocks, so 992 CTAs along 8192 sorted ids, 8 or 9 each.
    vocab, hidden, tokens = 50000, 4097, 8192
    assert gpu_embedding.runs_grid_x(tokens, hidden) == 992
    ids = torch.randperm(vocab, device=DEVICE, generator=_seeded(27))[:tokens]
    ids[::5] = 7
    grad = _grad(tokens, hidden, dtype, seed=28)
    static, unique = _both(ids, grad, vocab, dtype)
    assert_bitwise_equal(static, unique, name="static vs unique segments")
    assert_bitwise_equal(static.cpu(), embedding_backward(ids.cpu(), grad.cpu(), vocab, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_uses_the_static_path_and_matches_the_unique_one(dtype, monkeypatch):
    ids = _ids(1024, VOCAB, torch.int64, seed=8).view(4, 256)
    grad = _grad(1024, HIDDEN, dtype, seed=9).view(4, 256, HIDDEN)
    leaf = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=_seeded(10)).to(dtype)
    leaf.requires_grad_()
    runs_launches = []
    launch_runs = gpu_embedding._launch_runs

    def counted(*args):
        runs_launches.append(1)
        launch_runs(*args)

    monkeypatch.setattr(gpu_embedding, "_launch_runs", counted)
    (static,) = torch.autograd.grad(batchinv.embedding(ids, leaf), leaf, grad)
    assert len(runs_launches) == 1  # the default
    monkeypatch.setattr(gpu_embedding, "BACKWARD_SEGMENTS", "unique")
    (unique,) = torch.autograd.grad(batchinv.embedding(ids, leaf), leaf, grad)
    assert len(runs_launches) == 1
    assert_bitwise_equal(static, unique)


@pytest.mark.parametrize("tokens", TOKENS)
def test_static_backward_makes_no_host_sync(tokens):
    ids = _ids(tokens, VOCAB, torch.int32, seed=11, out_of_range=True)
    grad = _grad(tokens, HIDDEN, torch.bfloat16, seed=12)
    want = gpu_embedding.backward(ids, grad, VOCAB, torch.bfloat16, segments="unique")
    gpu_embedding.backward(ids, grad, VOCAB, torch.bfloat16)  # loads the kernel
    torch.cuda.synchronize()
    with sync_debug_mode("error"):  # raises on any synchronizing call
        got = gpu_embedding.backward(ids, grad, VOCAB, torch.bfloat16)
    assert_bitwise_equal(got, want)
    # The counter sees the sync the unique path makes: the check above is not blind.
    _, syncs = count_host_syncs(
        lambda: gpu_embedding.backward(ids, grad, VOCAB, torch.bfloat16, segments="unique")
    )
    assert syncs >= 1
    with pytest.raises(RuntimeError), sync_debug_mode("error"):
        gpu_embedding.backward(ids, grad, VOCAB, torch.bfloat16, segments="unique")


def test_autograd_backward_makes_no_host_sync():
    ids = _ids(1024, VOCAB, torch.int64, seed=13)
    grad = _grad(1024, HIDDEN, torch.bfloat16, seed=14)
    leaf = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    out = batchinv.embedding(ids, leaf, check_ids=False)
    (want,) = torch.autograd.grad(out, leaf, grad, retain_graph=True)
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        (got,) = torch.autograd.grad(out, leaf, grad)
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_captured_backward_replays_new_ids_with_the_eager_bits(dtype, tokens):
    ids = _ids(tokens, VOCAB, torch.int64, seed=15)
    grad = _grad(tokens, HIDDEN, dtype, seed=16)
    graph, captured = capture_graph(lambda: gpu_embedding.backward(ids, grad, VOCAB, dtype))
    # New ids with another number of distinct ones (all equal, then out-of-range ones mixed
    # in) and a new gradient, written into the captured buffers.
    for seed, fresh_ids in (
        (17, torch.full((tokens,), 9, device=DEVICE)),
        (18, _ids(tokens, VOCAB, torch.int64, seed=19, out_of_range=True)),
        (20, _ids(tokens, 40, torch.int64, seed=21)),
    ):
        ids.copy_(fresh_ids)
        grad.copy_(_grad(tokens, HIDDEN, dtype, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        eager = gpu_embedding.backward(ids, grad, VOCAB, dtype, segments="unique")
        assert_bitwise_equal(captured, eager, name=f"replay with ids of seed {seed}")


def test_captured_autograd_step_replays_new_ids_with_the_eager_bits():
    tokens, dtype = 1024, torch.bfloat16
    ids = _ids(tokens, VOCAB, torch.int64, seed=22)
    grad = _grad(tokens, HIDDEN, dtype, seed=23)
    leaf = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=_seeded(24)).to(dtype)
    leaf.requires_grad_()

    def step():
        return torch.autograd.grad(batchinv.embedding(ids, leaf, check_ids=False), leaf, grad)

    graph, (captured,) = capture_graph(step)
    ids.copy_(_ids(tokens, 50, torch.int64, seed=25))
    grad.copy_(_grad(tokens, HIDDEN, dtype, seed=26))
    graph.replay()
    torch.cuda.synchronize()
    (eager,) = step()
    assert_bitwise_equal(captured, eager)


def test_deterministic_mode_accepts_the_static_path_and_keeps_its_bits():
    ids = _ids(1024, VOCAB, torch.int64, seed=29, out_of_range=True)
    grad = _grad(1024, HIDDEN, torch.bfloat16, seed=30)
    want = gpu_embedding.backward(ids, grad, VOCAB, torch.bfloat16)
    with deterministic_context():  # raises if an op it uses has no deterministic version
        got = gpu_embedding.backward(ids, grad, VOCAB, torch.bfloat16)
    assert_bitwise_equal(got, want)


def test_unknown_segments_mode_is_rejected():
    ids = torch.tensor([1, 2], device=DEVICE)
    grad = torch.ones(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="segments must be"):
        gpu_embedding.backward(ids, grad, 10, torch.float32, segments="dynamic")
