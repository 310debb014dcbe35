"""The adversarial harness: a bad call fails cleanly and changes nothing.

A ``Case`` is data: how to build a fresh state (tensors, caches, a model), a bad call on it, the
error type and a regex the message must match (the argument it names), and a valid call.
``run_case`` checks the four properties every public entry point owes a caller:

1. the bad call raises ``error`` with a message matching ``match``;
2. every tensor, cache byte and length of the state is bit for bit what it was;
3. a valid call afterwards gives the bits (output and state after it) that the same valid
   call gives on a fresh state that never saw the bad call.

The case tables that run on every device (KV caches, KV-cache attention, the model with
caches) are built here from a ``Device`` (device, dtype, head dim the attention there
supports), so ``tests/adversarial`` runs them on the CPU and ``tests/gpu`` on CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

from batchinv import KVCache, attention_with_kv_cache
from batchinv.contract import assert_bitwise_equal
from batchinv.static_kv_cache import DeviceStatus, StaticKVCache

State = dict


@dataclass(frozen=True)
class Case:
    id: str
    setup: Callable[[], State]
    bad: Callable[[State], object]
    error: type[BaseException]
    match: str
    good: Callable[[State], object]


@dataclass(frozen=True)
class Device:
    """Where a case table runs: the device, the cache dtype and a head dim its attention takes."""

    device: str
    dtype: torch.dtype
    head_dim: int


CPU = Device("cpu", torch.float32, 8)
CUDA = Device("cuda", torch.bfloat16, 64)


def snapshot(value: object) -> object:
    """A deep copy of everything a call could change: tensors (cloned), caches (storage and
    lengths), modules (parameters and buffers), containers of those; other values as they are."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, KVCache):
        return {"k": snapshot(value.k), "v": snapshot(value.v), "lengths": value.host_lengths()}
    if isinstance(value, StaticKVCache):
        return {name: snapshot(getattr(value, name)) for name in ("k", "v", "lengths")}
    if isinstance(value, DeviceStatus):
        return {"word": snapshot(value.word)}
    if isinstance(value, nn.Module):
        return {name: snapshot(t) for name, t in value.state_dict().items()}
    if isinstance(value, Mapping):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [snapshot(item) for item in value]
    return value


def assert_same(actual: object, expected: object, where: str) -> None:
    """Bit-for-bit equality of two snapshots (NaN payloads included)."""
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{where}: a tensor became {type(actual).__name__}"
        assert_bitwise_equal(actual, expected, name=where)
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def run_case(case: Case) -> None:
    fresh = case.setup()
    expected = snapshot((case.good(fresh), fresh))
    state = case.setup()
    before = snapshot(state)
    with pytest.raises(case.error, match=case.match):
        case.bad(state)
    assert_same(snapshot(state), before, f"{case.id}: state after the failed call")
    assert_same(snapshot((case.good(state), state)), expected, f"{case.id}: the next valid call")


def ids(cases: Sequence[Case]) -> list[str]:
    return [case.id for case in cases]


# ----------------------------------------------------------------------------- inputs


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device="cpu") -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def host_ids(*values: int) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ----------------------------------------------------------------------------- KV caches

BATCH, MAX_LEN, HKV, HQ = 3, 8, 2, 4


def _filled_cache(where: Device, *, name: str = "adv cache") -> KVCache:
    """A cache with slots of lengths 3, 0 and 5 (NaN past them)."""
    cache = KVCache(BATCH, MAX_LEN, HKV, where.head_dim, where.dtype, where.device, name=name)
    k = randn(BATCH, 5, HKV, where.head_dim, seed=1, dtype=where.dtype, device=where.device)
    v = randn(BATCH, 5, HKV, where.head_dim, seed=2, dtype=where.dtype, device=where.device)
    cache.append(k, v, new_lengths=host_ids(3, 0, 5))
    return cache


def _new(where: Device, n: int, s: int, heads: int = HKV, seed: int = 3) -> Tensor:
    return randn(n, s, heads, where.head_dim, seed=seed, dtype=where.dtype, device=where.device)


