"""``Qwen3``: the dense Qwen3 model as an ``nn.Module`` built from one op table.

The forward is ``batchinv.reference.qwen3_chain.qwen3_forward`` (one implementation of the
chain) run over an op table: ``"batchinv"`` (default; CPU = the strict references, CUDA =
batch-invariant kernels), ``"stock"`` (cuBLAS, SDPA, torch ops) or ``"reference"``.
Parameters carry Hugging Face names (``model.layers.0.self_attn.q_proj.weight``...), so
``state_dict()`` is a Qwen3ForCausalLM state dict.  Every mode of computing a sequence --
prefill, padded or packed (varlen) batches, chunked prefill and token-by-token decode with
KV caches -- gives a sequence's logits the same bits with the batchinv table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from ...kv_cache import KVCache
from ...reference.qwen3_chain import (
    Qwen3ChainConfig,
    Qwen3Ops,
    check_kv_caches,
    check_qwen3_state_dict,
    lm_head_weight,
    make_kv_caches,
    qwen3_final_hidden,
    qwen3_logits,
    qwen3_state_dict_shapes,
)
from ...validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_index_range,
    check_tensor,
    int_list,
    token_id_lists,
)
from .config import Qwen3Config
from .ops import ops_by_name
from .weights import load_safetensors, random_state_dict

__all__ = ["IGNORE_INDEX", "Qwen3", "check_device_dtype"]

IGNORE_INDEX = -100


def check_device_dtype(device: torch.device | str, dtype: torch.dtype) -> torch.device:
    """Raises before any work if ``dtype`` cannot run on ``device``; returns the device.

    TypeError: not a float dtype batchinv runs (fp32, bf16, fp16), or the device cannot run
    it (bf16 on a GPU without bf16, fp32 on CUDA where batchinv's kernels are bf16/fp16).
    ValueError: CUDA asked for but absent.
    """
    device = torch.device(device)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} was asked for, but CUDA is not available")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(device)
            raise TypeError(f"{name} does not support bfloat16; use --dtype float16")
        if dtype == torch.float32:
            raise TypeError(
                "batchinv's CUDA kernels run bfloat16 and float16; float32 runs on the CPU"
            )
    elif device.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {device}")
    try:  # what the chain needs: a matmul and the elementwise ops, in this dtype
        probe = torch.ones(2, 2, dtype=dtype, device=device)
        torch.nn.functional.linear(probe, probe).float().sum().item()
    except RuntimeError as err:
        raise TypeError(f"{device} cannot run {dtype}: {err}") from err
    return device


def _install(root: nn.Module, dotted_name: str, parameter: nn.Parameter) -> None:
    """Registers ``parameter`` under a dotted HF name, creating container modules on the way."""
    *path, leaf = dotted_name.split(".")
    module = root
    for part in path:
        child = getattr(module, part, None) if part in module._modules else None
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, parameter)


class Qwen3(nn.Module):
    """A dense Qwen3 causal LM whose forward is the batchinv chain over an op table."""

    def __init__(
        self,
        config: Qwen3ChainConfig,
        state_dict: Mapping[str, Tensor],
        *,
        ops: str | Qwen3Ops = "batchinv",
    ):
        super().__init__()
        check_qwen3_state_dict(state_dict, config)
        self.config = config
        self.ops = ops_by_name(ops)
        for name in qwen3_state_dict_shapes(config):
            _install(self, name, nn.Parameter(state_dict[name].detach().clone()))

    # ----- construction -------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: Qwen3ChainConfig | None = None,
        seed: int = 0,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        ops: str | Qwen3Ops = "batchinv",
    ) -> Qwen3:
        """Random weights from ``seed`` (the built-in ``Qwen3Config.tiny()`` by default)."""
        config = Qwen3Config.tiny() if config is None else config
        device = check_device_dtype(device, dtype)
        return cls(config, random_state_dict(config, seed, dtype=dtype, device=device), ops=ops)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        ops: str | Qwen3Ops = "batchinv",
    ) -> Qwen3:
        """A local checkpoint directory: config.json and safetensors (single or sharded).
        The config, every tensor's name, shape and dtype, and the device/dtype pair are all
        checked before a tensor is loaded.  Every failure names the file: an ``OSError``
        (missing, not a directory) or a ``ValueError`` (``CheckpointError``: corrupt,
        truncated, or not what the config needs)."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(
                f"{path} is a file, not a checkpoint directory: pass the directory that holds "
                "config.json and the safetensors files"
            )
        config = Qwen3Config.from_json(path)
        device = check_device_dtype(device, dtype)
        return cls(config, load_safetensors(path, config, dtype=dtype, device=device), ops=ops)

    def save_pretrained(self, directory: str | Path) -> None:
        """config.json and model.safetensors into ``directory`` (created if needed)."""
        from .weights import save_safetensors

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        Qwen3Config(**vars(self.config)).save(directory)
        save_safetensors(self.hf_state_dict(), directory)

    # ----- properties ----------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The parameters by Hugging Face name (live parameters, for autograd)."""
        return dict(self.named_parameters())

    def _ops(self, ops: str | Qwen3Ops | None) -> Qwen3Ops:
        return self.ops if ops is None else ops_by_name(ops)

    # ----- forward -------------------------------------------------------------------------

    def final_hidden(self, input_ids: Tensor, *, ops: str | Qwen3Ops | None = None, **kwargs):
        """The final-normed hidden states (``forward`` without the lm_head)."""
        return qwen3_final_hidden(
            input_ids,
            self.hf_state_dict(),
            self.config,
            check_weights=False,  # checked at construction; parameters keep their shapes
            ops=self._ops(ops),
            **kwargs,
        )

    def forward(
        self,
        input_ids: Tensor,
        *,
        seqlens: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        caches: Sequence[KVCache] | None = None,
        seq_ids: Tensor | None = None,
        ops: str | Qwen3Ops | None = None,
    ) -> Tensor:
        """Logits in the model dtype.

        ``input_ids [B, S]`` right-padded with ``seqlens [B]`` (default: all full), or
        ``input_ids [T]`` packed with ``cu_seqlens [n+1]`` (varlen) -> ``[T, vocab]``.  With
        ``caches`` (``new_caches``): ``input_ids`` continue the cached sequences of slots
        ``seq_ids`` (default all) -- a prefill into empty caches, a chunk, or a decode step.
        """
        ops = self._ops(ops)
        hidden = self.final_hidden(
            input_ids,
            seqlens=seqlens,
            cu_seqlens=cu_seqlens,
            caches=caches,
            seq_ids=seq_ids,
            ops=ops,
        )
        return qwen3_logits(ops, hidden, lm_head_weight(self.hf_state_dict(), self.config))

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        """Empty per-layer KV caches for ``batch`` sequence slots of up to ``max_len`` tokens."""
        return make_kv_caches(self.config, batch, max_len, self.dtype, self.device)

    def prefill_chunked(
        self,
        input_ids: Tensor,
        chunk_lengths: Sequence[int],
        *,
        caches: Sequence[KVCache] | None = None,
        ops: str | Qwen3Ops | None = None,
    ) -> Tensor:
        """Prefills ``input_ids [B, S]`` in consecutive chunks (lengths summing to S) through
        KV caches (new ones unless given); returns the logits of all chunks ``[B, S, V]``.
        Given caches are checked for every chunk before the first (room, ids, positions), so
        a call that raises leaves them as they were."""
        check_tensor("input_ids", input_ids, dtypes=INDEX_DTYPES, ndim=2)
        lengths = int_list("chunk_lengths", chunk_lengths)
        if any(c < 1 for c in lengths) or sum(lengths) != input_ids.shape[1]:
            raise ValueError(
                f"chunk_lengths must be positive and sum to {input_ids.shape[1]}, got {lengths}"
            )
        if caches is None:
            caches = self.new_caches(input_ids.shape[0], input_ids.shape[1])
        else:
            # A later chunk must not fail after earlier ones appended: check the whole prefill.
            if len(caches) != self.config.num_hidden_layers:
                raise ValueError(
                    f"caches must hold one KVCache per layer ({self.config.num_hidden_layers}), "
                    f"got {len(caches)}"
                )
            weight = self.model.embed_tokens.weight
            check_kv_caches(input_ids, self.config, None, caches, None, weight)
            check_index_range("input_ids", input_ids, self.config.vocab_size)
            if isinstance(caches[0], KVCache):
                end = int(caches[0].host_lengths().max()) + input_ids.shape[1]
                limit = self.config.max_position_embeddings
                if end > limit:
                    raise ValueError(
                        f"the caches hold up to {end - input_ids.shape[1]} tokens; prefilling "
                        f"{input_ids.shape[1]} more passes max_position_embeddings ({limit})"
                    )
        pieces, start = [], 0
        for length in lengths:
            chunk = input_ids[:, start : start + length]
            pieces.append(self(chunk, caches=caches, ops=ops))
            start += length
        return torch.cat(pieces, dim=1)

    # ----- generation ----------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Tensor | Sequence[int]],
        max_new_tokens: int,
        *,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        temperature: float = 1.0,
        ops: str | Qwen3Ops | None = None,
        seeds: Sequence[int] | None = None,
        cuda_graph: bool = False,
        return_logprobs: bool = False,
    ) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
        """Prompt + ``max_new_tokens`` tokens for each prompt: one padded prefill, then
        batched decode steps against KV caches.

        Greedy when neither ``generator`` nor ``seeds`` is given; otherwise sampled from
        ``softmax(logits / temperature)`` with the exponential race (``argmax p / E``,
        ``E ~ Exp(1)``).  ``generator`` draws ``E`` (one per prompt makes each prompt's
        samples independent of the batch; one shared generator draws the whole batch's noise).

        ``seeds`` (one int per prompt), ``cuda_graph=True`` or ``return_logprobs=True`` run the
        sampler (``Qwen3DecodeRunner``, ``docs/decode.md``): a static KV cache, steps replayed
        from CUDA graphs where ``cuda_graph``, ``E`` hashed from each prompt's seed and
        position, and with ``return_logprobs`` also each sampled token's fp32 logprob, the
        bits ``token_logprobs`` gives the trainer.  Returns ``sequences`` or
        ``(sequences, logprobs)``.
        """
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
            raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
        if not temperature > 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        seqs = token_id_lists("prompts", prompts, self.device)
        longest = max(s.numel() for s in seqs)
        limit = self.config.max_position_embeddings
        if longest + max_new_tokens > limit:
            raise ValueError(
                f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) "
                f"exceeds max_position_embeddings ({limit})"
            )
        if seeds is not None or cuda_graph or return_logprobs:
            return self._generate_with_runner(
                seqs,
                max_new_tokens,
                generator,
                temperature,
                ops,
                seeds,
                cuda_graph,
                return_logprobs,
            )
        ops = self._ops(ops)
        generators = self._generators(generator, len(seqs))
        batch = len(seqs)
        lengths = torch.tensor([s.numel() for s in seqs], device=self.device)
        ids = torch.zeros(batch, int(lengths.max()), dtype=torch.int64, device=self.device)
        for b, s in enumerate(seqs):
            ids[b, : s.numel()] = s
        caches = self.new_caches(batch, ids.shape[1] + max_new_tokens)
        logits = self(ids, seqlens=lengths, caches=caches, ops=ops)
        last = logits[torch.arange(batch, device=self.device), lengths - 1]
        new_tokens = []
        for step in range(max_new_tokens):
            token = self._pick(ops.log_softmax(last.float() / temperature), generators)
            new_tokens.append(token)
            if step + 1 < max_new_tokens:
                last = self(token[:, None], caches=caches, ops=ops)[:, 0]
        completions = torch.stack(new_tokens, dim=1)
        return [torch.cat([s, completions[b]]) for b, s in enumerate(seqs)]

    def _generate_with_runner(
        self, seqs, max_new_tokens, generator, temperature, ops, seeds, cuda_graph, logprobs
    ):
        from .decode import Qwen3DecodeRunner

        if generator is not None:
            raise ValueError(
                "generator cannot be combined with seeds, cuda_graph or return_logprobs: "
                "the sampler draws its noise from seeds"
            )
        if ops is not None and self._ops(ops) is not ops_by_name("batchinv"):
            raise ValueError("the sampler runs batchinv's ops; ops must be None or 'batchinv'")
        table = self._ops(ops)
        if table.row_parallel_linear is not None or table.logits is not None:
            # The runner runs the single-GPU batchinv table: it would drop the hooks' bits.
            raise ValueError(
                f"the sampler (seeds, cuda_graph, return_logprobs) runs batchinv's single-GPU "
                f"ops; the model's table {table.name!r} has tensor-parallel hooks: generate "
                "without seeds, cuda_graph and return_logprobs (eager decode), and take "
                "logprobs from token_logprobs"
            )
        runner = Qwen3DecodeRunner(
            self,
            max_batch=len(seqs),
            capacity=max(s.numel() for s in seqs) + max_new_tokens,
            temperature=None if seeds is None else temperature,
            cuda_graph=cuda_graph,
        )
        slots = runner.add(seqs, seeds=seeds)
        for _ in range(max_new_tokens - 1):
            runner.step()
        sequences = [torch.tensor(runner.tokens(s), device=self.device) for s in slots]
        if not logprobs:
            return sequences
        return sequences, [runner.logprobs(s).to(self.device) for s in slots]

    @staticmethod
    def _generators(generator, batch: int) -> list[torch.Generator] | torch.Generator | None:
        if generator is None or isinstance(generator, torch.Generator):
            return generator
        generators = list(generator)
        if len(generators) != batch or not all(isinstance(g, torch.Generator) for g in generators):
            raise TypeError(
                f"generator must be a torch.Generator or one per prompt ({batch}), got "
                f"{len(generators)} items"
            )
        return generators

    @staticmethod
    def _pick(logprobs: Tensor, generators) -> Tensor:
        if generators is None:
            return logprobs.argmax(dim=-1)
        if isinstance(generators, torch.Generator):
            noise = torch.empty(logprobs.shape, device=generators.device)
            noise = noise.exponential_(generator=generators).to(logprobs.device)
        else:
            rows = []
            for g in generators:
                row = torch.empty(logprobs.shape[-1], device=g.device).exponential_(generator=g)
                rows.append(row.to(logprobs.device))
            noise = torch.stack(rows)
        return (logprobs - noise.log()).argmax(dim=-1)

    # ----- training ------------------------------------------------------------------------

    def token_logprobs(
        self,
        sequences: Sequence[Tensor | Sequence[int]],
        prompt_lens: Sequence[int] | Tensor,
        *,
        ops: str | Qwen3Ops | None = None,
    ) -> list[Tensor]:
        """fp32 logprobs of each sequence's completion tokens (those after its prompt).

        ``sequences[i]`` is prompt + completion; ``prompt_lens[i]`` in ``[1, len]``.  The
        sequences are packed back to back (varlen, as a trainer batches them) and token
        ``t`` of sequence ``i`` (``t >= prompt_lens[i]``) gets ``log p(seq[t] | seq[:t])``.
        Returns one 1-D fp32 tensor per sequence, differentiable w.r.t. the parameters.
        """
        ops = self._ops(ops)
        seqs = token_id_lists("sequences", sequences, self.device)
        prompts = int_list("prompt_lens", prompt_lens)
        if len(prompts) != len(seqs):
            raise ValueError(
                f"prompt_lens must have one entry per sequence ({len(seqs)}), got {len(prompts)}"
            )
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
            if not 1 <= p <= s.numel():
                raise ValueError(f"prompt_lens[{i}] = {p} is outside [1, {s.numel()}]")
        lengths = torch.tensor([0] + [s.numel() for s in seqs], device=self.device)
        cu_seqlens = torch.cumsum(lengths, 0)
        packed = torch.cat(seqs)
        targets = torch.full_like(packed, IGNORE_INDEX)
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
            start = int(cu_seqlens[i])
            # position t predicts token t + 1; completion tokens are p .. len-1
            targets[start + p - 1 : start + s.numel() - 1] = s[p:]
        hidden = self.final_hidden(packed, cu_seqlens=cu_seqlens, ops=ops)
        head = lm_head_weight(self.hf_state_dict(), self.config)
        logprobs = ops.token_logprobs(hidden, head, targets, IGNORE_INDEX)
        out = []
        for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
            start = int(cu_seqlens[i])
            out.append(logprobs[start + p - 1 : start + s.numel() - 1])
        return out
