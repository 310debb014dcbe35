"""The sampler: decode steps on a static KV cache, replayed from CUDA graphs per batch bucket.

``Qwen3DecodeRunner`` holds a ``StaticKVCache`` of ``max_batch`` slots and runs the model's own
chain (``qwen3_final_hidden``) with an op table whose steps read every changing value from the
device: token ids (the last sampled token of each slot, kept on the device), positions and
lengths (the cache's device lengths).  So one step is the same sequence of kernel launches
with the same arguments whatever the step, and is captured once per *bucket* (a batch size in
``buckets``); a step of ``n`` slots replays the smallest bucket ``>= n``, its other rows being
inert rows of the cache's pad slot.  Every op is batch-invariant, so a slot's token and logprob
are the same bits in any bucket, in a replay or an eager step, and equal to that token in a full
prefill.

Plan once, run cheaply: the host work of a step is picking the bucket, writing the slot list
into the bucket's device buffer when it changed, and one ``graph.replay()``.  Checks that need
host values (slots known, unique and with room) run on the host before the replay, from the
runner's own bookkeeping, without reading the device; checks of device values (token ids) set a
bit of a ``DeviceStatus`` word and predicate every write of the step, and ``sync`` raises them.

Sampling: greedy (``temperature=None``) or the exponential race ``argmax(logp - log E)`` with
``E ~ Exp(1)`` drawn from a counter-based hash of (slot seed, position, vocab id): the noise of
a token depends on nothing else, so sampling is batch-invariant too.  Each sampled token's
logprob is ``batchinv.token_logprobs`` of the final hidden state: the fused lm_head ->
log-softmax path the trainer (``Qwen3.token_logprobs``) uses, hence the trainer's bits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch import Tensor

import batchinv

from ... import device_checks
from ...gpu import linear as gpu_linear
from ...reference.qwen3_chain import lm_head_weight, qwen3_final_hidden
from ...static_kv_cache import (
    DeviceStatus,
    StaticKVCache,
    StepPlan,
    attention_with_static_kv_cache,
    plan_step,
    qk_norm_rope_attention_with_static_kv_cache,
)
from ...validation import check_int, token_id_lists
from .ops import BATCHINV_OPS

IGNORE_INDEX = -100


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 to 64, of 32 to 256, of 128 beyond, and ``max_batch``."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 32 if b < 256 else 128)
    sizes.append(max_batch)
    return tuple(sorted(set(sizes)))


def exponential_noise(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """``E [n, vocab]`` fp32, Exp(1) draws from a hash of (seed, position, vocab id) (splitmix64
    finaliser on int64, wrapping): the same bits for a token whatever batch it is drawn in."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * 0x9E3779B97F4A7C15 + positions[:, None] * 0x632BE59BD9B4E019 + ids[None]
    x = (x ^ (x >> 30)) * -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9 as int64
    x = (x ^ (x >> 27)) * -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB as int64
    x = x ^ (x >> 31)
    # 53 random bits -> u in (0, 1), never 0 or 1.
    u = ((x & ((1 << 53) - 1)).double() + 0.5) * 2.0**-53
    return (-torch.log(u)).float()


# ----- the op table's steps that read device values ----------------------------------------


def _embedding(ids: Tensor, weight: Tensor) -> Tensor:
    # The step checked the ids before planning its writes (``_run_step``); a bad id gives a
    # NaN row here, never a read out of bounds.
    return batchinv.embedding(ids, weight, check_ids=False)


def _rope(q, k, position_ids, **kwargs):
    # Positions are cache lengths, which the capacity checks keep below max_position.
    return batchinv.rope(q, k, position_ids, check_positions=False, **kwargs)


def _attention(q, k_new, v_new, layer, seq_ids, seqlens_new=None, causal=True, *, plans):
    # The step's plan, made once before the chain (``_planned``) for all layers.
    (plan,) = plans
    if plan.seq_ids is not seq_ids:
        raise RuntimeError("internal: the chain ran with other slots than the step's plan")
    return attention_with_static_kv_cache(q, k_new, v_new, layer, plan)


def _qk_norm_rope_attention(
    q, k_new, v_new, q_norm_weight, k_norm_weight, eps, position_ids, layer, seq_ids,
    *, theta, head_dim, max_position, seqlens_new=None, causal=True, plans,
):  # fmt: skip
    # The q/k norms, RoPE and the append in one kernel on CUDA (the bits of the unfused ops);
    # positions are cache lengths, which the capacity checks keep below max_position.
    (plan,) = plans
    if plan.seq_ids is not seq_ids:
        raise RuntimeError("internal: the chain ran with other slots than the step's plan")
    return qk_norm_rope_attention_with_static_kv_cache(
        q, k_new, v_new, q_norm_weight, k_norm_weight, eps, position_ids, layer, plan,
        theta=theta, max_position=max_position,
    )  # fmt: skip