def kv_cache_constructor_cases(where: Device) -> list[Case]:
    good_args = (BATCH, MAX_LEN, HKV, where.head_dim)

    def make(*args, **kwargs):
        return lambda state: KVCache(*args, **kwargs)

    def good(state):
        return KVCache(*good_args, where.dtype, where.device).k

    d = where.head_dim
    table = [
        ("batch_zero", (0, MAX_LEN, HKV, d), {}, ValueError, "batch"),
        ("batch_negative", (-1, MAX_LEN, HKV, d), {}, ValueError, "batch"),
        ("batch_bool", (True, MAX_LEN, HKV, d), {}, ValueError, "batch"),
        ("batch_float", (1.5, MAX_LEN, HKV, d), {}, ValueError, "batch"),
        ("max_len_zero", (BATCH, 0, HKV, d), {}, ValueError, "max_len"),
        ("max_len_str", (BATCH, "8", HKV, d), {}, ValueError, "max_len"),
        ("heads_zero", (BATCH, MAX_LEN, 0, d), {}, ValueError, "num_kv_heads"),
        ("head_dim_odd", (BATCH, MAX_LEN, HKV, 7), {}, ValueError, "head_dim=7"),
        ("head_dim_too_big", (BATCH, MAX_LEN, HKV, 512), {}, ValueError, "head_dim=512"),
        ("dtype_int", good_args, {"dtype": torch.int64}, TypeError, "dtype"),
        ("dtype_float64", good_args, {"dtype": torch.float64}, TypeError, "dtype"),
        ("device_meta", good_args, {"dtype": where.dtype, "device": "meta"}, ValueError, "meta"),
        ("device_nonsense", good_args, {"device": "nonsense"}, ValueError, "device"),
    ]
    return [
        Case(f"KVCache_{name}", dict, make(*args, **kwargs), error, match, good)
        for name, args, kwargs, error, match in table
    ]


