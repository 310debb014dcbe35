"""The Qwen3 model as a ``SequenceAdapter``: what the contract's sequence sweep drives.

A sequence is ``ids [L]`` (int64); its output is the model's fp32 log-probabilities
``[L, vocab]`` computed with one op table (``ops.log_softmax`` of the logits), so the sweep's
"max abs diff" is the max |Δ logprob| over every token and every vocabulary entry.
Each method is one way an engine computes the sequence: a padded batch, a packed (varlen)
batch, chunked prefill through KV caches, prefill + token-by-token decode in a batch, and a
prefix cached by one batch then read by another.  The adapter never falls back: an op the
device lacks raises ``AuditOpError`` (not ``NotImplementedError``), which stops the path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from ..contract import padding_fill
from ..models.qwen3.model import Qwen3
from ..reference.qwen3_chain import Qwen3Ops
from .kernel_paths import PathRecorder

__all__ = ["AuditOpError", "ModelAdapter"]


class AuditOpError(RuntimeError):
    """An op of the audited path cannot run here (e.g. no CUDA kernel yet)."""


class ModelAdapter:
    """Runs ``model`` with ``ops`` in each of the sweep's schedules; records call times."""

    def __init__(self, model: Qwen3, ops: Qwen3Ops, recorder: PathRecorder | None = None):
        """``recorder``: where ``ops`` (from ``recording_ops``) note their kernel paths; taken
        after each call into ``kernel_paths``."""
        self.model = model
        self.ops = ops
        self.recorder = recorder
        self.calls: list[tuple[str, float]] = []  # (method, seconds), in call order
        self.kernel_paths: list[dict | None] = []  # per call: the recorder's notes, or None

    # ----- helpers -------------------------------------------------------------------------

    def _run(self, method: str, fn):
        start = time.perf_counter()
        try:
            with torch.no_grad():
                result = fn()
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
        except NotImplementedError as err:
            raise AuditOpError(f"{self.ops.name} path, {method}: {err}") from err
        finally:
            self.calls.append((method, time.perf_counter() - start))
            self.kernel_paths.append(None if self.recorder is None else self.recorder.take())
        return result

    def _logprobs(self, logits: Tensor) -> Tensor:
        return self.ops.log_softmax(logits)

    def _forward(self, ids: Tensor, **kwargs) -> Tensor:
        return self.model(ids, ops=self.ops, **kwargs)

    def _device_ids(self, seq: Tensor) -> Tensor:
        return seq.to(self.model.device, torch.int64)

    def _padded(self, seqs: Sequence[Tensor], padding: str) -> tuple[Tensor, Tensor]:
        """``ids [B, S]`` right-padded with ``padding_fill(.., padding)`` and ``lengths [B]``."""
        lengths = [int(s.shape[0]) for s in seqs]
        width = max(max(lengths), 1)
        rows = []
        generator = torch.Generator().manual_seed(4321)
        for s, n in zip(seqs, lengths, strict=True):
            fill = padding_fill(
                s.cpu(),
                width - n,
                padding,
                generator=generator,
                int_high=self.model.config.vocab_size,
            )
            rows.append(torch.cat([s.cpu(), fill]))
        ids = torch.stack(rows).to(self.model.device, torch.int64)
        return ids, torch.tensor(lengths, device=self.model.device)

    # ----- SequenceAdapter -----------------------------------------------------------------

    def prefill_padded(self, seqs: list[Tensor], padding: str) -> list[Tensor]:
        def run():
            ids, lengths = self._padded(seqs, padding)
            # Like a stock engine: no mask when nothing is padded (SDPA's causal fast path).
            padded = bool((lengths < ids.shape[1]).any())
            out = self._logprobs(self._forward(ids, seqlens=lengths if padded else None))
            return [out[b, : int(n)] for b, n in enumerate(lengths.tolist())]

        return self._run("prefill_padded", run)

    def prefill_varlen(self, seqs: list[Tensor]) -> list[Tensor]:
        def run():
            lengths = torch.tensor([0] + [int(s.shape[0]) for s in seqs])
            cu = torch.cumsum(lengths, 0).to(self.model.device)
            packed = torch.cat([self._device_ids(s) for s in seqs])
            out = self._logprobs(self._forward(packed, cu_seqlens=cu))
            return [out[int(cu[b]) : int(cu[b + 1])] for b in range(len(seqs))]

        return self._run("prefill_varlen", run)

    def prefill_chunked(self, seq: Tensor, chunk_lengths: Sequence[int]) -> Tensor:
        def run():
            ids = self._device_ids(seq)[None]
            logits = self.model.prefill_chunked(ids, chunk_lengths, ops=self.ops)
            return self._logprobs(logits)[0]

        return self._run("prefill_chunked", run)

    def decode(self, seq: Tensor, prompt_len: int, companions: list[Tensor]) -> Tensor:
        def run():
            seqs = [seq, *companions]  # the probe sits in slot 0
            prompts = [min(prompt_len, int(s.shape[0])) for s in seqs]
            caches = self.model.new_caches(len(seqs), max(int(s.shape[0]) for s in seqs))
            ids, lengths = self._padded(
                [s[:p] for s, p in zip(seqs, prompts, strict=True)], "zeros"
            )
            rows = [
                self._logprobs(self._forward(ids, seqlens=lengths, caches=caches))[0, :prompt_len]
            ]
            for t in range(prompt_len, int(seq.shape[0])):
                # every sequence still holding tokens decodes its next one, probe first
                step = t - prompt_len
                active = [b for b, s in enumerate(seqs) if prompts[b] + step < int(s.shape[0])]
                next_ids = torch.stack([seqs[b][prompts[b] + step] for b in active])
                slots = torch.tensor(active, device=self.model.device)
                logits = self._forward(
                    self._device_ids(next_ids)[:, None], caches=caches, seq_ids=slots
                )
                rows.append(self._logprobs(logits)[0])
            return torch.cat(rows)

        return self._run("decode", run)

    def prefix_reuse(
        self, seq: Tensor, prefix_len: int, writer_batch: list[Tensor], reader_batch: list[Tensor]
    ) -> Tensor:
        def run():
            writers = [seq[:prefix_len], *writer_batch]
            writer_caches = self.model.new_caches(
                len(writers), max(int(s.shape[0]) for s in writers)
            )
            ids, lengths = self._padded(writers, "zeros")
            written = self._forward(ids, seqlens=lengths, caches=writer_caches)
            head = self._logprobs(written)[0, :prefix_len]
            # the reader batch: its own sequences from scratch, the probe's rest in the middle
            slot = len(reader_batch) // 2
            rest = seq[prefix_len:]
            readers = reader_batch[:slot] + [rest] + reader_batch[slot:]
            capacity = max([int(seq.shape[0])] + [int(s.shape[0]) for s in reader_batch])
            reader_caches = self.model.new_caches(len(readers), capacity)
            for reader, writer in zip(reader_caches, writer_caches, strict=True):
                reader.copy_prefix(0, slot, prefix_len, source=writer)
            ids, lengths = self._padded(readers, "zeros")
            tail = self._forward(ids, seqlens=lengths, caches=reader_caches)
            return torch.cat([head, self._logprobs(tail)[slot, : rest.shape[0]]])

        return self._run("prefix_reuse", run)
