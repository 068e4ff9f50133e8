"""A KV cache with one row per rollout and explicit write slots, so ragged tree drafts of a whole
batch are verified in one forward pass and rejected nodes are simply never marked valid.

Transformers' attention layers call ``update(keys, values, layer_idx, ...)``; this cache scatters
the new block into each row at the slots the engine chose and returns the first ``view_len`` slots.
Which slots a query may see is the engine's additive 4D mask, never this class's business.
Exercised by ``pytest tests/test_torch_ref.py``.
"""
from __future__ import annotations

import torch


class SlotKVCache:
    """Per layer keys/values [B, H, capacity + 1, D]; the extra last slot absorbs padding queries."""

    is_compileable = False

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = 0
        self.view_len = 0
        self._write_index: torch.Tensor | None = None  # [b, q] slot of each block position
        self._subset: torch.Tensor | None = None  # [b] rows of this forward (None = all rows)

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
        if layer_idx == len(self.keys):
            shape = (self.rows or B, H, self.capacity + 1, D)
            self.keys.append(torch.zeros(shape, dtype=key_states.dtype, device=key_states.device))
            self.values.append(torch.zeros(shape, dtype=value_states.dtype, device=value_states.device))
        k, v = self.keys[layer_idx], self.values[layer_idx]
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

    def keep_rows(self, rows: list[int]) -> None:
        """Drop finished rows: keep ``rows`` (old indices) in that order."""
        self.rows = len(rows)
        if not self.keys:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.keys[0].device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]

    def add_rows(self, n: int, capacity: int) -> None:
        """Append n empty rows, growing every row's capacity to at least ``capacity``."""
        if capacity > self.capacity:
            self._grow(capacity)
        self.rows += n
        if not self.keys:
            return
        self.keys = [torch.cat([k, k.new_zeros((n,) + k.shape[1:])]) for k in self.keys]
        self.values = [torch.cat([v, v.new_zeros((n,) + v.shape[1:])]) for v in self.values]

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.capacity = capacity
        self.keys = [torch.cat([k, k.new_zeros(k.shape[:2] + (extra, k.shape[3]))], 2) for k in self.keys]
        self.values = [torch.cat([v, v.new_zeros(v.shape[:2] + (extra, v.shape[3]))], 2) for v in self.values]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src[b, i] to dst[b, i] in every layer (compacts accepted tree paths)."""
        for cache in (self.keys, self.values):
            for t in cache:
                B, H, _, D = t.shape
                gathered = t.gather(2, src[:, None, :, None].expand(B, H, src.shape[1], D))
                t.scatter_(2, dst[:, None, :, None].expand(B, H, dst.shape[1], D), gathered)