class Qwen3DecodeRunner:
    """Generation for up to ``max_batch`` sequences of up to ``capacity`` tokens each.

    ``add(prompts, seeds)`` prefills prompts into free slots (eager) and samples each one's
    first token; ``step(slots)`` samples the next token of those slots (default: every active
    one); ``tokens(slot)`` / ``logprobs(slot)`` read a slot's sequence and its sampled tokens'
    fp32 logprobs; ``release(slot)`` frees it.  ``cuda_graph`` (default: on CUDA) replays steps
    from graphs captured on first use of each bucket.  ``prefetch_weights`` (default True): a
    step's small-M products start streaming their weight while the kernel before them runs
    (``gpu.linear.prefetching_weights``; the same bits, False to launch them in stream order).
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int,
        capacity: int,
        temperature: float | None = None,
        buckets: Sequence[int] | None = None,
        cuda_graph: bool | None = None,
        prefetch_weights: bool = True,
    ):
        config = model.config
        for name, value in (("max_batch", max_batch), ("capacity", capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if capacity > config.max_position_embeddings:
            raise ValueError(
                f"capacity ({capacity}) exceeds the model's max_position_embeddings "
                f"({config.max_position_embeddings})"
            )
        if temperature is not None and (
            not isinstance(temperature, int | float) or not temperature > 0
        ):
            raise ValueError(f"temperature must be > 0 or None (greedy), got {temperature!r}")
        device = model.device
        if cuda_graph is None:
            cuda_graph = device.type == "cuda"
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a model on a CUDA device, got {device}")
        if not isinstance(prefetch_weights, bool):
            kind = type(prefetch_weights).__name__
            raise TypeError(f"prefetch_weights must be a bool, got {kind}")
        buckets = tuple(sorted(set(default_buckets(max_batch) if buckets is None else buckets)))
        if not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets):
            raise ValueError(f"buckets must be positive ints, got {buckets!r}")
        if buckets[-1] < max_batch:
            raise ValueError(f"the largest bucket ({buckets[-1]}) is below max_batch ({max_batch})")
        self.model = model
        self.config = config
        self.device = device
        self.max_batch = max_batch
        self.capacity = capacity
        self.temperature = temperature
        self.buckets = buckets
        self.cuda_graph = cuda_graph
        self.prefetch_weights = prefetch_weights
        self.cache = StaticKVCache(
            config.num_hidden_layers,
            max_batch,
            capacity,
            config.num_key_value_heads,
            config.head_dim,
            dtype=model.dtype,
            device=device,
        )
        self.status = DeviceStatus(device)
        device_checks.word(device)  # allocated outside any graph
        slots = max_batch + 1  # with the pad slot
        self._next_token = torch.zeros(slots, dtype=torch.int64, device=device)
        self._seeds = torch.zeros(slots, dtype=torch.int64, device=device)
        # The token sampled at absolute position p of a slot, and its logprob (p < capacity + 1).
        self._sampled = torch.zeros(slots, capacity + 1, dtype=torch.int64, device=device)
        self._logprobs = torch.zeros(slots, capacity + 1, dtype=torch.float32, device=device)
        self._layers = self.cache.layers()
        # Bound to the plan holder, not to the runner: no reference cycle keeps a dropped
        # runner's cache alive.
        self._plans: list[StepPlan] = []
        self._ops = replace(
            BATCHINV_OPS,
            embedding=_embedding,
            rope=_rope,
            attention_with_kv_cache=functools.partial(_attention, plans=self._plans),
            qk_norm_rope_attention_with_kv_cache=functools.partial(
                _qk_norm_rope_attention, plans=self._plans
            ),
        )
        # Host bookkeeping: what each active slot holds (no device reads).
        self._prompts: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}  # tokens in the cache
        self._free = list(range(max_batch - 1, -1, -1))
        self._buffers: dict[int, Tensor] = {}  # bucket -> its slot ids on the device
        self._loaded: dict[int, tuple[int, ...]] = {}  # bucket -> the slots its buffer holds
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    # ----- sampling ------------------------------------------------------------------------

    def _sample(self, hidden: Tensor, slot_ids: Tensor, positions: Tensor) -> None:
        """Samples the token at ``positions`` (the absolute position it will hold) of each slot
        from the final hidden states ``[n, H]`` and records it and its logprob."""
        ops = self._ops
        head = lm_head_weight(self.model.hf_state_dict(), self.config)
        # As Qwen3.generate picks: from the fp32 log-softmax of the logits over the temperature.
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        logp = ops.log_softmax(ops.linear(hidden, head, None).float() / temperature)
        if self.temperature is not None:
            noise = exponential_noise(self._seeds[slot_ids], positions, logp.shape[-1])
            logp = logp - noise.log()
        token = logp.argmax(dim=-1)
        # The trainer's function (Qwen3.token_logprobs), so the trainer's bits; the token is
        # an argmax over the vocabulary, always in range.
        logprob = batchinv.token_logprobs(hidden, head, token, IGNORE_INDEX)
        # A failed step writes its outputs to the pad slot's position 0 (never read).
        ok = self.status.ok()
        slot_ids = torch.where(ok, slot_ids, self.cache.pad_slot)
        positions = torch.where(ok, positions, 0)
        self._next_token.index_copy_(0, slot_ids, token)
        self._sampled[slot_ids, positions] = token
        self._logprobs[slot_ids, positions] = logprob

    def _plan(self, slot_ids: Tensor, seqlens: Tensor, s_new: int) -> None:
        self._plans[:] = [plan_step(self.cache, slot_ids, seqlens, s_new, self.status)]

    # ----- prefill -------------------------------------------------------------------------

    @torch.no_grad()
    def add(self, prompts: Sequence[Tensor | Sequence[int]], seeds: Sequence[int] | None = None):
        """Prefills ``prompts`` (eager, one padded batch) into free slots, samples each one's
        first token; returns the slots.  ``seeds`` (one int per prompt, default 0) key the
        sampling noise; a slot's samples depend only on its seed and its tokens."""
        seqs = token_id_lists("prompts", prompts, torch.device("cpu"))
        if seeds is None:
            seeds = [0] * len(seqs)
        seeds = list(seeds)
        if len(seeds) != len(seqs) or any(
            not isinstance(s, int) or isinstance(s, bool) for s in seeds
        ):
            raise TypeError(f"seeds must be one int per prompt ({len(seqs)}), got {seeds!r}")
        if len(seqs) > len(self._free):
            raise ValueError(
                f"{len(seqs)} prompts but only {len(self._free)} free slots (max_batch "
                f"{self.max_batch}); release finished slots first"
            )
        vocab = self.config.vocab_size
        for i, s in enumerate(seqs):
            if s.numel() > self.capacity:
                raise ValueError(
                    f"prompts[{i}] has {s.numel()} tokens, more than the capacity ({self.capacity})"
                )
            bad = ((s < 0) | (s >= vocab)).nonzero()
            if bad.numel():
                j = int(bad[0, 0])
                raise IndexError(f"prompts[{i}][{j}] = {int(s[j])} is outside [0, {vocab})")
        slots = [self._free.pop() for _ in seqs]
        try:
            self._prefill(seqs, slots, seeds)
        except BaseException:  # the slots stay free; their lengths were not advanced
            self._free.extend(reversed(slots))
            raise
        for slot, s in zip(slots, seqs, strict=True):
            self._prompts[slot] = s.tolist()
            self._lengths[slot] = s.numel()
        return slots

    def _prefill(self, seqs: list[Tensor], slots: list[int], seeds: Sequence[int]) -> None:
        """Prefills ``seqs`` into ``slots`` and samples each first token (checked arguments)."""
        lengths = [s.numel() for s in seqs]
        ids = torch.zeros(len(seqs), max(lengths), dtype=torch.int64)
        for b, s in enumerate(seqs):
            ids[b, : s.numel()] = s
        slot_ids = torch.tensor(slots, device=self.device)
        seqlens = torch.tensor(lengths, device=self.device)
        self._seeds[slot_ids] = torch.tensor(seeds, dtype=torch.int64, device=self.device)
        self.cache.reset(slot_ids)
        self._plan(slot_ids, seqlens, ids.shape[1])
        hidden = qwen3_final_hidden(
            ids.to(self.device),
            self.model.hf_state_dict(),
            self.config,
            seqlens=seqlens,
            caches=self._layers,
            seq_ids=slot_ids,
            check_weights=False,
            ops=self._ops,
        )
        last = hidden[torch.arange(len(seqs), device=self.device), seqlens - 1]
        self._sample(last, slot_ids, seqlens)
        self.cache.advance(slot_ids, seqlens, self.status)

    # ----- decode --------------------------------------------------------------------------

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} slots exceed the largest bucket ({self.buckets[-1]})")

    def _step_body(self, bucket: int) -> None:
        # The public ops' value checks: no sync in a step.  The weights are read-only in a
        # step, so the small-M products may stream theirs while the kernel before them runs.
        prefetch = gpu_linear.prefetching_weights() if self.prefetch_weights else nullcontext()
        with device_checks.deferred(), prefetch:
            self._run_step(bucket)

    def _run_step(self, bucket: int) -> None:
        slot_ids = self._buffers[bucket]
        ids = self._next_token[slot_ids][:, None]
        # Before the plan: a bad id must turn every write of the step into a no-op.
        self.status.record(1, (ids < 0) | (ids >= self.config.vocab_size))
        self._plan(slot_ids, torch.ones_like(slot_ids), 1)
        positions = self.cache.lengths[slot_ids].long()
        hidden = qwen3_final_hidden(
            ids,
            self.model.hf_state_dict(),
            self.config,
            caches=self._layers,
            seq_ids=slot_ids,
            check_weights=False,
            ops=self._ops,
        )
        self._sample(hidden[:, 0], slot_ids, positions + 1)
        self.cache.advance(slot_ids, torch.ones_like(slot_ids), self.status)

    @torch.no_grad()
    def step(self, slots: Sequence[int] | None = None) -> None:
        """Samples one more token for each of ``slots`` (default: every active slot)."""
        if slots is None:
            slots = sorted(self._lengths)
        else:  # a bool would find slot 1 (True == 1 as a dict key)
            slots = [check_int(f"slots[{i}]", slot) for i, slot in enumerate(slots)]
        if not slots:
            raise ValueError("no active slots: add prompts first")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be unique, got {slots}")
        for slot in slots:
            if slot not in self._lengths:
                raise ValueError(f"slot {slot!r} is not active (add a prompt first)")
            if self._lengths[slot] + 1 > self.capacity:
                raise ValueError(
                    f"slot {slot} has {self._lengths[slot]} tokens in the cache; a step adds "
                    f"one, past the capacity ({self.capacity})"
                )
        bucket = self.bucket_for(len(slots))
        loaded = tuple(slots) + (self.cache.pad_slot,) * (bucket - len(slots))
        if bucket not in self._buffers:
            self._buffers[bucket] = torch.empty(bucket, dtype=torch.int64, device=self.device)
        if self._loaded.get(bucket) != loaded:
            host = torch.tensor(loaded, dtype=torch.int64)
            self._buffers[bucket].copy_(host.pin_memory() if self.cuda_graph else host, True)
            self._loaded[bucket] = loaded
        if self.cuda_graph:
            graph = self._graphs.get(bucket) or self._capture(bucket)
            graph.replay()
        else:
            try:
                self._step_body(bucket)
            except Exception:
                self.status.clear()  # raised here already: the next step starts clean
                raise
        for slot in slots:
            self._lengths[slot] += 1

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        """Captures one step of ``bucket`` rows.  Warm-up runs go to the pad slot only (every
        row of the buffer is the pad slot), so they change no sequence."""
        real = self._buffers[bucket].clone()
        self._buffers[bucket].fill_(self.cache.pad_slot)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # plans, kernels and workspaces are made outside the capture
                self._step_body(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step_body(bucket)
        self._buffers[bucket].copy_(real)
        self._graphs[bucket] = graph
        return graph

    # ----- results -------------------------------------------------------------------------

    def sync(self) -> None:
        """Waits for the device and raises the error of any failed device-side check.

        A failed check makes that step and every later one write nothing; on raising, the
        runner takes its lengths back from the device and clears the status, so steps run
        again once the cause is fixed."""
        try:
            self.status.raise_if_failed()
            device_checks.raise_device_errors(self.device)
        except (IndexError, ValueError):
            device_lengths = self.cache.lengths.tolist()
            for slot in self._lengths:
                self._lengths[slot] = device_lengths[slot]
            self.status.clear()
            raise

    def tokens(self, slot: int) -> list[int]:
        """The slot's prompt followed by its sampled tokens (reads the device)."""
        self._check_active(slot)
        self.sync()
        prompt, length = self._prompts[slot], self._lengths[slot]
        sampled = self._sampled[slot, len(prompt) : length + 1].tolist()
        return prompt + sampled

    def logprobs(self, slot: int) -> Tensor:
        """fp32 logprobs of the slot's sampled tokens, in order (a CPU tensor)."""
        self._check_active(slot)
        self.sync()
        prompt, length = self._prompts[slot], self._lengths[slot]
        return self._logprobs[slot, len(prompt) : length + 1].cpu()

    def sampled_count(self, slot: int) -> int:
        """How many tokens the slot has sampled (host bookkeeping: no device read)."""
        self._check_active(slot)
        return self._lengths[slot] - len(self._prompts[slot]) + 1

    def release(self, slot: int) -> None:
        self._check_active(slot)
        del self._lengths[slot], self._prompts[slot]
        self._free.append(slot)

    def _check_active(self, slot: int) -> None:
        check_int("slot", slot)
        if slot not in self._lengths:
            raise ValueError(f"slot {slot!r} is not active")
