"""Bit fingerprints: the SHA-256 of every output of a fixed set of inputs, per card.

A fingerprint runs each case of a versioned set (``FINGERPRINT_VERSION``) -- every public op,
forward and backward, at production shapes, and a whole Qwen3 forward, decode and
``token_logprobs`` -- and records the SHA-256 of each output's bytes.  Two machines that
computed the same bits have the same digests, whatever the card; ``compare`` names every case
and output where two fingerprints differ.  ``docs/fingerprints.md`` says what is fingerprinted,
what is promised and which paths are known to depend on the card.

Inputs are the same bits on every machine: each case seeds its own torch CPU generator
(``torch.Generator``, a Mersenne Twister) from its name, draws integers only
(``torch.randint``: no floating-point math that a CPU's vector unit could round differently),
builds each value exactly from them (a 24-bit mantissa times a power of two, exact in fp32),
rounds once to the case's dtype and then moves the tensor to the device.  The SHA-256 of the
inputs is recorded too, so a machine that drew other inputs is told apart from one that
computed other outputs.

Outputs are hashed as their contiguous CPU copy, each element's bytes little-endian.

The module lives in the package (not in ``tools/``): the comparison test and ``batchinv
fingerprint`` on an installed wheel both need it, and a card's fingerprint is most useful
taken with the exact installed build, not a source checkout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

FINGERPRINT_VERSION = 1
CASE_SETS = ("full", "quick")
SCHEMA_KEYS = (
    "fingerprint_version",
    "batchinv_version",
    "case_set",
    "device",
    "commit",
    "build",
    "card",
    "torch",
    "torch_cuda",
    "cases",
)
_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MANTISSA = 2**24 - 1  # |mantissa| < 2**24: exact in fp32
IGNORE_INDEX = -100
PREFILL_LOGITS = 16  # positions of a decode case's prefill whose logits are hashed

__all__ = [
    "CASE_SETS",
    "FINGERPRINT_VERSION",
    "Case",
    "cases",
    "compare",
    "card_slug",
    "fingerprint",
    "load",
    "run_case",
    "tensor_digest",
]


# ----------------------------------------------------------------------------- inputs


def case_seed(name: str) -> int:
    """The seed of a case's generator: from its name and the set's version only."""
    digest = hashlib.sha256(f"batchinv-fingerprint-{FINGERPRINT_VERSION}:{name}".encode())
    return int.from_bytes(digest.digest()[:8], "little") & (2**63 - 1)


# While ``reused_inputs()`` is active: each (case, input)'s CPU tensor and digest, drawn once.
_REUSED: dict[tuple[str, str], list] | None = None


@contextlib.contextmanager
def reused_inputs() -> Iterator[None]:
    """Within the block each case draws its inputs once and reuses them (the same bits: a
    case always draws the same tensors): the cross-path comparison runs each case many times."""
    global _REUSED
    outer = _REUSED
    _REUSED = {} if outer is None else outer
    try:
        yield
    finally:
        _REUSED = outer


class Inputs:
    """A case's input generator: every tensor from one seeded torch CPU generator, built from
    integers only, then moved to ``device``.  ``made`` keeps the CPU tensors (for the digest
    of the inputs), in the order drawn."""

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.generator = torch.Generator().manual_seed(case_seed(name))
        self.device = device
        self.made: dict[str, Tensor] = {}
        self.specs: dict[str, tuple | None] = {}
        self.noted: dict[str, str] = {}  # digests of inputs drawn elsewhere (shared weights)

    def _draw(self, name: str, make: Callable[[], Tensor], spec: tuple | None) -> Tensor:
        """``make()`` (or, under ``reused_inputs``, the tensor an earlier draw of the same case,
        name and ``spec`` made; ``spec=None``: never reused) recorded and moved to the device."""
        if name in self.made:
            raise ValueError(f"input {name!r} drawn twice")
        key = (self.name, name, spec)
        if spec is None:
            t = make()
        elif _REUSED is not None and key in _REUSED:
            t = _REUSED[key][0]
        else:
            t = make()
            if _REUSED is not None:
                _REUSED[key] = [t, None]
        self.made[name] = t
        self.specs[name] = spec
        return t.to(self.device)

    def values(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        scale: float = 1.0,
        *,
        octaves: int = 4,
    ) -> Tensor:
        """Values in ``(-scale, scale)`` (``scale`` a power of two), each a random 24-bit
        mantissa times one of ``octaves`` powers of two, so a reduction over them rounds (as
        real data does: inputs on a coarse grid would make fp32 sums exact in any order)."""
        if scale <= 0 or math.frexp(scale)[0] != 0.5:
            raise ValueError(f"scale must be a positive power of two, got {scale}")

        def make() -> Tensor:
            mantissa = torch.randint(
                -_MANTISSA, _MANTISSA + 1, tuple(shape), generator=self.generator, dtype=torch.int64
            )
            octave = torch.randint(0, octaves, tuple(shape), generator=self.generator)
            # Powers of two written by Python (exact), chosen by index: no pow on tensors.
            powers = torch.tensor([scale * 2.0 ** -(24 + i) for i in range(octaves)])
            exact = mantissa.to(torch.float64) * powers[octave]  # exact: 24 bits times 2**e
            return exact.to(torch.float32).to(dtype)

        return self._draw(name, make, ("values", tuple(shape), str(dtype), scale, octaves))

    def ids(self, name: str, shape: Sequence[int], high: int) -> Tensor:
        """int64 ids in ``[0, high)``."""
        return self._draw(
            name,
            lambda: torch.randint(
                0, high, tuple(shape), generator=self.generator, dtype=torch.int64
            ),
            ("ids", tuple(shape), high),
        )

    def fixed(self, name: str, t: Tensor) -> Tensor:
        """A tensor the case builds itself (positions, lengths), recorded like the others."""
        return self._draw(name, t.cpu, None)

    def _tensor_sha256(self, name: str, t: Tensor) -> str:
        spec = self.specs[name]
        entry = None if _REUSED is None or spec is None else _REUSED.get((self.name, name, spec))
        if entry is not None and entry[1] is not None:
            return entry[1]
        sha = tensor_digest(t)["sha256"]
        if entry is not None:
            entry[1] = sha
        return sha

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, t in self.made.items():
            h.update(name.encode())
            h.update(self._tensor_sha256(name, t).encode())
        for name, digest in self.noted.items():
            h.update(name.encode())
            h.update(digest.encode())
        return h.hexdigest()


def tensor_digest(t: Tensor) -> dict:
    """``{"sha256", "dtype", "shape"}`` of ``t``: the SHA-256 of its contiguous CPU copy's
    bytes, each element little-endian (the integer view of its width, so no value is read as a
    number: NaN payloads and -0.0 count)."""
    cpu = t.detach().to("cpu").contiguous()
    width = cpu.element_size()
    raw = cpu.view(_INT_VIEWS[width]).numpy() if cpu.numel() else cpu.numpy().view("u1")
    if width > 1:
        raw = raw.astype(raw.dtype.newbyteorder("<"), copy=False)
    return {
        "sha256": hashlib.sha256(raw.tobytes()).hexdigest(),
        "dtype": str(cpu.dtype).removeprefix("torch."),
        "shape": list(cpu.shape),
    }


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One fingerprinted computation: an op (a key of ``_RUNNERS``) and its parameters."""

    name: str
    op: str
    params: Mapping = field(default_factory=dict)