def kv_cache_method_cases(where: Device) -> list[Case]:
    def setup():
        return {"cache": _filled_cache(where)}

    def append_good(state):
        return state["cache"].append(_new(where, 3, 2), _new(where, 3, 2, seed=4))

    def k(n=3, s=2, heads=HKV, seed=3, dtype=None):
        t = _new(where, n, s, heads, seed)
        return t if dtype is None else t.to(dtype)

    def append(**kw):
        def call(state):
            args = {"k_new": k(), "v_new": k(seed=4)} | kw
            return state["cache"].append(**args)

        return call

    other = torch.float64
    cases = [
        ("append_k_not_tensor", append(k_new=[1.0]), TypeError, "k_new"),
        ("append_k_3d", append(k_new=k()[0]), ValueError, "k_new"),
        ("append_k_dtype", append(k_new=k(dtype=other)), TypeError, "k_new"),
        ("append_v_shape", append(v_new=k(s=1)), ValueError, "v_new"),
        ("append_heads", append(k_new=k(heads=1), v_new=k(heads=1)), ValueError, "k_new"),
        (
            "append_seq_ids_float",
            append(seq_ids=torch.tensor([0.0, 1.0, 2.0])),
            TypeError,
            "seq_ids",
        ),
        (
            "append_seq_ids_bool",
            append(seq_ids=torch.tensor([True, False, True])),
            TypeError,
            "seq_ids",
        ),
        ("append_seq_ids_list", append(seq_ids=[0, 1, 2]), TypeError, "seq_ids"),
        ("append_seq_ids_2d", append(seq_ids=host_ids(0, 1, 2)[None]), ValueError, "seq_ids"),
        ("append_seq_ids_negative", append(seq_ids=host_ids(0, -1, 2)), IndexError, "seq_ids"),
        ("append_seq_ids_past", append(seq_ids=host_ids(0, 1, 3)), IndexError, "seq_ids"),
        ("append_seq_ids_repeat", append(seq_ids=host_ids(0, 1, 1)), ValueError, "seq_ids"),
        ("append_seq_ids_count", append(seq_ids=host_ids(0, 1)), ValueError, "slots"),
        (
            "append_new_lengths_neg",
            append(new_lengths=host_ids(1, -1, 0)),
            ValueError,
            "new_lengths",
        ),
        (
            "append_new_lengths_big",
            append(new_lengths=host_ids(1, 3, 0)),
            ValueError,
            "new_lengths",
        ),
        ("append_new_lengths_float", append(new_lengths=torch.ones(3)), TypeError, "new_lengths"),
        ("append_new_lengths_count", append(new_lengths=host_ids(1, 1)), ValueError, "new_lengths"),
        ("append_past_capacity", append(k_new=k(s=4), v_new=k(s=4, seed=4)), ValueError, "max_len"),
    ]
    cases = [Case(f"KVCache_{n}", setup, bad, e, m, append_good) for n, bad, e, m in cases]

    def copy_good(state):
        state["cache"].copy_prefix(2, 1, length=4)
        return state["cache"].read()[0]

    def copy(*args, **kw):
        return lambda state: state["cache"].copy_prefix(*args, **kw)

    def copy_from(make_source, *args, **kw):
        return lambda state: state["cache"].copy_prefix(*args, source=make_source(), **kw)

    def long_source():
        source = KVCache(1, MAX_LEN + 4, HKV, where.head_dim, where.dtype, where.device)
        source.append(k(1, MAX_LEN + 2), k(1, MAX_LEN + 2, seed=4))
        return source

    def other_layout():
        return KVCache(1, MAX_LEN, 1, where.head_dim, where.dtype, where.device, name="narrow")

    copies = [
        ("copy_dst_true", copy(0, True, length=2), TypeError, "dst"),  # a bool, not an index
        ("copy_src_true", copy(True, 1), TypeError, "src"),
        ("copy_src_float", copy(0.0, 1), TypeError, "src"),
        ("copy_dst_float", copy(0, 1.0), TypeError, "dst"),
        ("copy_length_float", copy(0, 1, length=2.0), TypeError, "length"),
        ("copy_length_bool", copy(0, 1, length=True), TypeError, "length"),
        ("copy_src_str", copy("0", 1), TypeError, "src"),
        ("copy_src_negative", copy(-1, 1), IndexError, "src"),
        ("copy_src_past", copy(3, 1), IndexError, "src"),
        ("copy_dst_past", copy(0, 3), IndexError, "dst"),
        ("copy_length_past", copy(0, 1, length=4), ValueError, "prefix length 4"),
        ("copy_length_negative", copy(0, 1, length=-1), ValueError, "prefix length"),
        ("copy_source_not_cache", copy(0, 1, source="cache"), TypeError, "source"),
        ("copy_source_layout", copy_from(other_layout, 0, 1), ValueError, "narrow"),
        ("copy_prefix_too_long", copy_from(long_source, 0, 1), ValueError, "max_len"),
    ]
    cases += [Case(f"KVCache_{n}", setup, bad, e, m, copy_good) for n, bad, e, m in copies]

    def lengths_good(state):
        state["cache"].set_lengths(host_ids(2, 1), host_ids(0, 2))
        return state["cache"].host_lengths()

    def set_lengths(*args):
        return lambda state: state["cache"].set_lengths(*args)

    lengths = [
        ("set_lengths_float", set_lengths(1.5), TypeError, "lengths"),
        ("set_lengths_bool", set_lengths(True), TypeError, "lengths"),
        ("set_lengths_str", set_lengths("1"), TypeError, "lengths"),
        ("set_lengths_negative", set_lengths(-1), ValueError, "lengths"),
        ("set_lengths_past", set_lengths(MAX_LEN + 1), ValueError, "max_len"),
        ("set_lengths_float_tensor", set_lengths(torch.ones(3)), TypeError, "lengths"),
        ("set_lengths_count", set_lengths(host_ids(1, 1)), ValueError, "lengths"),
        ("set_lengths_seq_ids_past", set_lengths(1, host_ids(5)), IndexError, "seq_ids"),
        ("set_lengths_one_bad", set_lengths(host_ids(1, 9), host_ids(0, 1)), ValueError, r"\[1\]"),
    ]
    cases += [Case(f"KVCache_{n}", setup, bad, e, m, lengths_good) for n, bad, e, m in lengths]

    def reset_good(state):
        state["cache"].reset(host_ids(1))
        return state["cache"].read(host_ids(2, 0))

    def reset(seq_ids):
        return lambda state: state["cache"].reset(seq_ids)

    def read(seq_ids):
        return lambda state: state["cache"].read(seq_ids)

    resets = [
        ("reset_seq_ids_past", reset(host_ids(0, 4)), IndexError, "seq_ids"),
        ("reset_seq_ids_float", reset(torch.zeros(1)), TypeError, "seq_ids"),
        ("reset_seq_ids_repeat", reset(host_ids(2, 2)), ValueError, "seq_ids"),
        ("reset_seq_ids_int", reset(1), TypeError, "seq_ids"),
        ("read_seq_ids_negative", read(host_ids(-1)), IndexError, "seq_ids"),
    ]
    cases += [Case(f"KVCache_{n}", setup, bad, e, m, reset_good) for n, bad, e, m in resets]
    return cases


