"""The eager no-grad path of ``token_logprobs`` on CUDA keeps launch plans per signature.  On
the CPU the CUDA module runs against recording stand-ins for its kernels (CPU tensors
dispatched as CUDA; the finalize stand-in writes each row's target id where the kernel writes
the logprob, its row index where it writes the entropy), so these tests pin the host logic: a
lean call launches the kernels, grids and integer arguments of the general path, hands them the
same marked targets, returns the outputs in the general path's places, keeps TMA maps per
address and no tensors, and checks bad targets as ``forward`` does.  The bits on a GPU are
``tests/gpu/test_host_path_token_logprobs_cuda.py``'s."""

from __future__ import annotations

import ctypes

import pytest
import torch

import batchinv
from batchinv import device_checks, registry
from batchinv.contract import assert_bitwise_equal
from batchinv.gpu import token_logprobs as gpu_token_logprobs
from batchinv.ops import _checked

DTYPE = torch.bfloat16
IGNORE = -100
FINALIZE = "token_logprobs_finalize"
MARK = "token_logprobs_mark_targets_"


def _address(value) -> int:
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _floats(address: int, count: int):
    return (ctypes.c_float * count).from_address(address)


def _mark(name, args):
    """The marking kernel on the CPU: each id or -1 into the targets, the first bad position
    into the flag (an unsigned minimum); returns the marked targets."""
    ids_at, count, vocab, ignore_index, targets_at, flag_at = args
    id_type = ctypes.c_int32 if name.endswith("i32") else ctypes.c_int64
    ids = list((id_type * count).from_address(ids_at))
    marked = [-1 if i == ignore_index or not 0 <= i < vocab else i for i in ids]
    (ctypes.c_int32 * count).from_address(targets_at)[:] = marked
    flag = ctypes.c_uint64.from_address(flag_at)
    for position, i in enumerate(ids):
        if not 0 <= i < vocab and i != ignore_index:
            flag.value = min(flag.value, position)
    return marked


class FakeKernel:
    """Records each launch with its pointers as ints and the int32 targets it is handed (the
    marking kernel: the targets it writes, as ``_mark`` does); as the finalize kernel, writes
    ``logprob[r] = target`` and ``entropy[r] = r``."""

    def __init__(self, name: str, launches: list):
        self.name = name
        self._launches = launches

    def __call__(
        self, grid, block, args, shared_mem=0, stream=None, device=None, programmatic=False
    ):
        args = tuple(_address(a) for a in args)
        if self.name.startswith(MARK):
            targets = _mark(self.name, args)
        else:
            at, rows = (args[4], args[6]) if self.name == FINALIZE else (args[2], args[7])
            targets = list((ctypes.c_int32 * rows).from_address(at))
        if self.name == FINALIZE:
            logprob, entropy = _floats(args[7], rows), args[9] and _floats(args[9], rows)
            for row, target in enumerate(targets):
                logprob[row] = target
                if entropy:
                    entropy[row] = row
        record = (self.name, tuple(grid), tuple(block), args, shared_mem, stream, programmatic)
        self._launches.append((record, targets))


@pytest.fixture
def launches(monkeypatch):
    """CPU tensors dispatched to the CUDA token_logprobs of an sm_90 device, launches
    recorded (TMA maps as the bytes of their arguments)."""
    recorded = []
    monkeypatch.setattr(registry, "backend_of", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gpu_token_logprobs, "current_raw_stream", lambda index: 7)
    monkeypatch.setattr(gpu_token_logprobs, "uses_hopper", lambda device: True)
    monkeypatch.setattr(gpu_token_logprobs, "allow_dynamic_shared", lambda *args: None)
    # A CPU tensor's device has no index where a CUDA tensor's has one: the map's device is 0.
    monkeypatch.setattr(
        gpu_token_logprobs, "tensor_map_2d", lambda *args: repr((*args[:-1], 0)).encode()
    )
    monkeypatch.setattr(
        gpu_token_logprobs, "kernel_for", lambda module, name, device: FakeKernel(name, recorded)
    )

    def stand_in_launch(kernel, device, grid, block, args, shared_mem=0, programmatic=False):
        kernel(grid, block, args, shared_mem, 7, device.index or 0, programmatic)

    monkeypatch.setattr(gpu_token_logprobs, "launch", stand_in_launch)
    _checked.clear_all()
    yield recorded
    _checked.clear_all()


def _case(rows, vocab=1000, hidden_size=64, ids=torch.int64, seed=0, lead=()):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, rows, hidden_size, generator=gen).to(DTYPE)
    weight = torch.randn(vocab, hidden_size, generator=gen).to(DTYPE)
    targets = torch.randint(0, vocab, (*lead, rows), generator=gen).to(ids)
    if rows > 1:
        targets.view(-1)[1] = IGNORE  # an ignored row
    return hidden, weight, targets


