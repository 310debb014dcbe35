"""``batchinv.KVCache``: the KV cache of ``batchinv.attention_with_kv_cache`` (decode,
chunked prefill and prefix reuse), on every backend.

Storage is ``k, v: [batch, max_len, num_kv_heads, head_dim]`` with one length per
sequence slot.  Key ``i`` of slot ``s`` sits at absolute position ``i`` (position 0 is
the first token of the sequence), which is what attention's fixed KV blocks are measured
in: a row computed against the cache sees exactly the keys, at the same absolute
positions, that it would see in a one-shot prefill.

Unwritten slots hold NaN (for every dtype here), so a read of a position beyond a
sequence's length would show up as NaN in the output; attention selects keys by length
and never reads them.  The cache is an inference structure: appends are
copies made under ``torch.no_grad()`` and no gradient flows through it.

Host syncs.  The lengths live on the host (a CPU int64 tensor): the cache is their only
writer (``append``, ``copy_prefix``, ``reset``, ``set_lengths``), so every check reads them
without waiting for the GPU, and the device gets copies through pinned memory
(``upload``: a non-blocking copy).  ``seq_ids`` / ``new_lengths`` given as CPU tensors (or
None) cost no device sync; given on a GPU they are read to the host together, one sync per
call.  The append's scatter uses index rows computed on the host from those known sizes, not
boolean masks (which sync to size their result).  ``lengths`` is therefore a copy: writing
into it changes nothing; ``set_lengths`` declares lengths of keys written into ``k``/``v``
directly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .validation import (
    INDEX_DTYPES,
    check_cache_settings,
    check_int,
    check_same_device,
    check_tensor,
)


def upload(t: Tensor, device: torch.device) -> Tensor:
    """A copy of host tensor ``t`` on ``device`` that does not wait for the GPU: ``t`` is first
    copied into fresh pinned memory (later edits of ``t`` cannot race the transfer), then sent
    with ``non_blocking=True``.  On the CPU, a clone."""
    if device.type == "cpu":
        return t.clone()
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)


def host_index_copies(**tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """CPU int64 copies of 1-d index tensors (None stays None), checked for type, dtype and rank
    first.  CPU tensors cost no device sync; the GPU ones are read in one transfer (one sync)."""
    for name, t in tensors.items():
        if t is not None:
            check_tensor(name, t, dtypes=INDEX_DTYPES, ndim=1)
    values = list(tensors.values())
    on_gpu = [i for i, t in enumerate(values) if t is not None and t.device.type != "cpu"]
    for i, t in enumerate(values):
        if t is not None and i not in on_gpu:
            values[i] = t.to(torch.int64, copy=True)
    if on_gpu:
        device = values[on_gpu[0]].device
        packed = torch.cat([values[i].to(device, torch.int64) for i in on_gpu]).cpu()
        for i, part in zip(on_gpu, packed.split([values[i].numel() for i in on_gpu]), strict=True):
            values[i] = part
    return tuple(values)


class KVCache:
    """Per-sequence key/value storage of a fixed capacity ``max_len``.

    ``append`` writes new keys after each sequence's current length; ``read`` returns the
    storage rows of some slots with their lengths, ready for
    ``attention(q, k, v, seqlens_k=lengths)``.  Appending beyond ``max_len`` raises
    ``ValueError`` naming the cache, the slot and the length it would reach.

    Failure atomicity: every method that mutates (``append``, ``copy_prefix``, ``reset``,
    ``set_lengths``) checks all its arguments before it writes, so a call that raises leaves
    every byte of ``k``/``v`` and every length as it was.  Slots, lengths and counts must be
    ints or integer tensors (a bool or a float is a TypeError, never rounded).
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
        device = check_cache_settings(
            name,
            dtype,
            device,
            batch=batch,
            max_len=max_len,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        self.name = name
        self.max_len = max_len
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self._lengths = torch.zeros(batch, dtype=torch.int64)  # host: the only copy kept

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

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def lengths(self) -> Tensor:
        """A copy of all slots' lengths, ``[batch]`` int64 on the cache's device (no host sync).
        Writing into it changes nothing: use ``set_lengths`` / ``reset``."""
        return upload(self._lengths, self.device)

    def host_lengths(self, seq_ids: Tensor | None = None) -> Tensor:
        """A CPU copy of the lengths of slots ``seq_ids`` (default all), in that order; no device
        sync for CPU ``seq_ids``, one for GPU ones."""
        return self._lengths[self._host_ids(seq_ids)]

    def slot_lengths(self, seq_ids: Tensor | None = None) -> Tensor:
        """``host_lengths(seq_ids)`` on the cache's device (a pinned upload, no further sync)."""
        return upload(self.host_lengths(seq_ids), self.device)

    def _host_ids(self, seq_ids: Tensor | None) -> Tensor:
        (ids,) = host_index_copies(seq_ids=seq_ids)
        return self._checked_ids(ids)

    def _checked_ids(self, ids: Tensor | None) -> Tensor:
        """Host slot ids: ``ids`` (a CPU int64 copy of ``seq_ids``) checked, or all slots."""
        if ids is None:
            return torch.arange(self.batch)
        bad = (ids < 0) | (ids >= self.batch)
        if bool(bad.any()):
            where = int(bad.nonzero()[0, 0])
            raise IndexError(
                f"{self.name}: seq_ids[{where}] = {int(ids[where])} is outside the "
                f"cache's slots [0, {self.batch})"
            )
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"{self.name}: seq_ids must not repeat a slot, got {ids.tolist()}")
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
        the slots (on the cache's device).  Nothing is written if any check fails, e.g. a
        slot would exceed ``max_len``.  Host syncs: see the module docstring.
        """
        _, grown = self.append_host(k_new, v_new, seq_ids, new_lengths)
        return upload(grown, self.device)

    def append_host(
        self,
        k_new: Tensor,
        v_new: Tensor,
        seq_ids: Tensor | None = None,
        new_lengths: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``append``, returning CPU int64 ``(slot ids, new lengths)`` of the appended rows:
        what a kernel's layout needs, with no device sync for CPU (or None) ids and lengths."""
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
        ids, counts = host_index_copies(seq_ids=seq_ids, new_lengths=new_lengths)
        ids = self._checked_ids(ids)
        n, s_new = k_new.shape[:2]
        if ids.numel() != n:
            raise ValueError(f"{self.name}: {n} new rows given for {ids.numel()} sequence slots")
        if counts is None:
            counts = torch.full((n,), s_new, dtype=torch.int64)
        else:
            if counts.numel() != n:
                raise ValueError(
                    f"new_lengths must have one entry per appended row ({n}), "
                    f"got shape {tuple(new_lengths.shape)}"
                )
            bad = (counts < 0) | (counts > s_new)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"new_lengths[{i}] = {int(counts[i])} is outside [0, {s_new}]")
        start = self._lengths[ids]
        grown = start + counts
        over = grown > self.max_len
        if bool(over.any()):
            i = int(over.nonzero()[0, 0])
            raise ValueError(
                f"{self.name}: appending {int(counts[i])} keys to sequence {int(ids[i])} "
                f"(length {int(start[i])}) would reach length {int(grown[i])}, "
                f"beyond the cache capacity max_len={self.max_len}"
            )
        self._scatter(k_new, v_new, ids, start, counts)
        self._lengths[ids] = grown
        return ids, grown.clone()

    def _scatter(self, k_new: Tensor, v_new: Tensor, ids: Tensor, start: Tensor, counts: Tensor):
        """Copies row ``i``'s first ``counts[i]`` positions to slot ``ids[i]`` from ``start[i]``
        on: one ``index_copy_`` per tensor into the flattened storage, with destination (and,
        for padded rows, source) row indices computed on the host and uploaded once."""
        n, s_new = k_new.shape[:2]
        total = int(counts.sum())
        if total == 0:
            return
        if bool((counts == s_new).all()):  # no padding: every source row, in order
            source = None
            dest = ((ids * self.max_len + start)[:, None] + torch.arange(s_new)[None, :]).ravel()
            index = upload(dest, self.device)
        else:
            row = torch.repeat_interleave(torch.arange(n), counts)  # [total]: source sequence
            first = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
            offset = torch.arange(total) - first  # position within the row's new keys
            dest = ids[row] * self.max_len + start[row] + offset
            index, source = upload(torch.stack([dest, row * s_new + offset]), self.device)
        rows = (self.batch * self.max_len, self.num_kv_heads, self.head_dim)
        with torch.no_grad():
            for storage, new in ((self.k, k_new), (self.v, v_new)):
                new_rows = new.reshape(n * s_new, *rows[1:])
                if source is not None:
                    new_rows = new_rows.index_select(0, source)
                storage.view(rows).index_copy_(0, index, new_rows)

    def read(self, seq_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(k, v, seqlens_k)`` for slots ``seq_ids`` (default all), in that slot order.

        ``k, v`` are ``[n, max_len, Hkv, d]`` copies of the storage rows (NaN past each
        length); ``seqlens_k`` is ``[n]`` int64 on the cache's device.
        """
        ids = self._host_ids(seq_ids)
        index = upload(ids, self.device)
        return self.k[index], self.v[index], upload(self._lengths[ids], self.device)

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
        src = check_int("src", src)
        dst = check_int("dst", dst)
        if length is not None:
            length = check_int("length", length)
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
        src_len = int(source._lengths[src])
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
        self._lengths[dst] = length

    def reset(self, seq_ids: Tensor | None = None) -> None:
        """Empties slots ``seq_ids`` (default all): length 0, storage back to NaN."""
        ids = self._host_ids(seq_ids)
        index = upload(ids, self.device)
        with torch.no_grad():
            self.k[index] = float("nan")
            self.v[index] = float("nan")
        self._lengths[ids] = 0

    def set_lengths(self, lengths: int | Tensor, seq_ids: Tensor | None = None) -> None:
        """Declares that slots ``seq_ids`` (default all) hold ``lengths`` keys (an int for all
        of them, or a 1-d int tensor with one entry per slot) already written into ``k``/``v``
        directly; the storage is not touched.  Lengths outside ``[0, max_len]`` raise
        ``ValueError``; a GPU ``lengths`` / ``seq_ids`` costs one device sync."""
        if isinstance(lengths, Tensor):
            ids, values = host_index_copies(seq_ids=seq_ids, lengths=lengths)
            ids = self._checked_ids(ids)
            if values.numel() != ids.numel():
                raise ValueError(
                    f"{self.name}: lengths must have one entry per slot ({ids.numel()}), got "
                    f"shape {tuple(lengths.shape)}"
                )
        elif isinstance(lengths, int) and not isinstance(lengths, bool):
            ids = self._host_ids(seq_ids)
            values = torch.full((ids.numel(),), lengths, dtype=torch.int64)
        else:
            raise TypeError(f"lengths must be an int or a tensor, got {type(lengths).__name__}")
        bad = (values < 0) | (values > self.max_len)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{self.name}: lengths[{i}] = {int(values[i])} is outside [0, "
                f"max_len={self.max_len}]"
            )
        self._lengths[ids] = values