# ----------------------------------------------------------------------------- attention


def kv_attention_cases(where: Device) -> list[Case]:
    """``attention_with_kv_cache``: every bad argument raises before the append."""
    d = where.head_dim

    def setup():
        return {"cache": _filled_cache(where)}

    def q(n=3, s=2, heads=HQ, dim=d, seed=5, dtype=None):
        t = randn(n, s, heads, dim, seed=seed, dtype=where.dtype, device=where.device)
        return t if dtype is None else t.to(dtype)

    def kv(n=3, s=2, heads=HKV, dim=d, seed=6):
        return randn(n, s, heads, dim, seed=seed, dtype=where.dtype, device=where.device)

    def good(state):
        with torch.no_grad():
            return attention_with_kv_cache(q(), kv(), kv(seed=7), state["cache"])

    def call(*args, **kw):
        def run(state):
            with torch.no_grad():
                full = {"q": q(), "k_new": kv(), "v_new": kv(seed=7), "cache": state["cache"]}
                names = ("q", "k_new", "v_new", "cache", "seq_ids")
                full |= dict(zip(names, args, strict=False)) | kw
                return attention_with_kv_cache(**full)

        return run

    nan, inf = float("nan"), float("inf")
    table = [
        ("scale_nan", call(softmax_scale=nan), ValueError, "softmax_scale"),  # the reproducer
        ("scale_inf", call(softmax_scale=inf), ValueError, "softmax_scale"),
        ("scale_str", call(softmax_scale="0.1"), TypeError, "softmax_scale"),
        ("scale_bool", call(softmax_scale=True), TypeError, "softmax_scale"),
        ("causal_int", call(causal=1), TypeError, "causal"),
        ("causal_str", call(causal="yes"), TypeError, "causal"),
        ("q_not_tensor", call(q=[[1.0]]), TypeError, "q"),
        ("q_3d", call(q=q()[0]), ValueError, "q"),
        ("q_dtype", call(q=q(dtype=torch.float64)), TypeError, "q"),
        ("q_head_dim", call(q=q(dim=d + 2)), ValueError, "head dim"),
        ("heads_not_multiple", call(q=q(heads=3)), ValueError, "Hq=3"),
        ("q2_k1_tokens", call(q=q(s=2), k_new=kv(s=1), v_new=kv(s=1)), ValueError, "S_new"),
        ("q1_k3_tokens", call(q=q(s=1), k_new=kv(s=3), v_new=kv(s=3)), ValueError, "S_new"),
        ("q_rows_vs_k_rows", call(q=q(n=2)), ValueError, "S_new"),
        ("v_shape", call(v_new=kv(s=1)), ValueError, "k and v"),
        (
            "k_heads_vs_cache",
            call(q=q(heads=2), k_new=kv(heads=1), v_new=kv(heads=1)),
            ValueError,
            "k_new",
        ),
        ("cache_not_cache", call(cache="cache"), TypeError, "cache"),
        ("seq_ids_past", call(seq_ids=host_ids(0, 1, 7)), IndexError, "seq_ids"),
        ("seq_ids_float", call(seq_ids=torch.zeros(3)), TypeError, "seq_ids"),
        ("seqlens_new_past", call(seqlens_new=host_ids(1, 3, 1)), ValueError, "seqlens_new"),
        ("seqlens_new_negative", call(seqlens_new=host_ids(1, -1, 1)), ValueError, "seqlens_new"),
        ("seqlens_new_float", call(seqlens_new=torch.ones(3)), TypeError, "seqlens_new"),
        ("seqlens_new_count", call(seqlens_new=host_ids(1, 1)), ValueError, "seqlens_new"),
        ("past_capacity", call(q=q(s=4), k_new=kv(s=4), v_new=kv(s=4)), ValueError, "max_len"),
    ]
    return [Case(f"kv_attention_{n}", setup, bad, e, m, good) for n, bad, e, m in table]


