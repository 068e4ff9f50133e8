"""A KV cache with one row per rollout and explicit write slots, so ragged tree drafts of a whole
batch are verified in one forward pass and rejected nodes are simply never marked valid.

Transformers' attention layers call ``update(keys, values, layer_idx, ...)``; this cache scatters
the new block into each row at the slots the engine chose and returns the first ``view_len`` slots.
Which slots a query may see is the engine's additive 4D mask, never this class's business.

Memory is allocated uninitialised and zeroed lazily, only as far as a forward pass reads
(``_zeroed``): a masked slot weighs exactly 0, but an uninitialised one may hold NaN, and
0 x NaN is NaN, so every slot a pass reads holds zeros, stale finite KV or this call's KV.
Why: zeroing the whole buffer up front (rows x (longest prompt + max_new_tokens + 1) slots, every
layer) took about 50 ms of each main-job rollout call on a CPU (8% of the baseline's call, more
of a faster method's), for slots a long-tailed step mostly never reaches (results/LOG.md). Only
live rows are zeroed: a row that finished is never read again until ``add_rows`` reuses it, which
zeroes it then, so a long tail with one live row does not touch (and keep resident) every dead
row's slots, which at 15 interleaved methods on a real model was most of the process's memory.
``poison=True`` fills new memory with NaN instead, so a test proves that no pass reads a slot
before it is zeroed or written. Exercised by ``pytest tests/test_torch_ref.py``.
"""
from __future__ import annotations

import torch