@dataclass
class CaseRun:
    """What a case produced: its outputs (name -> tensor) and the path the library took
    (None where an op has one path)."""

    outputs: dict[str, Tensor]
    path: str | None = None


BF16 = "bfloat16"
FP16 = "float16"
FP32 = "float32"

# A small production-shaped Qwen3 (Qwen3-0.6B's widths and vocabulary, 2 layers): every
# GEMM and attention shape of the real model, well under 20 GB on a GPU.
QWEN3_SMALL = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}
QWEN3_TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

# The GPU set: production paths (>= 1024-row GEMMs on the cuBLASLt path, an lm_head-shaped
# GEMM, contexts past the 2048-key split, a decode step, vocab 151936).
FULL_CASES: tuple[Case, ...] = (
    Case(
        "embedding", "embedding", {"vocab": 151936, "hidden": 1024, "tokens": 4099, "dtype": BF16}
    ),
    Case("linear_decode", "linear", {"rows": 3, "in": 4096, "out": 4096, "dtype": BF16}),
    Case("linear_16_rows", "linear", {"rows": 16, "in": 4096, "out": 12288, "dtype": BF16}),
    Case(
        "linear_bias", "linear", {"rows": 257, "in": 1024, "out": 2048, "dtype": BF16, "bias": True}
    ),
    Case("linear_1027_rows", "linear", {"rows": 1027, "in": 4096, "out": 4096, "dtype": BF16}),
    Case("linear_2048_rows_fp16", "linear", {"rows": 2048, "in": 2048, "out": 6144, "dtype": FP16}),
    Case("lm_head", "linear", {"rows": 1024, "in": 1024, "out": 151936, "dtype": BF16}),
    Case("lm_head_decode", "linear", {"rows": 5, "in": 1024, "out": 151936, "dtype": BF16}),
    Case("rms_norm", "rms_norm", {"shape": (4099, 4096), "dtype": BF16}),
    Case("rms_norm_heads", "rms_norm", {"shape": (1027, 8, 128), "dtype": BF16}),
    Case("fused_add_rms_norm", "fused_add_rms_norm", {"shape": (1031, 4096), "dtype": BF16}),
    Case("rope", "rope", {"tokens": 2053, "hq": 32, "hkv": 8, "d": 128, "dtype": BF16}),
    Case("silu_mul", "silu_mul", {"shape": (1029, 12288), "dtype": BF16}),
    Case(
        "attention_varlen",
        "attention_varlen",
        {"lengths": (3000, 517, 1), "hq": 32, "hkv": 8, "d": 128, "dtype": BF16},
    ),
    Case(
        "attention_padded_d64",
        "attention",
        {
            "batch": 3,
            "sq": 300,
            "sk": 300,
            "seqlens": (300, 129, 17),
            "hq": 16,
            "hkv": 4,
            "d": 64,
            "causal": False,
            "dtype": BF16,
        },
    ),
    Case(
        "attention_decode",
        "attention_decode",
        {
            "contexts": (1, 2049, 4500, 130),
            "capacity": 4608,
            "hq": 32,
            "hkv": 8,
            "d": 128,
            "dtype": BF16,
        },
    ),
    Case("log_softmax", "log_softmax", {"rows": 64, "vocab": 151936, "dtype": BF16, "out": FP32}),
    Case(
        "log_softmax_bf16_out",
        "log_softmax",
        {"rows": 16, "vocab": 151936, "dtype": BF16, "out": BF16},
    ),
    Case(
        "log_softmax_fp32_in",
        "log_softmax",
        {"rows": 16, "vocab": 151936, "dtype": FP32, "out": FP32},
    ),
    Case(
        "token_logprobs",
        "token_logprobs",
        {"tokens": 1027, "hidden": 1024, "vocab": 151936, "dtype": BF16},
    ),
    Case("qwen3_forward", "qwen3_forward", {"config": QWEN3_SMALL, "lengths": (2100, 300, 7)}),
    Case(
        "qwen3_decode",
        "qwen3_decode",
        {"config": QWEN3_SMALL, "prompts": (2050, 17, 1), "steps": 2},
    ),
    Case(
        "qwen3_token_logprobs",
        "qwen3_token_logprobs",
        {"config": QWEN3_SMALL, "lengths": (1100, 40), "prompts": (1000, 8)},
    ),
)

