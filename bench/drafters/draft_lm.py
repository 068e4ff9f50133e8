"""A small draft language model over tokens, trained on the run's own rollouts.

The learned family's simplest member (a draft model in the sense of Leviathan et al.; FastGRPO and
TLT train theirs online): a Llama of a few layers that reads the last ``window`` tokens of a
row's context and drafts a greedy chain. It shares nothing with the policy but the vocabulary, so
it runs under any engine and in the simulator. Positions restart at every window, in training and
drafting alike, so a window is all the model ever sees. Its vocabulary is the tokens the warm-up
data holds (EAGLE-3 drafts over a reduced vocabulary too): a real model's rollouts use a few
thousand of its 49k-152k tokens, and the output layer is most of a small model's cost.

``propose`` drafts for a whole batch of rows in one call (left-padded windows, the language-model
head applied only at the positions drafted); ``train`` runs AdamW steps of cross-entropy on the
sampled tokens of rollouts (a window's targets are its response tokens).
"""
from __future__ import annotations

import random
import time
from typing import Sequence

import torch


class DraftLM:
    """The model, its optimizer and the two things done with it: draft a batch, train on rollouts."""

    def __init__(self, tokens: Sequence[int], layers: int, hidden: int, heads: int, window: int, lr: float,
                 seed: int):
        from transformers import LlamaConfig
        self.window = window
        self.d2t = [-1] + sorted(set(tokens))  # draft id 0: every token outside the draft vocabulary
        self.t2d = {t: i for i, t in enumerate(self.d2t) if i}
        config = LlamaConfig(vocab_size=len(self.d2t), hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                             max_position_embeddings=window + 64, tie_word_embeddings=True,
                             attn_implementation="eager")
        self._config, self._seed, self._lr = config, seed, lr
        from bench.drafters.model_passes import ModelPasses, shape_of
        self.passes = ModelPasses(shape_of(config, "draft_lm"))  # what its drafting costs on a GPU
        self.reset()
        self.pad = 0
        import inspect
        params = inspect.signature(type(self.model.model).forward).parameters  # renamed in transformers 5.2x
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def reset(self) -> None:
        """The untrained model (seeded: the same weights every time) and a fresh optimizer."""
        from transformers import LlamaForCausalLM
        with torch.random.fork_rng():
            torch.manual_seed(self._seed)
            self.model = LlamaForCausalLM(self._config).float().eval()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self._lr, weight_decay=0.0)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _ids(self, tokens: Sequence[int]) -> list[int]:
        t2d = self.t2d  # a token outside the draft vocabulary reads as id 0, and is never drafted
        return [t2d.get(t, 0) for t in tokens]

    @torch.no_grad()
    def propose(self, contexts: Sequence[Sequence[int]], k: int) -> list[tuple[list[int], list[float]]]:
        """A greedy chain of ``k`` tokens after each context, with the draft model's logprobs."""
        if not contexts or k <= 0:
            return [([], []) for _ in contexts]
        with self.passes:
            return self._propose(contexts, k)

    def _propose(self, contexts: Sequence[Sequence[int]], k: int) -> list[tuple[list[int], list[float]]]:
        windows = [self._ids(c[-self.window:]) for c in contexts]
        width = max(len(w) for w in windows)
        read = sum(len(w) for w in windows)
        self.passes.add(len(windows), read, read)  # the windows once, then one token a row a pass
        for j in range(1, k):
            self.passes.add(len(windows), len(windows), read + j * len(windows))
        ids = torch.tensor([[self.pad] * (width - len(w)) + w for w in windows])
        mask = torch.tensor([[0] * (width - len(w)) + [1] * len(w) for w in windows])
        tokens, logprobs = [], []
        past = None
        body, head = self.model.model, self.model.lm_head
        step_ids = ids
        for _ in range(k):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            out = body(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       **{self._cache_arg: past})
            past = getattr(out, self._cache_arg)
            logits = head(out.last_hidden_state[:, -1]).float()
            logits[:, 0] = float("-inf")
            lp = torch.log_softmax(logits, dim=-1)
            best = lp.argmax(-1)
            tokens.append(best)
            logprobs.append(lp.gather(-1, best[:, None])[:, 0])
            step_ids = best[:, None]
            mask = torch.cat([mask, torch.ones(len(windows), 1, dtype=mask.dtype)], dim=1)
        d2t = self.d2t
        t = [[d2t[i] for i in row] for row in torch.stack(tokens, 1).tolist()]
        lp = torch.stack(logprobs, 1).tolist()
        return list(zip(t, lp))

    def train(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], steps: int, batch: int,
              rng: random.Random) -> dict:
        """``steps`` AdamW steps, each on ``batch`` windows drawn from (prompt, response) pairs; a
        window ends at a random response token and its loss is on its response tokens."""
        pairs = [(list(p), list(r)) for p, r in sequences if r]
        if not pairs or steps <= 0:
            return {"seconds": 0.0, "loss": float("nan"), "tokens": 0}
        t0, total, tokens = time.perf_counter(), 0.0, 0
        self.model.train()
        for _ in range(steps):
            rows, targets = [], []
            for p, r in (rng.choice(pairs) for _ in range(batch)):
                end = len(p) + rng.randrange(len(r))  # predict token `end` of prompt + response
                seq = self._ids((p + r)[max(0, end - self.window):end + 1])
                first_target = max(1, len(seq) - 1 - (end - len(p)))  # response tokens only
                rows.append(seq)
                targets.append([-100] * first_target + [t or -100 for t in seq[first_target:]])  # not unknowns
            width = max(len(s) for s in rows)
            ids = torch.tensor([s + [self.pad] * (width - len(s)) for s in rows])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in rows])
            labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
            loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            total += loss.item()
            tokens += int((labels[:, 1:] != -100).sum())
        self.model.eval()
        return {"seconds": time.perf_counter() - t0, "loss": total / steps, "tokens": tokens}

    def corrupt(self, seed: int) -> None:
        """Overwrite every weight with noise: the fault a broken weight sync leaves (a test injects it)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * p.std().clamp(min=1e-3))