# ----------------------------------------------------------------------------- the model


@functools.cache
def tiny_model(device: str, dtype: torch.dtype):
    from batchinv.models.qwen3 import Qwen3

    return Qwen3.from_config(seed=0, device=device, dtype=dtype)


def model_cache_cases(where: Device) -> list[Case]:
    """``Qwen3.forward`` with per-layer caches: a failure in any layer's cache is found before
    layer 0 appends (e.g. ``caches[1]`` of the wrong capacity).  The state
    holds good caches and, where a case needs one, a bad layer-1 cache: the bad call runs with
    ``[caches[0], bad]`` and must leave ``caches[0]`` as it was."""
    dtype = where.dtype if where.device == "cuda" else torch.float32
    model = tiny_model(where.device, dtype)
    config = model.config
    heads, head_dim = config.num_key_value_heads, config.head_dim

    def cache(batch=2, max_len=8, kv_heads=heads, dtype_=dtype):
        return KVCache(batch, max_len, kv_heads, head_dim, dtype_, where.device, name="bad layer")

    def skewed():
        made = cache()
        k = randn(2, 1, heads, head_dim, seed=8, dtype=dtype, device=where.device)
        made.append(k, k, new_lengths=host_ids(1, 0))
        return made

    def setup(bad=None, max_len=8, filled=0):
        def make():
            caches = model.new_caches(2, max_len)
            for c in caches:
                c.set_lengths(filled)
            return {"model": model, "caches": caches, "bad": None if bad is None else bad()}

        return make

    def tokens(width=3, offset=0):
        return torch.arange(1 + offset, 1 + offset + 2 * width, device=where.device).view(2, -1)

    # KV-cache forwards are inference (the CUDA cache attention refuses gradients).
    @torch.no_grad()
    def good(state, width=3):
        return state["model"](tokens(width), caches=state["caches"])

    @torch.no_grad()
    def with_bad(state):
        return state["model"](tokens(), caches=[state["caches"][0], state["bad"]])

    def forward(ids=None, **kw):
        @torch.no_grad()
        def run(state):
            return state["model"](tokens() if ids is None else ids, caches=state["caches"], **kw)

        return run

    @torch.no_grad()
    def one_cache(state):
        return state["model"](tokens(), caches=state["caches"][:1])

    near_end = config.max_position_embeddings - 1
    on_device = where.device
    table = [
        (
            "caches1_capacity",
            setup(lambda: cache(max_len=2)),
            with_bad,
            ValueError,
            r"caches\[1\].*max_len=2",
        ),
        ("caches1_heads", setup(lambda: cache(kv_heads=1)), with_bad, ValueError, r"caches\[1\]"),
        (
            "caches1_dtype",
            setup(lambda: cache(dtype_=torch.float16)),
            with_bad,
            TypeError,
            r"caches\[1\]",
        ),
        ("caches1_batch", setup(lambda: cache(batch=3)), with_bad, ValueError, r"caches\[1\]"),
        ("caches1_not_cache", setup(lambda: "cache"), with_bad, TypeError, r"caches\[1\]"),
        ("caches1_lengths_differ", setup(skewed), with_bad, ValueError, r"caches\[1\]"),
        ("caches_count", setup(), one_cache, ValueError, "caches"),
        ("seq_ids_past", setup(), forward(seq_ids=host_ids(0, 5)), IndexError, "seq_ids"),
        ("seq_ids_count", setup(), forward(seq_ids=host_ids(0)), ValueError, "seq_ids"),
        ("seq_ids_float", setup(), forward(seq_ids=torch.zeros(2)), TypeError, "seq_ids"),
        (
            "seqlens_past",
            setup(),
            forward(seqlens=host_ids(1, 4).to(on_device)),
            ValueError,
            "seqlens",
        ),
        (
            "seqlens_float",
            setup(),
            forward(seqlens=torch.ones(2, device=on_device)),
            TypeError,
            "seqlens",
        ),
        ("ids_float", setup(), forward(ids=tokens().float()), TypeError, "input_ids"),
        (
            "ids_past_vocab",
            setup(),
            forward(ids=tokens(offset=config.vocab_size)),
            IndexError,
            "ids",
        ),
    ]
    cases = [Case(f"model_{n}", s, bad, e, m, good) for n, s, bad, e, m in table]
    # Positions past max_position_embeddings: rope raises in layer 0, before its append.
    cases.append(
        Case(
            "model_positions_past_max",
            setup(max_len=near_end + 4, filled=near_end),
            forward(),
            IndexError,
            "position_ids",
            functools.partial(good, width=1),
        )
    )
    return cases


