"""A KV cache for the attention reference: decode, chunked prefill and prefix reuse.

Storage is ``k, v: [batch, max_len, num_kv_heads, head_dim]`` with one length per
sequence slot.  Key ``i`` of slot ``s`` sits at absolute position ``i`` (position 0 is
the first token of the sequence), which is what the attention reference's fixed KV
blocks are measured in: a row computed against the cache sees exactly the keys, at the
same absolute positions, that it would see in a one-shot prefill.

Unwritten slots hold NaN (for every dtype here), so a read of a position beyond a
sequence's length would show up as NaN in the output; the attention reference selects
keys by length and never reads them.  The cache is an inference structure: appends are
copies made under ``torch.no_grad()`` and no gradient flows through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validate import INDEX_DTYPES, check_same_device, check_tensor

SUPPORTED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KVCache:
    """Per-sequence key/value storage of a fixed capacity ``max_len``.

    ``append`` writes new keys after each sequence's current length; ``read`` returns the
    storage rows of some slots with their lengths, ready for
    ``attention(q, k, v, seqlens_k=lengths)``.  Appending beyond ``max_len`` raises
    ``ValueError`` naming the cache, the slot and the length it would reach.
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        name: str = "kv_cache",
    ):
        for arg, value in (
            ("batch", batch),
            ("max_len", max_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if dtype not in SUPPORTED_CACHE_DTYPES:
            raise TypeError(f"{name}: dtype must be float32, bfloat16 or float16, got {dtype}")
        self.name = name
        self.max_len = max_len
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def _seq_ids(self, seq_ids: Tensor | None, count: int | None) -> Tensor:
        if seq_ids is None:
            ids = torch.arange(self.batch, device=self.k.device)
        else:
            check_tensor("seq_ids", seq_ids, dtypes=INDEX_DTYPES, ndim=1)
            ids = seq_ids.to(self.k.device, torch.int64)
            bad = (ids < 0) | (ids >= self.batch)
            if bool(bad.any()):
                where = int(bad.nonzero()[0, 0])
                raise IndexError(
                    f"{self.name}: seq_ids[{where}] = {int(ids[where])} is outside the "
                    f"cache's slots [0, {self.batch})"
                )
            if ids.unique().numel() != ids.numel():
                raise ValueError(f"{self.name}: seq_ids must not repeat a slot, got {ids.tolist()}")
        if count is not None and ids.numel() != count:
            raise ValueError(
                f"{self.name}: {count} new rows given for {ids.numel()} sequence slots"
            )
        return ids

    def append(
        self,
        k_new: Tensor,
        v_new: Tensor,
        seq_ids: Tensor | None = None,
        new_lengths: Tensor | None = None,
    ) -> Tensor:
        """Appends ``k_new, v_new: [n, S_new, Hkv, d]`` to slots ``seq_ids`` (default all).

        Row ``i`` contributes its first ``new_lengths[i]`` positions (default ``S_new``);
        positions past that are padding and are not copied.  Returns the new lengths of
        the slots.  Nothing is written if any slot would exceed ``max_len``.
        """
        check_tensor("k_new", k_new, dtypes=(self.dtype,), ndim=4)
        check_tensor("v_new", v_new, dtypes=(self.dtype,), ndim=4)
        check_same_device(cache=self.k, k_new=k_new, v_new=v_new)
        if k_new.shape != v_new.shape:
            raise ValueError(
                f"k_new and v_new must have the same shape, got {tuple(k_new.shape)} and "
                f"{tuple(v_new.shape)}"
            )
        if tuple(k_new.shape[2:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"k_new must be [n, S_new, {self.num_kv_heads}, {self.head_dim}] for "
                f"{self.name}, got {tuple(k_new.shape)}"
            )
        ids = self._seq_ids(seq_ids, k_new.shape[0])
        s_new = k_new.shape[1]
        if new_lengths is None:
            counts = torch.full((ids.numel(),), s_new, dtype=torch.int64, device=ids.device)
        else:
            check_tensor("new_lengths", new_lengths, dtypes=INDEX_DTYPES, ndim=1)
            counts = new_lengths.to(ids.device, torch.int64)
            if counts.numel() != ids.numel():
                raise ValueError(
                    f"new_lengths must have one entry per appended row ({ids.numel()}), "
                    f"got shape {tuple(new_lengths.shape)}"
                )
            bad = (counts < 0) | (counts > s_new)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"new_lengths[{i}] = {int(counts[i])} is outside [0, {s_new}]")
        grown = self.lengths[ids] + counts
        over = grown > self.max_len
        if bool(over.any()):
            i = int(over.nonzero()[0, 0])
            raise ValueError(
                f"{self.name}: appending {int(counts[i])} keys to sequence {int(ids[i])} "
                f"(length {int(self.lengths[ids[i]])}) would reach length {int(grown[i])}, "
                f"beyond the cache capacity max_len={self.max_len}"
            )
        with torch.no_grad():
            # One scatter for all rows (slots never repeat): no per-slot host round trips.
            offsets = torch.arange(s_new, device=ids.device)
            kept = offsets[None, :] < counts[:, None]  # [n, S_new]: positions to copy
            slots = ids[:, None].expand(-1, s_new)[kept]
            positions = (self.lengths[ids][:, None] + offsets[None, :])[kept]
            self.k[slots, positions] = k_new[kept]
            self.v[slots, positions] = v_new[kept]
            self.lengths[ids] = grown
        return self.lengths[ids].clone()

    def read(self, seq_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(k, v, seqlens_k)`` for slots ``seq_ids`` (default all), in that slot order.

        ``k, v`` are ``[n, max_len, Hkv, d]`` copies of the storage rows (NaN past each
        length); ``seqlens_k`` is ``[n]`` int64.
        """
        ids = self._seq_ids(seq_ids, None)
        return self.k[ids], self.v[ids], self.lengths[ids].clone()

    def copy_prefix(
        self, src: int, dst: int, length: int | None = None, *, source: KVCache | None = None
    ) -> None:
        """Makes slot ``dst`` hold the first ``length`` keys of slot ``src`` (prefix reuse).

        ``source`` is the cache that holds ``src`` (default: this one), so a prefix written
        by one batch's cache can be read by another's.  It must match this cache's heads,
        head dim and dtype.  Positions of ``dst`` past ``length`` are reset to NaN.
        """
        source = self if source is None else source
        if not isinstance(source, KVCache):
            raise TypeError(f"source must be a KVCache, got {type(source).__name__}")
        same_layout = (source.num_kv_heads, source.head_dim, source.dtype) == (
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
        )
        if not same_layout:
            raise ValueError(
                f"{source.name} stores [{source.num_kv_heads}, {source.head_dim}] "
                f"{source.dtype} but {self.name} stores [{self.num_kv_heads}, "
                f"{self.head_dim}] {self.dtype}"
            )
        for cache, arg, slot in ((source, "src", src), (self, "dst", dst)):
            if not 0 <= slot < cache.batch:
                raise IndexError(
                    f"{cache.name}: {arg}={slot} is outside the slots [0, {cache.batch})"
                )
        src_len = int(source.lengths[src])
        length = src_len if length is None else length
        if not 0 <= length <= src_len:
            raise ValueError(
                f"{source.name}: prefix length {length} is outside [0, {src_len}] (length of "
                f"sequence {src})"
            )
        if length > self.max_len:
            raise ValueError(
                f"{self.name}: a prefix of {length} keys exceeds the cache capacity "
                f"max_len={self.max_len}"
            )
        with torch.no_grad():
            k_prefix = source.k[src, :length].clone()
            v_prefix = source.v[src, :length].clone()
            self.k[dst] = float("nan")
            self.v[dst] = float("nan")
            self.k[dst, :length] = k_prefix
            self.v[dst, :length] = v_prefix
            self.lengths[dst] = length

    def reset(self, seq_ids: Tensor | None = None) -> None:
        """Empties slots ``seq_ids`` (default all): length 0, storage back to NaN."""
        ids = self._seq_ids(seq_ids, None)
        with torch.no_grad():
            self.k[ids] = float("nan")
            self.v[ids] = float("nan")
            self.lengths[ids] = 0