def _general(hidden, weight, targets, entropy=False):
    logprob, _, ent, _ = gpu_token_logprobs.forward(hidden, weight, targets, IGNORE, entropy)
    shape = targets.shape
    return (logprob.view(shape), ent.view(shape)) if entropy else logprob.view(shape)


# Pointer arguments (fresh buffers, so different addresses on each path): the marking
# kernel's 0, 4 and 5, the partials kernel's 2..6, the finalize kernel's 0..4 and 7..9.
_POINTERS = {MARK: (0, 4, 5), "partials": range(2, 7), FINALIZE: (*range(5), 7, 8, 9)}


def _kind(name):
    return MARK if name.startswith(MARK) else FINALIZE if name == FINALIZE else "partials"


def _without_pointers(entry):
    (name, grid, block, args, shared, stream, programmatic), targets = entry
    pointers = _POINTERS[_kind(name)]
    kept = tuple(0 if (i in pointers and a != 0) else a for i, a in enumerate(args))
    return name, grid, block, kept, shared, stream, programmatic, targets


@pytest.mark.parametrize("rows", [1, 8, 64, 3, 1024])
@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("ids", [torch.int64, torch.int32])
def test_lean_call_launches_what_the_general_path_launches(launches, rows, vocab, entropy, ids):
    hidden, weight, targets = _case(rows, vocab, ids=ids)
    with torch.no_grad():
        first = batchinv.token_logprobs(hidden, weight, targets, return_entropy=entropy)
        again = batchinv.token_logprobs(hidden, weight, targets, return_entropy=entropy)
    lean = [_without_pointers(entry) for entry in launches]
    launches.clear()
    want = _general(hidden, weight, targets, entropy)
    general = [_without_pointers(entry) for entry in launches]
    assert lean == general + general
    assert len(gpu_token_logprobs._LEAN) == 1 and None not in gpu_token_logprobs._LEAN.values()
    for got in (first, again):
        assert_bitwise_equal(got, want, name="outputs where the general path puts them")
    marked = [t if t != IGNORE else -1 for t in targets.view(-1).tolist()]
    assert general[0][0] == MARK + ("i32" if ids == torch.int32 else "i64")
    assert general[0][-1] == general[1][-1] == marked  # what the kernels were handed
    # The marking kernel writes the targets the partials and finalize kernels read; those two
    # share the target logits and states.
    (_, mark), (_, partials), (_, finalize) = (entry[0][2:4] for entry in launches[:3])
    assert mark[4] == partials[2] == finalize[4]
    assert partials[2:6] == (finalize[4], finalize[3], finalize[0], finalize[1])
    assert (partials[6] == 0) == (finalize[2] == 0) == (not entropy)