class SlotKVCache:
    """Per layer keys/values [B, H, capacity + 1, D]; the extra last slot absorbs padding queries.

    Rows live in a buffer that may hold more rows than are live (``rows`` of them, the first ones):
    dropping finished rows moves only the later live rows' used slots up (``keep_rows``), and
    admitting rows reuses the freed ones, so neither copies the whole cache each time a rollout
    finishes or starts. A reused row's stale slots are never read before they are written (the
    engine's mask shows a query only its row's valid slots and its own block).
    """

    is_compileable = False

    def __init__(self, capacity: int, poison: bool = False):
        self.capacity = capacity
        self.poison = poison  # tests: new memory holds NaN (what uninitialised memory may hold)
        self._keys: list[torch.Tensor] = []  # [allocated rows, H, capacity + 1, D] per layer
        self._values: list[torch.Tensor] = []
        self._zeroed: list[int] = []  # per layer: slots [0, n) of every row below _clean hold finite values
        self._clean: list[int] = []  # per layer: rows [0, c) are zeroed as far as _zeroed (others: dead rows)
        self.rows = 0
        self.view_len = 0
        self._write_index: torch.Tensor | None = None  # [b, q] slot of each block position
        self._subset: torch.Tensor | None = None  # [b] rows of this forward (None = all rows)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Keys of the live rows per layer, [rows, H, capacity + 1, D] (views of the buffer)."""
        return [k[:self.rows] for k in self._keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[:self.rows] for v in self._values]

    @property
    def trash_slot(self) -> int:
        return self.capacity

    def set_block(self, write_index: torch.Tensor, view_len: int, subset: torch.Tensor | None = None) -> None:
        """Where the next forward's block goes ([b, q] slots), how many slots it may read, and
        which rows it covers (``subset`` [b] row indices; None = every row, in order)."""
        self._write_index = write_index
        self.view_len = view_len
        self._subset = subset

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        B, H, q, D = key_states.shape
        if layer_idx == len(self._keys):
            shape = (self.rows or B, H, self.capacity + 1, D)
            self._keys.append(self._new(key_states.new_empty(shape)))
            self._values.append(self._new(value_states.new_empty(shape)))
            self._zeroed.append(0)
            self._clean.append(shape[0])
        n = self.rows or B
        if self.view_len > self._zeroed[layer_idx]:  # before the block is written: it may lie in the range
            for t in (self._keys[layer_idx], self._values[layer_idx]):  # live rows only: dead ones are never
                t[:n, :, self._zeroed[layer_idx]:self.view_len].zero_()  # read (add_rows cleans a reused one)
            self._zeroed[layer_idx] = self.view_len
            self._clean[layer_idx] = min(self._clean[layer_idx], n)
        k, v = self._keys[layer_idx][:n], self._values[layer_idx][:n]
        if self._subset is None:
            index = self._write_index[:, None, :, None].expand(B, H, q, D)
            k.scatter_(2, index, key_states)
            v.scatter_(2, index, value_states)
            return k[:, :, :self.view_len], v[:, :, :self.view_len]
        rows = self._subset[:, None].expand(B, q)
        k[rows, :, self._write_index] = key_states.transpose(1, 2)  # advanced indices: [b, q, H, D]
        v[rows, :, self._write_index] = value_states.transpose(1, 2)
        return (k[:, :, :self.view_len].index_select(0, self._subset),
                v[:, :, :self.view_len].index_select(0, self._subset))

    # transformers may ask these of any cache object; positions and masks are always explicit here
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.view_len

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.view_len, 0

    def keep_rows(self, rows: list[int], used: int | None = None) -> None:
        """Drop finished rows: keep ``rows`` (old indices, increasing) in that order. ``used``: the
        slots [0, used) that hold the kept rows' valid KV (None: every slot); only those move."""
        if list(rows) != sorted(set(rows)):
            raise ValueError("keep_rows: the kept rows must be distinct and in increasing order")
        self.rows, old = len(rows), self.rows
        first = next((j for j, r in enumerate(rows) if r != j), len(rows))  # rows before it stay put
        if not self._keys or first == len(rows):
            return
        width = self.capacity + 1 if used is None else max(0, min(int(used), self.capacity + 1))
        if width == 0:
            return
        index = torch.tensor(rows[first:], dtype=torch.int64, device=self._keys[0].device)
        for t in (*self._keys, *self._values):
            t[first:len(rows), :, :width] = t[:old, :, :width].index_select(0, index)

    def add_rows(self, n: int, capacity: int) -> None:
        """Append n empty rows, growing every row's capacity to at least ``capacity``."""
        if capacity > self.capacity:
            self._grow(capacity)
        self.rows += n
        if not self._keys:
            return
        allocated = self._keys[0].shape[0]
        for layer, (k, v) in enumerate(zip(self._keys, self._values)):  # reused rows that died before the
            reused = min(self.rows, allocated)  # cache was last zeroed further: zeroed as far as the live ones
            if self._clean[layer] < reused:
                k[self._clean[layer]:reused, :, :self._zeroed[layer]].zero_()
                v[self._clean[layer]:reused, :, :self._zeroed[layer]].zero_()
                self._clean[layer] = reused
        if allocated >= self.rows:
            return  # freed rows are reused: their stale slots are finite and written before they are read
        extra = self.rows - allocated
        self._keys = [self._append_rows(k, extra, z) for k, z in zip(self._keys, self._zeroed)]
        self._values = [self._append_rows(v, extra, z) for v, z in zip(self._values, self._zeroed)]
        self._clean = [self.rows] * len(self._keys)

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.capacity = capacity  # the trash slot (the last) moves; its contents are never read
        self._keys = [torch.cat([k, self._new(k.new_empty(k.shape[:2] + (extra, k.shape[3])))], 2) for k in self._keys]
        self._values = [torch.cat([v, self._new(v.new_empty(v.shape[:2] + (extra, v.shape[3])))], 2)
                        for v in self._values]

    def _new(self, t: torch.Tensor) -> torch.Tensor:
        """Freshly allocated memory as it is (or NaN under ``poison``): zeroed when first read."""
        return t.fill_(float("nan")) if self.poison else t

    def _append_rows(self, t: torch.Tensor, extra: int, zeroed: int) -> torch.Tensor:
        """``t`` with ``extra`` new rows, whose slots [0, zeroed) are zeroed as every row's are."""
        new = self._new(t.new_empty((extra,) + t.shape[1:]))
        new[:, :, :zeroed].zero_()
        return torch.cat([t, new])

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src[b, i] to dst[b, i] in every layer (compacts accepted tree paths)."""
        for t in (*self.keys, *self.values):
            B, H, _, D = t.shape
            gathered = t.gather(2, src[:, None, :, None].expand(B, H, src.shape[1], D))
            t.scatter_(2, dst[:, None, :, None].expand(B, H, dst.shape[1], D), gathered)
