"""An EAGLE-style draft head: one transformer layer over the policy's own features.

EAGLE (Li et al., 2024) drafts at the feature level: the input at position t is the policy's last
hidden state f_t (the one its LM head read to sample token x_{t+1}) joined with the embedding of
x_{t+1}; one decoder layer predicts f_{t+1}, and the policy's own LM head turns it into x_{t+2}. The
head reuses the policy's embedding and output layer (frozen; only ``fc`` and the layer train), so it
is small and reads what the policy "thinks", where a draft LM over tokens (``draft_lm.py``) only
reads what it wrote. TLT, NeMo-RL's online EAGLE-3 and slime's MTP train such heads during RL.

Here a row's history is a sequence of pairs (f_j, x_j): x_j was sampled from f_j. The head reads the
last ``window`` pairs (positions restart at every window, in training and drafting alike) and drafts
a greedy chain over its own KV cache, feeding back its own predicted feature and token. The output is read over a draft
vocabulary (the training data's tokens, EAGLE-3's reduced vocabulary): the rows of the policy's
output layer for those tokens only. Training is EAGLE-1's loss, smooth L1 between predicted and
true features plus 0.1 x cross-entropy on the next sampled token.
"""
from __future__ import annotations

import random
import time
from typing import Sequence

import torch

CLS_WEIGHT = 0.1  # EAGLE-1's weight of the token loss beside the feature regression