# The CPU set (``--quick``): the same ops at small shapes, for the strict references.
QUICK_CASES: tuple[Case, ...] = (
    Case("embedding", "embedding", {"vocab": 97, "hidden": 16, "tokens": 33, "dtype": BF16}),
    Case("linear", "linear", {"rows": 17, "in": 24, "out": 40, "dtype": BF16}),
    Case("linear_bias", "linear", {"rows": 3, "in": 16, "out": 8, "dtype": BF16, "bias": True}),
    Case("rms_norm", "rms_norm", {"shape": (17, 64), "dtype": BF16}),
    Case("fused_add_rms_norm", "fused_add_rms_norm", {"shape": (9, 64), "dtype": BF16}),
    Case("rope", "rope", {"tokens": 11, "hq": 4, "hkv": 2, "d": 64, "dtype": BF16}),
    Case("silu_mul", "silu_mul", {"shape": (9, 40), "dtype": BF16}),
    Case(
        "attention_varlen",
        "attention_varlen",
        {"lengths": (19, 3, 1), "hq": 4, "hkv": 2, "d": 64, "dtype": BF16},
    ),
    Case(
        "attention_padded",
        "attention",
        {
            "batch": 2,
            "sq": 7,
            "sk": 7,
            "seqlens": (7, 3),
            "hq": 4,
            "hkv": 2,
            "d": 64,
            "causal": False,
            "dtype": BF16,
        },
    ),
    Case(
        "attention_decode",
        "attention_decode",
        {"contexts": (1, 20, 9), "capacity": 24, "hq": 4, "hkv": 2, "d": 64, "dtype": BF16},
    ),
    Case("log_softmax", "log_softmax", {"rows": 3, "vocab": 1000, "dtype": BF16, "out": FP32}),
    Case(
        "token_logprobs",
        "token_logprobs",
        {"tokens": 9, "hidden": 32, "vocab": 300, "dtype": BF16},
    ),
    Case("qwen3_forward", "qwen3_forward", {"config": QWEN3_TINY, "lengths": (13, 5)}),
    Case("qwen3_decode", "qwen3_decode", {"config": QWEN3_TINY, "prompts": (9, 2), "steps": 2}),
    Case(
        "qwen3_token_logprobs",
        "qwen3_token_logprobs",
        {"config": QWEN3_TINY, "lengths": (12, 6), "prompts": (5, 2)},
    ),
)


def cases(case_set: str) -> tuple[Case, ...]:
    """The cases of ``case_set``: ``"full"`` (the GPU set) or ``"quick"`` (the CPU set)."""
    if case_set == "full":
        return FULL_CASES
    if case_set == "quick":
        return QUICK_CASES
    raise ValueError(f"case_set must be one of {CASE_SETS}, got {case_set!r}")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _backward(outputs: Sequence[Tensor], leaves: Mapping[str, Tensor], inputs: Inputs) -> dict:
    """Backpropagates seeded cotangents of ``outputs`` into ``leaves``; their ``grad_*``."""
    grads = [inputs.values(f"cotangent_{i}", out.shape, out.dtype) for i, out in enumerate(outputs)]
    torch.autograd.backward(list(outputs), grads)
    return {f"grad_{name}": leaf.grad for name, leaf in leaves.items()}