def test_lean_workspace_segments_do_not_overlap(launches):
    rows, vocab = 17, 1000
    hidden, weight, targets = _case(rows, vocab)
    with torch.no_grad():
        batchinv.token_logprobs(hidden, weight, targets, return_entropy=True)
    (_, _, _, finalize, *_), _ = launches[2]
    tiles = -(-vocab // 256)
    m, l, s, logit, targets32, _, _, logprob, lse, entropy = finalize
    extents = sorted([(m, 4 * rows * tiles), (l, 4 * rows * tiles), (s, 4 * rows * tiles)])
    extents += sorted([(logit, 4 * rows), (lse, 4 * rows), (targets32, 4 * rows)])
    spans = sorted((start, start + size) for start, size in extents)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert entropy == logprob + 4 * rows  # one output allocation: logprobs, then entropy


def test_tma_maps_follow_the_operands_address(launches):
    hidden, weight, targets = _case(8)
    other = hidden.clone()
    other_weight = weight.clone()
    with torch.no_grad():
        for h, w in ((hidden, weight), (other, weight), (hidden, weight), (hidden, other_weight)):
            batchinv.token_logprobs(h, w, targets)
    maps = [entry[0][3][:2] for entry in launches if _kind(entry[0][0]) == "partials"]
    assert maps[0] == maps[2] and maps[0][0] != maps[1][0] and maps[0][1] == maps[1][1]
    assert maps[3][0] == maps[0][0] and maps[3][1] != maps[0][1]
    assert str(other.data_ptr()).encode() in maps[1][0]
    general = []
    launches.clear()
    _general(other, other_weight, targets)
    general = [entry[0][3][:2] for entry in launches if _kind(entry[0][0]) == "partials"]
    assert general == [(maps[1][0], maps[3][1])]  # the general path's maps, byte for byte


def test_plans_hold_no_tensors_and_clear_all_forgets_them(launches):
    hidden, weight, targets = _case(8)
    with torch.no_grad():
        batchinv.token_logprobs(hidden, weight, targets)
        batchinv.token_logprobs(hidden[:3], weight, targets[:3])
    assert len(gpu_token_logprobs._LEAN) == 2
    for key, plan in gpu_token_logprobs._LEAN.items():
        assert not any(isinstance(item, torch.Tensor) for item in key)
        assert not any(isinstance(v, torch.Tensor) for v in vars(plan).values())
    _checked.clear_all()
    assert len(gpu_token_logprobs._LEAN) == 0


def test_a_plan_made_during_a_graph_capture_is_not_kept(launches, monkeypatch):
    hidden, weight, targets = _case(8)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with torch.no_grad():
        batchinv.token_logprobs(hidden, weight, targets)
    assert len(gpu_token_logprobs._LEAN) == 0 and len(launches) == 3


def test_misaligned_or_strided_operands_take_the_general_path(launches):
    hidden, weight, targets = _case(8, hidden_size=72)
    shifted = torch.empty(8 * 72 + 1, dtype=DTYPE)[1:].view(8, 72)  # 2 bytes past alignment
    shifted.copy_(hidden)
    strided = torch.empty(8, 80, dtype=DTYPE)[:, :72]
    strided.copy_(hidden)
    with torch.no_grad():
        for h in (shifted, strided):
            got = batchinv.token_logprobs(h, weight, targets)
            assert_bitwise_equal(got, _general(h, weight, targets))
    assert list(gpu_token_logprobs._LEAN.values()) == [None]  # only the contiguous one keyed


def test_grad_recording_calls_keep_the_autograd_node(launches):
    hidden, weight, targets = _case(8)
    hidden.requires_grad_(True)
    out = batchinv.token_logprobs(hidden, weight, targets)
    assert out.grad_fn is not None and len(gpu_token_logprobs._LEAN) == 0
    with torch.no_grad():
        assert batchinv.token_logprobs(hidden, weight, targets).grad_fn is None
    assert len(gpu_token_logprobs._LEAN) == 1


def test_no_tokens_take_the_general_path(launches):
    hidden, weight, targets = _case(0)
    with torch.no_grad():
        out, entropy = batchinv.token_logprobs(hidden, weight, targets, return_entropy=True)
    assert out.shape == entropy.shape == (0,) and launches == []


def test_a_leading_shape_is_kept(launches):
    hidden, weight, targets = _case(5, lead=(2,))
    with torch.no_grad():
        out, entropy = batchinv.token_logprobs(hidden, weight, targets, return_entropy=True)
    assert out.shape == entropy.shape == (2, 5)
    assert_bitwise_equal((out, entropy), _general(hidden, weight, targets, entropy=True))


def test_bad_targets_raise_after_lean_calls_or_are_flagged_when_deferred(launches):
    hidden, weight, targets = _case(8)
    bad = targets.clone()
    bad[5] = 1000  # == vocab
    with torch.no_grad():
        batchinv.token_logprobs(hidden, weight, targets)
        for _ in range(2):
            with pytest.raises(IndexError, match=r"target_ids\[5\] = 1000 is outside"):
                batchinv.token_logprobs(hidden, weight, bad)
        with device_checks.deferred():
            batchinv.token_logprobs(hidden, weight, targets)
            device_checks.raise_device_errors(hidden.device)  # nothing flagged yet
            out = batchinv.token_logprobs(hidden, weight, bad)
        assert out[5] == -1  # the kernels were handed an ignored row
        with pytest.raises(IndexError, match="token_logprobs: target_ids"):
            device_checks.raise_device_errors(hidden.device)
    assert len(gpu_token_logprobs._LEAN) == 1


def test_bad_arguments_raise_after_good_lean_calls(launches):
    hidden, weight, targets = _case(8)
    with torch.no_grad():
        batchinv.token_logprobs(hidden, weight, targets)
        before = len(launches)
        with pytest.raises(ValueError, match="target_ids must have shape"):
            batchinv.token_logprobs(hidden, weight, targets[:3])
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            batchinv.token_logprobs(hidden, weight, targets, True)
        with pytest.raises(ValueError, match="vocab_chunk"):
            batchinv.token_logprobs(hidden, weight, targets, vocab_chunk=0)
        with pytest.raises(TypeError, match="bf16 or fp16"):
            batchinv.token_logprobs(hidden.float(), weight.float(), targets)
        assert len(launches) == before