class EagleHead:
    """The head, its optimizer, and the two things done with it: draft a batch, train on sequences."""

    def __init__(self, policy, tokens: Sequence[int], window: int, lr: float, seed: int):
        from transformers import LlamaConfig
        pcfg = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
        self.hidden = int(pcfg.hidden_size)
        self.window = window
        self.d2t = sorted(set(int(t) for t in tokens))  # draft index i drafts token d2t[i]
        self.t2d = {t: i for i, t in enumerate(self.d2t)}
        heads = int(pcfg.num_attention_heads)
        self._config = LlamaConfig(vocab_size=1, hidden_size=self.hidden, num_hidden_layers=1,
                                   intermediate_size=int(getattr(pcfg, "intermediate_size", 4 * self.hidden)),
                                   num_attention_heads=heads,
                                   num_key_value_heads=int(getattr(pcfg, "num_key_value_heads", None) or heads),
                                   head_dim=self.hidden // heads, max_position_embeddings=window + 64,
                                   rope_theta=float(getattr(pcfg, "rope_theta", 10000.0)),
                                   rms_norm_eps=float(getattr(pcfg, "rms_norm_eps", 1e-6)),
                                   attn_implementation="eager")
        self._seed, self._lr = seed, lr
        import dataclasses

        from bench.drafters.model_passes import ModelPasses, shape_of
        shape = dataclasses.replace(shape_of(self._config, "eagle_head"), vocab=len(self.d2t))  # out_rows
        self.passes = ModelPasses(shape, extra_weights=2 * self.hidden * self.hidden)  # + fc: 2H -> H
        self.attach(policy)
        self.reset()
        import inspect
        params = inspect.signature(type(self.body).forward).parameters  # renamed in transformers 5.2x
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def attach(self, policy) -> None:
        """Read the policy's embedding and output rows (the embedding by reference, the draft vocabulary's output rows copied in float32, both frozen): after every
        weight sync, as a serving stack reloads the shared layers."""
        self.device = next(policy.parameters()).device
        self.embed = policy.get_input_embeddings()  # the policy's own module: no copy of its vocabulary
        with torch.no_grad():
            self.out_rows = policy.get_output_embeddings().weight.detach()[torch.tensor(self.d2t)].float()
        self._d2t_tensor = torch.tensor(self.d2t, device=self.device)

    def reset(self) -> None:
        """The untrained head (seeded: the same weights every time) and a fresh optimizer."""
        from transformers import LlamaModel
        with torch.random.fork_rng():
            torch.manual_seed(self._seed)
            self.fc = torch.nn.Linear(2 * self.hidden, self.hidden).to(self.device)
            self.body = LlamaModel(self._config).float().to(self.device).eval()
        self.opt = torch.optim.AdamW(self.parameters(), lr=self._lr, weight_decay=0.0)

    def parameters(self):
        return [*self.fc.parameters(), *(p for n, p in self.body.named_parameters() if "embed_tokens" not in n)]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _features(self, feats: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The predicted next feature at every position of left- or right-padded pairs [B, L]."""
        with torch.no_grad():
            embedded = self.embed(tokens).float()
        x = self.fc(torch.cat([embedded, feats], dim=-1))
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return self.body(inputs_embeds=x, attention_mask=mask, position_ids=positions).last_hidden_state

    @torch.no_grad()
    def propose(self, rows: Sequence[tuple[torch.Tensor, Sequence[int]]], k: int) -> list[tuple[list[int], list[float]]]:
        """A greedy chain of ``k`` tokens after each row's pairs (features [n, H], tokens [n]), with the
        head's logprobs over the draft vocabulary."""
        if not rows or k <= 0:
            return [([], []) for _ in rows]
        with self.passes:
            return self._propose(rows, k)

    def _propose(self, rows: Sequence[tuple[torch.Tensor, Sequence[int]]], k: int) -> list[tuple[list[int], list[float]]]:
        w = self.window
        lengths = [min(len(t), w) for _, t in rows]
        width = max(lengths)
        read = sum(lengths)
        self.passes.add(len(rows), read, read)  # the window once, then one pair a row a pass
        for j in range(1, k):
            self.passes.add(len(rows), len(rows), read + j * len(rows))
        B, H = len(rows), self.hidden
        feats = torch.zeros(B, width, H, device=self.device)
        tokens = torch.zeros(B, width, dtype=torch.long, device=self.device)
        mask = torch.zeros(B, width, dtype=torch.long, device=self.device)
        for b, ((f, t), n) in enumerate(zip(rows, lengths)):  # left-padded: the newest pair ends every row
            feats[b, width - n:] = f[-n:].to(self.device, torch.float32)
            tokens[b, width - n:] = torch.tensor(list(t[-n:]), device=self.device)
            mask[b, width - n:] = 1
        out_tokens, out_lps = [], []
        past, step_feats, step_tokens = None, feats, tokens
        for _ in range(k):  # the window once, then one new pair a step over the head's KV cache
            with torch.no_grad():
                x = self.fc(torch.cat([self.embed(step_tokens).float(), step_feats], dim=-1))
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -x.shape[1]:]
            out = self.body(inputs_embeds=x, attention_mask=mask, position_ids=positions, use_cache=True,
                            **{self._cache_arg: past})
            past = getattr(out, self._cache_arg)
            nxt = out.last_hidden_state[:, -1]
            lp = torch.log_softmax(nxt @ self.out_rows.T, dim=-1)
            best = lp.argmax(-1)
            out_lps.append(lp.gather(-1, best[:, None])[:, 0])
            token = self._d2t_tensor[best]
            out_tokens.append(token)
            step_feats, step_tokens = nxt[:, None], token[:, None]
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=self.device)], dim=1)
        t = torch.stack(out_tokens, 1).tolist()
        lps = torch.stack(out_lps, 1).tolist()
        return list(zip(t, lps))

    def train(self, sequences: Sequence[tuple[torch.Tensor, Sequence[int]]], steps: int, batch: int,
              rng: random.Random) -> dict:
        """``steps`` AdamW steps, each on ``batch`` windows of (feature, token) pairs drawn from
        ``sequences``: every position predicts the next pair's feature and token."""
        seqs = [(f, list(t)) for f, t in sequences if len(t) >= 2]
        if not seqs or steps <= 0:
            return {"seconds": 0.0, "loss": float("nan"), "tokens": 0}
        t0, total, counted = time.perf_counter(), 0.0, 0
        self.fc.train()
        self.body.train()
        H, L = self.hidden, self.window + 1
        for _ in range(steps):
            picks = []
            for f, t in (rng.choice(seqs) for _ in range(batch)):
                end = rng.randrange(1, len(t))  # the last target pair
                start = max(0, end - L + 1)
                picks.append((f[start:end + 1], t[start:end + 1]))
            width = max(len(t) for _, t in picks) - 1
            feats = torch.zeros(batch, width, H, device=self.device)
            tokens = torch.zeros(batch, width, dtype=torch.long, device=self.device)
            mask = torch.zeros(batch, width, dtype=torch.long, device=self.device)
            target_f = torch.zeros(batch, width, H, device=self.device)
            target_t = torch.full((batch, width), -100, dtype=torch.long, device=self.device)
            for b, (f, t) in enumerate(picks):  # right-padded: inputs pairs 0..n-2, targets 1..n-1
                n = len(t) - 1
                f = f.to(self.device, torch.float32)
                feats[b, :n], target_f[b, :n] = f[:-1], f[1:]
                tokens[b, :n] = torch.tensor(t[:-1], device=self.device)
                target_t[b, :n] = torch.tensor([self.t2d.get(x, -100) for x in t[1:]], device=self.device)
                mask[b, :n] = 1
            pred = self._features(feats, tokens, mask)
            real = mask.bool()
            reg = torch.nn.functional.smooth_l1_loss(pred[real], target_f[real])
            cls = torch.nn.functional.cross_entropy((pred @ self.out_rows.T)[real], target_t[real], ignore_index=-100)
            loss = reg + CLS_WEIGHT * (cls if torch.isfinite(cls) else 0.0)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            total += loss.item()
            counted += int(real.sum())
        self.fc.eval()
        self.body.eval()
        return {"seconds": time.perf_counter() - t0, "loss": total / steps, "tokens": counted}

    def corrupt(self, seed: int) -> None:
        """Overwrite every trained weight with noise: the fault a broken weight sync leaves."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * p.std().clamp(min=1e-3).cpu()).to(p.device))

    def __getstate__(self):
        """Snapshots (resume, timing repeats) keep the head and its optimizer, never the policy's rows."""
        state = dict(self.__dict__)
        for name in ("embed", "out_rows", "_d2t_tensor"):
            state[name] = None
        return state