def _leaf(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(True)


def _run_embedding(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    weight = _leaf(inputs.values("weight", (p["vocab"], p["hidden"]), _dtype(p["dtype"])))
    ids = inputs.ids("ids", (p["tokens"],), p["vocab"])
    out = batchinv.embedding(ids, weight)
    return CaseRun({"out": out, **_backward([out], {"weight": weight}, inputs)})


def _linear_path(x: Tensor, weight: Tensor, bias: Tensor | None) -> str:
    import batchinv

    path = batchinv.linear_path(x, weight, bias)
    if path == "reference":
        return path
    from .gpu import linear as gpu_linear

    return gpu_linear.describe(math.prod(x.shape[:-1]), weight.shape[0], path, x.device)


def _run_linear(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    dtype = _dtype(p["dtype"])
    x = _leaf(inputs.values("x", (p["rows"], p["in"]), dtype))
    weight = _leaf(
        inputs.values(
            "weight", (p["out"], p["in"]), dtype, 2.0 ** -math.ceil(math.log2(math.sqrt(p["in"])))
        )
    )
    leaves = {"x": x, "weight": weight}
    bias = None
    if p.get("bias"):
        bias = leaves["bias"] = _leaf(inputs.values("bias", (p["out"],), dtype))
    path = _linear_path(x, weight, bias)
    out = batchinv.linear(x, weight, bias)
    return CaseRun({"out": out, **_backward([out], leaves, inputs)}, path)


def _run_rms_norm(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    dtype = _dtype(p["dtype"])
    x = _leaf(inputs.values("x", p["shape"], dtype, 4.0))
    weight = _leaf(inputs.values("weight", p["shape"][-1:], dtype, 2.0))
    out = batchinv.rms_norm(x, weight, 1e-6)
    return CaseRun({"out": out, **_backward([out], {"x": x, "weight": weight}, inputs)})


def _run_fused_add_rms_norm(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    dtype = _dtype(p["dtype"])
    x = _leaf(inputs.values("x", p["shape"], dtype, 4.0))
    residual = _leaf(inputs.values("residual", p["shape"], dtype, 4.0))
    weight = _leaf(inputs.values("weight", p["shape"][-1:], dtype, 2.0))
    out, new_residual = batchinv.fused_add_rms_norm(x, residual, weight, 1e-6)
    leaves = {"x": x, "residual": residual, "weight": weight}
    grads = _backward([out, new_residual], leaves, inputs)
    return CaseRun({"out": out, "residual": new_residual, **grads})


def _run_rope(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    dtype = _dtype(p["dtype"])
    q = _leaf(inputs.values("q", (p["tokens"], p["hq"], p["d"]), dtype, 4.0))
    k = _leaf(inputs.values("k", (p["tokens"], p["hkv"], p["d"]), dtype, 4.0))
    positions = inputs.ids("positions", (p["tokens"],), 32768)
    q_rot, k_rot = batchinv.rope(q, k, positions, theta=1_000_000.0, max_position=32768)
    grads = _backward([q_rot, k_rot], {"q": q, "k": k}, inputs)
    return CaseRun({"q": q_rot, "k": k_rot, **grads})


def _run_silu_mul(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    dtype = _dtype(p["dtype"])
    gate = _leaf(inputs.values("gate", p["shape"], dtype, 8.0))
    up = _leaf(inputs.values("up", p["shape"], dtype, 4.0))
    out = batchinv.silu_mul(gate, up)
    fused = batchinv.silu_mul_fused(torch.cat([gate, up], dim=-1).detach())
    grads = _backward([out], {"gate": gate, "up": up}, inputs)
    return CaseRun({"out": out, "fused": fused, **grads})


def _attention_path(bounds, hq: int, hkv: int, device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    from .gpu import attention as gpu_attention

    return gpu_attention.path_for(bounds, hq, hkv, device)


def _qkv(p: Mapping, inputs: Inputs, q_shape, kv_shape) -> tuple[Tensor, Tensor, Tensor]:
    dtype = _dtype(p["dtype"])
    q = _leaf(inputs.values("q", q_shape, dtype, 4.0))
    k = _leaf(inputs.values("k", kv_shape, dtype, 4.0))
    v = _leaf(inputs.values("v", kv_shape, dtype, 4.0))
    return q, k, v


def _run_attention_varlen(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    total = sum(p["lengths"])
    q, k, v = _qkv(p, inputs, (total, p["hq"], p["d"]), (total, p["hkv"], p["d"]))
    cu = torch.tensor([0, *p["lengths"]]).cumsum(0)
    inputs.fixed("cu_seqlens", cu)
    path = None
    if q.device.type == "cuda":
        from .gpu import attention as gpu_attention

        path = _attention_path(gpu_attention.varlen_bounds(cu, cu), p["hq"], p["hkv"], q.device)
    out, lse = batchinv.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    grads = _backward([out], {"q": q, "k": k, "v": v}, inputs)
    return CaseRun({"out": out, "lse": lse, **grads}, path)


def _run_attention(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    b, sq, sk = p["batch"], p["sq"], p["sk"]
    q, k, v = _qkv(p, inputs, (b, sq, p["hq"], p["d"]), (b, sk, p["hkv"], p["d"]))
    seqlens = inputs.fixed("seqlens", torch.tensor(p["seqlens"]))
    seqlens = seqlens.to(q.device)
    path = None
    if q.device.type == "cuda":
        from .gpu import attention as gpu_attention

        path = _attention_path(gpu_attention.padded_bounds(q, k), p["hq"], p["hkv"], q.device)
    out, lse = batchinv.attention(
        q, k, v, causal=p["causal"], seqlens_q=seqlens, seqlens_k=seqlens, return_lse=True
    )
    grads = _backward([out], {"q": q, "k": k, "v": v}, inputs)
    return CaseRun({"out": out, "lse": lse, **grads}, path)


def _run_attention_decode(p: Mapping, inputs: Inputs) -> CaseRun:
    """One decode step per sequence after a prefill of ``contexts[i] - 1`` keys."""
    import batchinv

    contexts = p["contexts"]
    batch, hq, hkv, d = len(contexts), p["hq"], p["hkv"], p["d"]
    dtype = _dtype(p["dtype"])
    device = inputs.device
    cache = batchinv.KVCache(batch, p["capacity"], hkv, d, dtype, device)
    longest = max(contexts) - 1
    if longest > 0:
        k_prefix = inputs.values("k_prefix", (batch, longest, hkv, d), dtype, 4.0)
        v_prefix = inputs.values("v_prefix", (batch, longest, hkv, d), dtype, 4.0)
        cache.append(k_prefix, v_prefix, None, torch.tensor([c - 1 for c in contexts]))
    q = inputs.values("q", (batch, 1, hq, d), dtype, 4.0)
    k_new = inputs.values("k_new", (batch, 1, hkv, d), dtype, 4.0)
    v_new = inputs.values("v_new", (batch, 1, hkv, d), dtype, 4.0)
    path = None
    if device.type == "cuda":
        from .gpu import attention as gpu_attention

        path = _attention_path(gpu_attention.kv_cache_bounds(q, cache), hq, hkv, device)
    out, lse = batchinv.attention_with_kv_cache(q, k_new, v_new, cache, return_lse=True)
    return CaseRun({"out": out, "lse": lse}, path)


def _run_log_softmax(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    dtype, out_dtype = _dtype(p["dtype"]), _dtype(p["out"])
    x = _leaf(inputs.values("x", (p["rows"], p["vocab"]), dtype, 16.0))
    path = None
    if x.device.type == "cuda":
        from .gpu import log_softmax as gpu_log_softmax

        path = gpu_log_softmax.forward_path(x, out_dtype)
    out = batchinv.log_softmax(x, -1, out_dtype)
    return CaseRun({"out": out, **_backward([out], {"x": x}, inputs)}, path)


def _run_token_logprobs(p: Mapping, inputs: Inputs) -> CaseRun:
    import batchinv

    dtype = _dtype(p["dtype"])
    hidden = _leaf(inputs.values("hidden", (p["tokens"], p["hidden"]), dtype, 4.0))
    weight = _leaf(
        inputs.values(
            "weight",
            (p["vocab"], p["hidden"]),
            dtype,
            2.0 ** -math.ceil(math.log2(math.sqrt(p["hidden"]))),
        )
    )
    targets = inputs.ids("targets", (p["tokens"],), p["vocab"])
    ignored = torch.arange(p["tokens"], device=targets.device) % 7 == 0
    targets = torch.where(ignored, IGNORE_INDEX, targets)  # give 0 and no gradient
    logprobs, entropy = batchinv.token_logprobs(
        hidden, weight, targets, IGNORE_INDEX, return_entropy=True
    )
    grads = _backward([logprobs, entropy], {"hidden": hidden, "weight": weight}, inputs)
    return CaseRun({"logprobs": logprobs, "entropy": entropy, **grads})


# Models by (config, device), kept while a fingerprint runs: the Qwen3 cases of one config
# share their weights (drawn once; their digest is part of each case's inputs digest).
_MODELS: dict[tuple[str, str], tuple[object, str]] = {}


def _qwen3_model(p: Mapping, inputs: Inputs):
    """A Qwen3 of ``p["config"]`` with bf16 weights drawn like every other input, from a
    generator named after the config (so the Qwen3 cases of one config share them)."""
    from .models.qwen3 import Qwen3, Qwen3Config
    from .reference.qwen3_chain import qwen3_state_dict_shapes

    config = Qwen3Config(**p["config"])
    key = (json.dumps(p["config"], sort_keys=True), str(inputs.device))
    if key not in _MODELS:
        weights = Inputs(f"qwen3 weights {key[0]}", inputs.device)
        state = {}
        for name, shape in qwen3_state_dict_shapes(config).items():
            if name.endswith("norm.weight"):  # around 1, so every norm weight matters
                drawn = weights.values(name, shape, torch.float32, 0.25)
                state[name] = (1.0 + drawn).to(torch.bfloat16)
            elif len(shape) == 1:
                state[name] = weights.values(name, shape, torch.bfloat16, 0.125)
            elif name == "model.embed_tokens.weight":
                state[name] = weights.values(name, shape, torch.bfloat16, 1.0)
            else:  # |w| below the power of two at or above 1/sqrt(fan_in): activations keep scale
                scale = 2.0 ** -math.floor(math.log2(math.sqrt(shape[1])))
                state[name] = weights.values(name, shape, torch.bfloat16, scale)
        digest = weights.digest()
        weights.made.clear()
        _MODELS[key] = (Qwen3(config, state), digest)
    model, digest = _MODELS[key]
    inputs.noted["weights"] = digest
    return model, config


def _sequences(p: Mapping, inputs: Inputs, vocab: int, key: str) -> list[Tensor]:
    return [inputs.ids(f"{key}_{i}", (n,), vocab) for i, n in enumerate(p[key])]


@torch.no_grad()
def _run_qwen3_forward(p: Mapping, inputs: Inputs) -> CaseRun:
    model, config = _qwen3_model(p, inputs)
    seqs = _sequences(p, inputs, config.vocab_size, "lengths")
    cu = torch.tensor([0, *p["lengths"]]).cumsum(0).to(inputs.device)
    logits = model(torch.cat(seqs), cu_seqlens=cu)
    return CaseRun({"logits": logits})


@torch.no_grad()
def _run_qwen3_decode(p: Mapping, inputs: Inputs) -> CaseRun:
    """Prefills each prompt into its cache slot, then decodes ``steps`` tokens for all slots
    at once (the greedy token of each step is fed back)."""
    model, config = _qwen3_model(p, inputs)
    prompts = _sequences(p, inputs, config.vocab_size, "prompts")
    capacity = max(p["prompts"]) + p["steps"]
    caches = model.new_caches(len(prompts), capacity)
    outputs = {}
    last = []
    for slot, prompt in enumerate(prompts):
        ids = torch.tensor([slot])
        logits = model(prompt[None], caches=caches, seq_ids=ids)
        outputs[f"prefill_{slot}"] = logits[:, -PREFILL_LOGITS:]  # qwen3_forward has them all
        last.append(logits[0, -1].float().argmax())
    tokens = torch.stack(last)[:, None]
    for step in range(p["steps"]):
        logits = model(tokens, caches=caches)
        outputs[f"decode_{step}"] = logits
        tokens = logits[:, -1].float().argmax(-1)[:, None]
    return CaseRun(outputs)


@torch.no_grad()
def _run_qwen3_token_logprobs(p: Mapping, inputs: Inputs) -> CaseRun:
    model, config = _qwen3_model(p, inputs)
    seqs = _sequences(p, inputs, config.vocab_size, "lengths")
    logprobs = model.token_logprobs(seqs, list(p["prompts"]))
    return CaseRun({f"logprobs_{i}": t for i, t in enumerate(logprobs)})


_RUNNERS: dict[str, Callable[[Mapping, Inputs], CaseRun]] = {
    "embedding": _run_embedding,
    "linear": _run_linear,
    "rms_norm": _run_rms_norm,
    "fused_add_rms_norm": _run_fused_add_rms_norm,
    "rope": _run_rope,
    "silu_mul": _run_silu_mul,
    "attention": _run_attention,
    "attention_varlen": _run_attention_varlen,
    "attention_decode": _run_attention_decode,
    "log_softmax": _run_log_softmax,
    "token_logprobs": _run_token_logprobs,
    "qwen3_forward": _run_qwen3_forward,
    "qwen3_decode": _run_qwen3_decode,
    "qwen3_token_logprobs": _run_qwen3_token_logprobs,
}


def run_case(case: Case, device: torch.device | str) -> dict:
    """Runs ``case`` on ``device``: ``{"op", "inputs_sha256", "path", "outputs"}`` with each
    output's ``tensor_digest``; an op that cannot run here gives ``{"op", "error"}``."""
    device = torch.device(device)
    inputs = Inputs(case.name, device)
    entry: dict = {"op": case.op}
    try:
        result = _RUNNERS[case.op](case.params, inputs)
    except (RuntimeError, TypeError, ValueError) as err:  # e.g. no kernel for this card
        entry["inputs_sha256"] = inputs.digest()
        entry["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
        return entry
    entry["inputs_sha256"] = inputs.digest()
    entry["path"] = result.path if device.type == "cuda" else "reference"
    entry["outputs"] = {name: tensor_digest(t) for name, t in result.outputs.items()}
    return entry


# ----------------------------------------------------------------------------- the file


def card_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"


def card_slug(name: str) -> str:
    """The file name stem of a card's fingerprint: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _card(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": "CPU"}
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
    }


def _build() -> dict | None:
    from .runtime import NativeModuleMissingError, build_info

    try:
        return dict(build_info())
    except NativeModuleMissingError:  # a source checkout never built: the references ran
        return None


def fingerprint(
    device: torch.device | str = "cuda",
    case_set: str | None = None,
    *,
    only: Sequence[str] | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> dict:
    """The fingerprint of this machine's ``device``: provenance and one entry per case (see
    ``run_case``).  ``case_set`` defaults to ``"full"`` on CUDA and ``"quick"`` on the CPU;
    ``only`` restricts it to the named cases; ``progress(name, seconds)`` follows each case."""
    import batchinv

    from .provenance import source_commit

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    case_set = case_set or ("full" if device.type == "cuda" else "quick")
    selected = cases(case_set)
    if only is not None:
        unknown = sorted(set(only) - {c.name for c in selected})
        if unknown:
            raise ValueError(f"no case named {', '.join(unknown)} in the {case_set!r} set")
        selected = tuple(c for c in selected if c.name in set(only))
    results = {}
    try:
        for case in selected:
            start = time.perf_counter()
            results[case.name] = run_case(case, device)
            if progress is not None:
                progress(case.name, time.perf_counter() - start)
    finally:
        _MODELS.clear()
    return {
        "fingerprint_version": FINGERPRINT_VERSION,
        "batchinv_version": batchinv.__version__,
        "case_set": case_set,
        "device": device.type,
        "commit": source_commit(_PROJECT_ROOT),
        "build": _build(),
        "card": _card(device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cases": results,
    }


def write(result: Mapping, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    return target


def load(path: str | Path) -> dict:
    """A fingerprint file, checked against the schema (``ValueError`` naming what is wrong)."""
    data = json.loads(Path(path).read_text())
    check_schema(data, str(path))
    return data


def check_schema(data: object, source: str = "fingerprint") -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: not a JSON object")
    missing = [key for key in SCHEMA_KEYS if key not in data]
    if missing:
        raise ValueError(f"{source}: missing keys {', '.join(missing)}")
    if data["case_set"] not in CASE_SETS:
        raise ValueError(f"{source}: unknown case_set {data['case_set']!r}")
    if not isinstance(data["cases"], dict):
        raise ValueError(f"{source}: cases must be an object")
    for name, entry in data["cases"].items():
        if not isinstance(entry, dict) or "op" not in entry or "inputs_sha256" not in entry:
            raise ValueError(f"{source}: case {name!r} lacks op or inputs_sha256")
        if ("outputs" in entry) == ("error" in entry):
            raise ValueError(f"{source}: case {name!r} must hold either outputs or an error")
        for output, digest in entry.get("outputs", {}).items():
            if not isinstance(digest, dict) or not {"sha256", "dtype", "shape"} <= set(digest):
                raise ValueError(f"{source}: output {name}.{output} lacks sha256, dtype or shape")


def comparable(a: Mapping, b: Mapping) -> str | None:
    """None when two fingerprints may be compared case by case, else why not: another
    fingerprint version, batchinv version or case set."""
    for key in ("fingerprint_version", "batchinv_version", "case_set"):
        if a[key] != b[key]:
            return f"{key} differs: {a[key]!r} vs {b[key]!r}"
    return None


@dataclass(frozen=True)
class Difference:
    """One place where two fingerprints disagree: a case (and output, where one is named)."""

    case: str
    output: str | None
    what: str

    def __str__(self) -> str:
        where = self.case if self.output is None else f"{self.case}.{self.output}"
        return f"{where}: {self.what}"


def compare(a: Mapping, b: Mapping) -> list[Difference]:
    """Every case and output where fingerprints ``a`` and ``b`` differ (empty: the same bits
    everywhere).  A case only one of them ran, an error, other inputs (``inputs_sha256``) and
    each output whose digest, dtype or shape differs are each named."""
    diffs = []
    cases_a, cases_b = a["cases"], b["cases"]
    for name in sorted(set(cases_a) | set(cases_b)):
        if name not in cases_b or name not in cases_a:
            side = "first" if name in cases_a else "second"
            diffs.append(Difference(name, None, f"only in the {side} fingerprint"))
            continue
        ca, cb = cases_a[name], cases_b[name]
        if ca.get("inputs_sha256") != cb.get("inputs_sha256"):
            diffs.append(Difference(name, None, "inputs differ (another input generator)"))
            continue
        if "error" in ca or "error" in cb:
            if ca.get("error") != cb.get("error"):
                diffs.append(
                    Difference(name, None, f"error: {ca.get('error')!r} vs {cb.get('error')!r}")
                )
            continue
        outs_a, outs_b = ca["outputs"], cb["outputs"]
        for output in sorted(set(outs_a) | set(outs_b)):
            da, db = outs_a.get(output), outs_b.get(output)
            if da is None or db is None:
                side = "first" if db is None else "second"
                diffs.append(Difference(name, output, f"only in the {side} fingerprint"))
            elif (da["dtype"], da["shape"]) != (db["dtype"], db["shape"]):
                diffs.append(
                    Difference(
                        name,
                        output,
                        f"{da['dtype']}{da['shape']} vs {db['dtype']}{db['shape']}",
                    )
                )
            elif da["sha256"] != db["sha256"]:
                paths = ""
                if ca.get("path") != cb.get("path"):
                    paths = f" (paths {ca.get('path')!r} vs {cb.get('path')!r})"
                diffs.append(Difference(name, output, "bits differ" + paths))
    return diffs


# ----------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class PathVariant:
    """A code path forced on this card: the path another card's default would take, or another
    variant of this card's.  ``ops``: the ops whose cases it changes; ``context`` forces it
    for the duration of a ``with`` block."""

    name: str
    ops: frozenset[str]
    context: Callable[[], contextlib.AbstractContextManager]
    why: str


@contextlib.contextmanager
def _patched(module, **values) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def forced_linear_path(path: str) -> Iterator[None]:
    """``batchinv.set_linear_path(path)`` for the block, then back to the setting before."""
    from .gpu import linear_cublaslt

    saved = linear_cublaslt._chosen
    linear_cublaslt.set_path(path)
    try:
        yield
    finally:
        linear_cublaslt._chosen = saved


@contextlib.contextmanager
def linear_family(family: str, config=None) -> Iterator[None]:
    """Every product of batchinv's own linear kernels on ``family`` (``"mma"``: the sm_80
    kernels; ``"hopper"`` / ``"small_m"`` with ``config``), cuBLASLt off."""
    from .gpu import linear as gpu_linear

    def forced(m: int, n: int, device_index: int):
        return family, config

    with forced_linear_path("own"), _patched(gpu_linear, _auto_choice=forced):
        yield


@contextlib.contextmanager
def attention_options(**options) -> Iterator[None]:
    """Every attention forward launch with ``options`` (``batchinv.gpu.attention.forward``'s
    ``mode``, ``warps``, ``coop``, ``hopper``, ``tma``, ``pdl``)."""
    from .gpu import attention as gpu_attention

    original = gpu_attention.forward
    with _patched(gpu_attention, forward=functools.partial(original, **options)):
        yield


@contextlib.contextmanager
def attention_backward_kernels(variant: str = "tiled", wgmma: bool = True) -> Iterator[None]:
    """The attention backward on ``variant``'s kernels; ``wgmma=False``: the mma.sync ones
    where the sm_90a wgmma kernels would run."""
    from .gpu import attention_backward

    with _patched(
        attention_backward,
        KERNEL_VARIANT=variant,
        USE_WGMMA_DKDV=wgmma,
        USE_WGMMA_DQ=wgmma,
    ):
        yield


@contextlib.contextmanager
def log_softmax_form(cluster: bool = True) -> Iterator[None]:
    """log_softmax's forms: ``cluster=False`` the one-CTA form with the same T, which is what
    a card without the sm_90a cluster form runs (T never follows the card)."""
    from .gpu import log_softmax as gpu_log_softmax

    with _patched(gpu_log_softmax, USE_CLUSTER=cluster):
        yield


@contextlib.contextmanager
def sm_count(count: int) -> Iterator[None]:
    """Every launch decision that reads the SM count (``batchinv.runtime.multiprocessors``:
    the linear tile choice, attention's mode and pipeline depth, the Hopper attention grid)
    made as on a card with ``count`` SMs; cached decisions (linear's per-shape choice,
    attention's plans) are bypassed for the block."""
    from .gpu import attention as gpu_attention
    from .gpu import attention_hopper
    from .gpu import linear as gpu_linear

    def multiprocessors(index: int | None = None) -> int:
        return count

    with (
        _patched(
            gpu_linear,
            multiprocessors=multiprocessors,
            _auto_choice=gpu_linear._auto_choice.__wrapped__,
        ),
        _patched(gpu_attention, multiprocessors=multiprocessors, _PLANS={}),
        _patched(attention_hopper, multiprocessors=multiprocessors),
    ):
        yield


# SM counts of other cards: H20, A100, H100 PCIe; and a small one, far from any.
A100_SMS = 108
OTHER_SM_COUNTS = (78, A100_SMS, 114, 16)


@contextlib.contextmanager
def sm80_paths() -> Iterator[None]:
    """Everything an sm_80 card (A100) runs where this card has a choice: the mma.sync linear,
    the mma.sync attention kernels without TMA or PDL, the mma.sync backward, log_softmax's
    one-CTA T, rms_norm's backward without programmatic dependent launch, the launch
    decisions of its 108 SMs.  (token_logprobs
    has no sm_80 kernel: it still runs the sm_90a one here.)"""
    from .gpu import rms_norm as gpu_rms_norm

    with (
        sm_count(A100_SMS),
        _patched(gpu_rms_norm, _programmatic=lambda device: False),
        linear_family("mma"),
        attention_options(hopper=False, tma=False, pdl=False),
        attention_backward_kernels("tiled", wgmma=False),
        log_softmax_form(cluster=False),
    ):
        yield


_MODEL_OPS = frozenset({"qwen3_forward", "qwen3_decode", "qwen3_token_logprobs"})
_LINEAR_OPS = frozenset({"linear"}) | _MODEL_OPS
_ATTENTION_OPS = frozenset({"attention", "attention_varlen", "attention_decode"}) | _MODEL_OPS
_ATTENTION_BACKWARD_OPS = frozenset({"attention", "attention_varlen"})
_LOG_SOFTMAX_OPS = frozenset({"log_softmax"})


def path_variants() -> tuple[PathVariant, ...]:
    """The paths the cross-path comparison forces on this card (CUDA): the sm_80 families,
    each compiled Hopper configuration and variant, cuBLASLt and batchinv's own GEMM."""
    from .gpu import linear as gpu_linear

    variants = [
        PathVariant(
            "linear:own", _LINEAR_OPS, lambda: forced_linear_path("own"), "batchinv's GEMM"
        ),
        PathVariant(
            "linear:cublaslt",
            _LINEAR_OPS,
            lambda: forced_linear_path("cublaslt"),
            "cuBLASLt's pinned algorithm where it serves (NVIDIA's kernel)",
        ),
        PathVariant("linear:mma", _LINEAR_OPS, lambda: linear_family("mma"), "the sm_80 GEMM"),
    ]
    # Each configuration on the linear cases only (the families above also run the models).
    for config in gpu_linear.hopper_configs():
        variants.append(
            PathVariant(
                f"linear:hopper {config}",
                frozenset({"linear"}),
                functools.partial(linear_family, "hopper", config),
                "a Hopper tile configuration",
            )
        )
    for config in gpu_linear.small_m_configs():
        variants.append(
            PathVariant(
                f"linear:{config}",
                frozenset({"linear"}),
                functools.partial(linear_family, "small_m", config),
                "a small-M configuration",
            )
        )
    attention = (
        ("hopper=False", {"hopper": False}, "the mma.sync tile kernel (sm_80)"),
        ("tile", {"mode": "tile"}, "one CTA walks all KV splits"),
        ("split", {"mode": "split"}, "one CTA per KV split, then the combine"),
        ("split coop=False", {"mode": "split", "coop": False}, "the one-warp split kernel"),
        ("tma=False", {"tma": False}, "cp.async instead of TMA (sm_80)"),
        ("pdl=False", {"pdl": False}, "a stream-ordered combine (sm_80)"),
        ("warps=4", {"warps": 4}, "64-row tiles"),
        ("stages=3", {"stages": 3}, "a deeper cooperative K/V pipeline"),
    )
    for name, options, why in attention:
        variants.append(
            PathVariant(
                f"attention:{name}",
                _ATTENTION_OPS,
                functools.partial(attention_options, **options),
                why,
            )
        )
    variants.append(
        PathVariant(
            "attention_backward:mma",
            _ATTENTION_BACKWARD_OPS,
            functools.partial(attention_backward_kernels, "tiled", False),
            "the mma.sync backward kernels (sm_80)",
        )
    )
    for variant in ("async", "ldsm", "lds"):
        variants.append(
            PathVariant(
                f"attention_backward:{variant}",
                _ATTENTION_BACKWARD_OPS,
                functools.partial(attention_backward_kernels, variant, False),
                "another backward kernel variant",
            )
        )
    for count in OTHER_SM_COUNTS:
        variants.append(
            PathVariant(
                f"sm_count={count}",
                _LINEAR_OPS | _ATTENTION_OPS,
                functools.partial(sm_count, count),
                "the launch decisions a card with this many SMs makes",
            )
        )
    variants += [
        PathVariant(
            "log_softmax:one-cta",
            _LOG_SOFTMAX_OPS,
            functools.partial(log_softmax_form, cluster=False),
            "the one-CTA form with the same T (what a card without clusters runs)",
        ),
        PathVariant(
            "sm80",
            frozenset(_RUNNERS) - {"token_logprobs"},
            sm80_paths,
            "every sm_80 path at once (an A100's defaults)",
        ),
    ]
    return tuple(variants)


# What the cross-path comparison is known to find different, by (case, variant): each entry
# says why.  Everything else must give the default path's bits.  None today.
KNOWN_PATH_DIFFERENCES: dict[tuple[str, str], str] = {}


# Cases whose bits, or whether they run at all, depend on the card's architecture (compute
# capability): two fingerprints of different architectures may differ here, and only here.
ARCHITECTURE_DEPENDENT_CASES: dict[str, str] = {
    case: "the fused token_logprobs kernel exists for sm_90a only; elsewhere it raises"
    for case in ("token_logprobs", "qwen3_token_logprobs")
}


def architecture_exceptions(a: Mapping, b: Mapping) -> dict[str, str]:
    """``ARCHITECTURE_DEPENDENT_CASES`` when fingerprints ``a`` and ``b`` come from cards of
    different compute capabilities (or one from the CPU), else nothing: on one architecture
    every case must give the same bits."""
    if a["card"].get("compute_capability") == b["card"].get("compute_capability"):
        return {}
    return dict(ARCHITECTURE_DEPENDENT_CASES)


def cross_path(
    device: torch.device | str = "cuda",
    selected: Sequence[Case] | None = None,
    variants: Sequence[PathVariant] | None = None,
) -> dict:
    """Runs each case under its default path and under every variant that touches its op;
    ``{variant: {case: "same" | "differs: <outputs>" | "not applicable: <error>"}}``."""
    device = torch.device(device)
    selected = FULL_CASES if selected is None else selected
    variants = path_variants() if variants is None else variants
    table: dict[str, dict[str, str]] = {}
    try:
        with reused_inputs():
            baseline = {case.name: run_case(case, device) for case in selected}
            for variant in variants:
                table[variant.name] = run_variant(variant, baseline, device, selected)
    finally:
        _MODELS.clear()
    return {"baseline": baseline, "variants": table}


def run_variant(
    variant: PathVariant,
    baseline: Mapping[str, Mapping],
    device: torch.device | str,
    selected: Sequence[Case],
) -> dict[str, str]:
    """``{case: verdict}`` of the cases ``variant`` touches, each against its ``baseline``
    entry (``run_case`` on the default path)."""
    row = {}
    for case in selected:
        if case.op in variant.ops:
            with variant.context():
                entry = run_case(case, torch.device(device))
            row[case.name] = _verdict(baseline[case.name], entry)
    return row


def _verdict(base: Mapping, entry: Mapping) -> str:
    if "error" in base:
        return f"not applicable: the default path fails: {base['error']}"
    if "error" in entry:
        return f"not applicable: {entry['error']}"
    differing = [
        name
        for name, digest in base["outputs"].items()
        if entry["outputs"].get(name, {}).get("sha256") != digest["sha256"]
    ]
    return "same" if not differing else "differs: " + ", ".join(differing)


def unexpected_differences(table: Mapping[str, Mapping[str, str]]) -> list[str]:
    """``"variant / case: verdict"`` for every difference not in ``KNOWN_PATH_DIFFERENCES``."""
    return [
        f"{variant} / {case}: {verdict}"
        for variant, row in table.items()
        for case, verdict in row.items()
        if verdict.startswith("differs") and (case, variant) not in KNOWN_PATH_DIFFERENCES
    ]


# ----------------------------------------------------------------------------- command line


def add_arguments(parser) -> None:
    parser.add_argument(
        "--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the small CPU case set (default on the CPU; the full set on CUDA)",
    )
    parser.add_argument(
        "--case",
        action="append",
        default=None,
        metavar="NAME",
        help="only this case (repeatable)",
    )
    parser.add_argument(
        "--paths",
        action="store_true",
        help="also run every case under each code path other cards take (CUDA) and report "
        "which agree with this card's default",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="OUT",
        help="write the fingerprint here (committed ones: reports/fingerprints/<card>.json)",
    )


def _summary(result: Mapping) -> str:
    card = result["card"]["name"]
    lines = [
        f"batchinv {result['batchinv_version']} fingerprint v{result['fingerprint_version']} "
        f"({result['case_set']} set) on {card}, commit {result['commit']}"
    ]
    for name, entry in result["cases"].items():
        if "error" in entry:
            lines.append(f"  {name:24s} ERROR {entry['error']}")
            continue
        first = next(iter(entry["outputs"].values()))["sha256"][:16]
        path = entry.get("path") or ""
        lines.append(f"  {name:24s} {first}  {len(entry['outputs'])} outputs  {path}")
    return "\n".join(lines)


def _paths_summary(table: Mapping[str, Mapping[str, str]]) -> str:
    lines = ["code paths against this card's default:"]
    for variant, row in table.items():
        for case, verdict in row.items():
            known = KNOWN_PATH_DIFFERENCES.get((case, variant))
            note = f"  (known: {known})" if known and verdict.startswith("differs") else ""
            lines.append(f"  {variant:34s} {case:24s} {verdict}{note}")
    return "\n".join(lines)


def run(args) -> int:
    """``batchinv fingerprint``: 0 done (and, with ``--paths``, no unexpected difference),
    1 a path differs where no difference is known, 2 bad input."""
    import sys

    prog = "batchinv fingerprint"
    try:
        name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(name)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {name!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {name} was asked for, but CUDA is not available")
        if args.paths and device.type != "cuda":
            raise ValueError("--paths compares the CUDA code paths: it needs --device cuda")
        case_set = "quick" if args.quick else None
        set_name = case_set or ("full" if device.type == "cuda" else "quick")
        known = {c.name for c in cases(set_name)}
        unknown = sorted(set(args.case or ()) - known)
        if unknown:
            raise ValueError(
                f"--case {', '.join(unknown)}: not in the {set_name!r} set "
                f"({', '.join(sorted(known))})"
            )
    except (RuntimeError, ValueError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2

    def progress(case: str, seconds: float) -> None:
        print(f"  {case}: {seconds:.1f} s", file=sys.stderr)

    result = fingerprint(device, case_set, only=args.case, progress=progress)
    print(_summary(result))
    status = 0
    if args.paths:
        selected = tuple(c for c in cases(set_name) if args.case is None or c.name in args.case)
        table = cross_path(device, selected)["variants"]
        result["cross_path"] = table
        print(_paths_summary(table))
        unexpected = unexpected_differences(table)
        for line in unexpected:
            print(f"UNEXPECTED: {line}")
        status = 1 if unexpected else 0
    if args.json:
        write(result, args.json)
        print(f"JSON written to {args.json}")
    return status
