"""torch_ref as a backend of the scheduler: the ragged block of one forward pass (chains and trees
through an additive 4D mask with explicit positions), the pass and the verification, and keeping
the KV of each row's accepted path.

    pytest tests/test_torch_ref.py
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from methods.base import Draft

from bench.core.sampling import SamplingConfig
from bench.spec.scheduler import LiveRow, PassResult
from bench.core.verify import Verdict, VerifyConfig, verify_nodes
from bench.core.engine_protocol import Request
from bench.engines.torch.kv_slots import SlotKVCache

MASK_BYTES = 64 << 20  # a pass's attention mask above this (rows x queries x context) runs in tiles (_tile)


class TorchBackend:
    """One rollout call's KV cache and passes over a loaded ``TorchRefEngine``'s model."""

    def __init__(self, engine):
        self.engine = engine
        self.cache = SlotKVCache(capacity=1)
        self.keep_features = False  # the scheduler sets it for a drafter that reads the policy's hidden states

    def stops(self, sampling: SamplingConfig) -> set[int]:
        return set(self.engine.info.eos_token_ids) | set(sampling.stop_token_ids)

    def fits(self, request: Request, sampling: SamplingConfig) -> bool:
        return self.engine._fits(request, sampling)

    def start_call(self, sampling: SamplingConfig) -> None:
        self.cache = SlotKVCache(capacity=1)

    def admit(self, rows: list[LiveRow], sampling: SamplingConfig) -> None:
        need = max(len(r.request.prompt_token_ids) for r in rows) + sampling.max_new_tokens + 1
        with torch.inference_mode():
            self.cache.add_rows(len(rows), max(need, self.cache.capacity))

    def forward(self, rows: list[LiveRow], group: list[int], drafts: list[Draft], sampling: SamplingConfig,
                verify: VerifyConfig) -> PassResult:
        eng, cache = self.engine, self.cache
        with torch.inference_mode():
            t_f = time.perf_counter()
            g_rows = [rows[i] for i in group]
            chunk = self._chunk_rows(g_rows, drafts)
            block = Block.build(g_rows, drafts, cache, eng.device, eng.dtype, mask=not chunk)
            subset = None if len(group) == len(rows) else torch.tensor(group, device=eng.device)
            self._subset = subset
            cache.set_block(block.write_index, block.view_len, subset)
            if block.mask is None:  # a long chain block: in tiles of rows x queries, each with its own mask
                logits_at, head_s = self._chunked(block)
            else:
                logits_at, head_s = eng._node_logits(block, cache)
            if eng.device.type == "cuda":
                torch.cuda.synchronize()  # forward seconds are the model's, not the verifier's
            t_v = time.perf_counter()
            keys = torch.tensor([r.key64 for r in g_rows], dtype=torch.int64)
            verdicts = verify_nodes(logits_at, eng._vocab, drafts, keys, [len(r.output) for r in g_rows],
                                    sampling, verify, device=eng.device)
            features = self._features(logits_at, verdicts) if self.keep_features else None
            return PassResult(verdicts, t_v - t_f + head_s[0], time.perf_counter() - t_v - head_s[0], features)

    def _features(self, logits_at, verdicts: list[Verdict]) -> list:
        """Per row, the last hidden state at each node of its accepted path: the state the output
        layer read to sample each emitted token (``Verdict.path``)."""
        features_at = getattr(logits_at, "features_at", None)
        if features_at is None:
            raise ValueError("this model runs as one piece (no separate base model), so torch_ref cannot hand "
                             "its hidden states to a drafter that reads them")
        device = self.engine.device
        return [features_at(b, torch.tensor(v.path, device=device)) for b, v in enumerate(verdicts)]

    def _chunk_rows(self, rows: list[LiveRow], drafts: list[Draft]) -> int:
        """Nonzero when a block's mask would pass ``MASK_BYTES``, so it runs in tiles (``_tile`` sizes
        them; 0: one pass, one mask). Only chain blocks on an engine that runs the model's base (its
        output layer applied apart)."""
        q = max(len(r.pending) + len(d) for r, d in zip(rows, drafts))
        view = max(r.cached + len(r.pending) + len(d) for r, d in zip(rows, drafts))
        itemsize = torch.finfo(self.engine.dtype).bits // 8
        if (self.engine._base is None or any(d.parents is not None for d in drafts)
                or len(rows) * q * view * itemsize <= MASK_BYTES):
            return 0
        return max(1, min(q, MASK_BYTES // (len(rows) * view * itemsize)))

    def _tile(self, rows: int, view: int) -> tuple[int, int]:
        """Rows and queries of one model call of a chunked block. Queries: the tile's mask within
        ``MASK_BYTES`` (as many tokens per call as a query chunk of every row). Rows: with
        grouped-query attention transformers' sdpa copies the K/V a tile reads once per query head
        (``repeat_kv``: heads / kv heads times the layer's KV of the tile's rows, 7x for Qwen2.5),
        so a tile of rows / (2 x that ratio) rows copies at most half of one layer's KV; a model with
        one KV head per query head keeps whole rows (its K/V are views of the cache, no copy)."""
        cfg = self.engine.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        groups = heads // int(getattr(cfg, "num_key_value_heads", None) or heads)
        tile_rows = rows if groups <= 1 else max(1, rows // (2 * groups))
        itemsize = torch.finfo(self.engine.dtype).bits // 8
        return tile_rows, max(1, MASK_BYTES // (tile_rows * view * itemsize))

    def _chunked(self, block: "Block"):
        """The base model over a block in tiles of rows x queries (``_tile``): each call writes its
        keys and values and reads every slot of its rows before it, so the result is the one-pass
        result (up to floating point) with a mask and K/V copies of one tile, not of the block. The
        hidden states of the kept positions (the verifier's, the last ``block.keep``) are written
        into one buffer; nothing else of a tile outlives it."""
        eng, cache = self.engine, self.cache
        B, q = block.input_ids.shape
        tile_rows, chunk = self._tile(B, block.view_len)
        device = block.write_index.device
        real = block.write_index != block.trash
        cols = torch.arange(block.view_len, device=device)
        every = self._subset if self._subset is not None else torch.arange(B, device=device)
        first = q - block.keep  # block index of the first kept position
        hidden = None
        for b in range(0, B, tile_rows):
            rows = slice(b, b + tile_rows)
            subset = self._subset if tile_rows >= B else every[rows]
            for a in range(0, q, chunk):
                slot, ok = block.write_index[rows, a:a + chunk], real[rows, a:a + chunk]
                view = int(slot[ok].max()) + 1 if bool(ok.any()) else 1
                allowed = (cols[None, None, :view] <= slot[:, :, None]) & ok[:, :, None]
                allowed[:, :, 0] |= ~ok  # padding queries look at slot 0 only (never an empty softmax)
                cache.set_block(slot, view, subset)
                out = eng._base(input_ids=block.input_ids[rows, a:a + chunk],
                                position_ids=block.position_ids[rows, a:a + chunk],
                                attention_mask=_additive(allowed, eng.dtype), use_cache=True,
                                **{eng._base_cache_kw: cache}).last_hidden_state
                end = a + out.shape[1]
                if end > first:
                    if hidden is None:
                        hidden = out.new_empty(B, block.keep, out.shape[-1])
                    start = max(a, first)
                    hidden[rows, start - first:end - first] = out[:, start - a:]
                del out
        return eng._head_at(replace(block, root_index=block.root_index - first), hidden, [0.0])

    def commit(self, rows: list[LiveRow], verdicts: list[Verdict]) -> None:
        """Move each row's accepted path (tree nodes off the first branch) into consecutive slots."""
        moves = []
        for b, (row, v) in enumerate(zip(rows, verdicts)):
            root_slot = row.cached + len(row.pending) - 1
            if any(p != i for i, p in enumerate(v.path)):
                moves.append((b, [root_slot + p for p in v.path], [root_slot + i for i in range(len(v.path))]))
        if not moves:
            return
        cache, device = self.cache, self.engine.device
        width = max(len(s) for _, s, _ in moves)
        src = torch.tensor([[cache.trash_slot] * width] * len(rows), dtype=torch.int64)
        dst = src.clone()
        for b, s, t in moves:
            src[b, :len(s)] = torch.tensor(s)
            dst[b, :len(t)] = torch.tensor(t)
        with torch.inference_mode():
            cache.move_slots(src.to(device), dst.to(device))

    def release(self, keep: list[int], rows: list[LiveRow]) -> None:
        with torch.inference_mode():
            self.cache.keep_rows(keep, used=max((r.cached for r in rows), default=0))


@dataclass
class Block:
    """The ragged input of one forward pass, left-padded so every row's nodes end the block.

    Row b feeds its pending tokens then its draft nodes; its local node j (0 = last pending
    token) sits at block index q - (1 + k_b) + j.
    """

    input_ids: torch.Tensor  # [B, q]
    position_ids: torch.Tensor  # [B, q]
    write_index: torch.Tensor  # [B, q] cache slot of each block position (padding -> trash slot)
    mask: torch.Tensor | None  # [B, 1, q, view_len] additive (None: built per query chunk)
    node_index: torch.Tensor  # [B, K] block index of local node j (K = keep)
    keep: int  # logits kept: the last K block positions
    view_len: int
    trash: int
    root_index: torch.Tensor | None = None  # [B] block index of local node 0 (node j at root + j)

    @classmethod
    def build(cls, rows: list[LiveRow], drafts: list[Draft], cache: SlotKVCache, device, dtype,
              mask: bool = True) -> "Block":
        """The block of ``rows`` and their ``drafts``; ``mask=False`` (chains only) leaves ``mask``
        None for a caller that builds it chunk by chunk (``TorchBackend._chunked``)."""
        B = len(rows)
        sizes = [len(r.pending) + len(d) for r, d in zip(rows, drafts)]
        q, K = max(sizes), 1 + max(len(d) for d in drafts)
        trash = cache.trash_slot
        if q == 1:  # plain decoding, the common case: one token per row, no padding, no tree
            slot = torch.tensor([[r.cached] for r in rows])
            view_len = int(slot.max()) + 1
            allowed = torch.arange(view_len)[None, None, :] <= slot[:, :, None]
            mask = _additive(allowed, dtype)
            ids = torch.tensor([r.pending for r in rows])
            return cls(*_on(device, ids, slot, slot, mask, torch.zeros(B, 1, dtype=torch.int64)), 1, view_len, trash,
                       torch.zeros(B, dtype=torch.int64))
        chains = all(d.parents is None for d in drafts)
        ids, pos, slot, parent, node_index = [], [], [], [], []  # built as lists: one tensor each
        for row, d, s in zip(rows, drafts, sizes):
            n_p, k, off = len(row.pending), len(d), q - s
            ids.append([0] * off + row.pending + d.token_ids)
            slot.append([trash] * off + list(range(row.cached, row.cached + s)))
            node_index.append(list(range(K - k - 1, K)) + [0] * (K - k - 1))  # into the kept last K positions
            if chains:
                pos.append([0] * off + list(range(row.cached, row.cached + s)))
            else:
                par = [-1] + list(range(off, off + n_p - 1)) + [off + n_p + p for p in d.parent_list()]
                parent.append([-1] * off + par)
                depth = list(range(n_p)) + [n_p - 1 + x for x in _depths(d)]
                pos.append([0] * off + [row.cached + x for x in depth])
        ids, pos, slot = torch.tensor(ids), torch.tensor(pos), torch.tensor(slot)
        node_index = torch.tensor(node_index)
        view_len = int(max(r.cached + s for r, s in zip(rows, sizes)))
        real = slot != trash  # [B, q]
        if chains and not mask:
            root = torch.tensor([q - 1 - len(d) for d in drafts])
            return cls(*_on(device, ids, pos, slot), None, *_on(device, node_index), K, view_len, trash,
                       *_on(device, root))
        cols = torch.arange(view_len)
        if chains:  # slots of a row are contiguous, so a query sees every slot up to its own
            allowed = (cols[None, None, :] <= slot[:, :, None]) & real[:, :, None]
        else:
            cached = torch.tensor([r.cached for r in rows])
            allowed = torch.cat([(cols[None, None, :] < cached[:, None, None]) & real[:, :, None],
                                 torch.zeros(B, q, 1, dtype=torch.bool)], 2)  # [B, q, view+1]
            # the block's own slots lie past every cached one; padding columns land in the spare last column
            slot_in_view = torch.where(real, slot, torch.full_like(slot, view_len))
            allowed.scatter_(2, slot_in_view[:, None, :].expand(B, q, q), _ancestors(torch.tensor(parent))
                             & real[:, None, :])
            allowed = allowed[..., :view_len]
        allowed[:, :, 0] |= ~real  # padding queries look at slot 0 only (never an empty softmax)
        mask = _additive(allowed, dtype)
        root = torch.tensor([q - 1 - len(d) for d in drafts])
        return cls(*_on(device, ids, pos, slot, mask, node_index), K, view_len, trash, root)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, q, L] bool -> [B, 1, q, L] additive attention mask (0 where allowed, dtype's min elsewhere)."""
    return torch.where(allowed[:, None], torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))


def _on(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tensors moved to the model's device (a no-op call still costs microseconds on CPU)."""
    return tensors if device.type == "cpu" else tuple(t.to(device) for t in tensors)


def _depths(d: Draft) -> list[int]:
    out: list[int] = []
    for p in d.parent_list():
        out.append(1 if p < 0 else out[p] + 1)
    return out


def _ancestors(parent: torch.Tensor) -> torch.Tensor:
    """[B, q] block-local parents -> [B, q, q] bool: query i may attend block position j."""
    B, q = parent.shape
    eye = torch.eye(q, dtype=torch.bool).expand(B, q, q).clone()
    out = eye.clone()
    cur = parent.clone()
    rows = torch.arange(B)[:, None]
    cols = torch.arange(q)[None, :].expand(B, q)
    while bool((cur >= 0).any()):
        valid = cur >= 0
        out[rows.expand(B, q)[valid], cols[valid], cur[valid]] = True
        cur = torch.where(valid, parent.gather(1, cur.clamp(min=0)), cur)
    return out