def static_cache_cases(where: Device) -> list[Case]:
    """``attention_with_static_kv_cache``: host checks run before its append."""
    from batchinv.static_kv_cache import attention_with_static_kv_cache, plan_step

    d = where.head_dim

    def setup():
        cache = StaticKVCache(1, 2, MAX_LEN, HKV, d, dtype=where.dtype, device=where.device)
        return {"cache": cache, "status": DeviceStatus(where.device)}

    def plan(state):
        seq_ids = torch.tensor([0, 1], device=where.device)
        seqlens = torch.tensor([2, 1], device=where.device)
        return plan_step(state["cache"], seq_ids, seqlens, 2, state["status"])

    def q(heads=HQ, dim=d, s=2, dtype=None):
        t = randn(2, s, heads, dim, seed=9, dtype=where.dtype, device=where.device)
        return t if dtype is None else t.to(dtype)

    def kv(s=2, heads=HKV, seed=10):
        return randn(2, s, heads, d, seed=seed, dtype=where.dtype, device=where.device)

    def call(**kw):
        def run(state):
            layer = state["cache"].layers()[0]
            args = {"q": q(), "k_new": kv(), "v_new": kv(seed=11)} | kw
            with torch.no_grad():
                return attention_with_static_kv_cache(
                    args.pop("q"), args.pop("k_new"), args.pop("v_new"), layer, plan(state), **args
                )

        return run

    good = call()
    table = [
        ("scale_nan", call(softmax_scale=float("nan")), ValueError, "softmax_scale"),
        ("scale_str", call(softmax_scale="1"), TypeError, "softmax_scale"),
        ("k_new_shape", call(k_new=kv(s=1)), ValueError, "k_new"),
        ("v_new_heads", call(v_new=kv(heads=1)), ValueError, "v_new"),
        ("q_dtype", call(q=q(dtype=torch.float64)), TypeError, "q"),
        ("q_head_dim", call(q=q(dim=d + 2)), ValueError, "q"),
        ("q_vs_plan", call(q=q(s=1), k_new=kv(s=1), v_new=kv(s=1)), ValueError, "plan"),
    ]
    cases = [Case(f"static_{n}", setup, bad, e, m, good) for n, bad, e, m in table]

    def construct(**changed):
        sizes = {"num_layers": 1, "slots": 2, "capacity": MAX_LEN, "num_kv_heads": HKV}
        options = {"head_dim": d, "dtype": where.dtype, "device": where.device}
        arguments = sizes | options | changed
        return lambda state: StaticKVCache(**arguments)

    constructors = [
        ("new_head_dim_odd", construct(head_dim=7), ValueError, "head_dim"),
        ("new_slots_zero", construct(slots=0), ValueError, "slots"),
        ("new_capacity_bool", construct(capacity=True), ValueError, "capacity"),
        ("new_dtype_int", construct(dtype=torch.int32), TypeError, "dtype"),
        ("new_meta", construct(device="meta"), ValueError, "meta"),
    ]
    cases += [Case(f"static_{n}", setup, bad, e, m, good) for n, bad, e, m in constructors]
    return cases
