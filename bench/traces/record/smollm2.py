"""The real-model recording: GRPO with LoRA on SmolLM2-135M-Instruct over arithmetic word problems.

    python -m bench.traces.record --preset smollm2 --out traces/smollm2-word-problems --threads 2
    python -m bench.traces.record --preset smollm2 --tiny --out /tmp/smollm2-tiny --threads 2   # 2 steps, minutes

The recorder's loop (``bench.traces.record.grpo``) with three hooks changed: the policy is the
packaged model (``bench.traces.real_model``, float32) with rank-``lora_rank`` adapters on every
layer's q and v projections (``bench.traces.record.lora``), no SFT warm start; the prompts are
``bench.traces.record.word_problems`` stories in the model's chat template; a step's checkpoint is
the adapters as a delta on the packaged base (``bench.traces.deltas``: about 1.8 MB at rank 8,
against 517 MB merged), and the engine samples each step from the merged weights, computed by the
same code ``Trace.checkpoint`` merges with, so a replay reproduces the recorded rollouts.

Why LoRA and not full updates: a full float32 checkpoint is 517 MB, a trace keeps several, and on
two CPU cores a full AdamW step over 135M parameters would hold about 2 GB of optimizer state and
cost more than sampling; LoRA on q and v is what RL recipes on small budgets use, and what it costs
in realism is stated in results/LOG.md (the policy moves less per step than a full update would).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from bench.traces.record import word_problems
from bench.traces.record.grpo import Policy, RecordConfig, sparse_checkpoint


@dataclass
class SmolLM2RecordConfig(RecordConfig):
    """GRPO on SmolLM2-135M-Instruct: single additions (``events`` 0) at T = 1.0, a slow rate and
    DAPO's overlong filtering, so the answers stay long while the reward rises: at T = 0.9 and
    lr 5e-4 GRPO taught the model one-line answers within 3 steps (results/LOG.md)."""

    name: str = "smollm2-word-problems"
    steps: int = 20  # about 7 visits of each of 18 prompts within the 90 minutes
    num_prompts: int = 18
    prompts_per_step: int = 6
    n: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0  # mean answer 248 tokens, pass rate 10% before training (results/LOG.md)
    sft_steps: int = 0
    lr: float = 1e-4  # 5e-4 moved the policy to one-line answers in 3 steps
    grad_steps: int = 1
    events: int = 0  # events per story (0: one addition; word_problems.make_problem)
    overlong_filter: bool = True  # answers cut at max_new_tokens train nothing (DAPO): no push to shorten
    lora_rank: int = 8
    lora_alpha: float = 16.0
    micro_batch_tokens: int = 2048  # padded tokens a micro-batch: logits at vocabulary 49,152 are 200 KB a token
    checkpoint_every: int = 4
    checkpoint_last: int = 2

    @classmethod
    def tiny(cls, **kw) -> "SmolLM2RecordConfig":
        """A short real-model recording for tests: 2 steps of 2 prompts x 2 samples, 24 new tokens."""
        return replace(cls(name="smollm2-word-problems-tiny", steps=2, num_prompts=2, prompts_per_step=2, n=2,
                           max_new_tokens=24, checkpoint_every=1, checkpoint_last=0), **kw)

    task_module = word_problems

    def has_checkpoint(self, step: int) -> bool:
        return sparse_checkpoint(step, self.steps, self.checkpoint_every, self.checkpoint_last)

    def build_tokenizer(self):
        from transformers import AutoTokenizer

        from bench.traces.real_model import ensure_real_model
        return AutoTokenizer.from_pretrained(str(ensure_real_model()))

    def make_problems(self) -> list:
        return word_problems.make_problems(self.seed + 17, self.num_prompts, self.events)

    def prompt_text(self, tokenizer, problem) -> str:
        return problem.text  # the story; its chat-template tokens are the prompt's token_ids

    def prompt_ids(self, tokenizer, problem) -> list[int]:
        return word_problems.chat_prompt(tokenizer, problem)

    def build_policy(self, tokenizer, progress: bool) -> Policy:
        """The packaged model with LoRA adapters (the base frozen); saved as deltas on it."""
        import torch
        from transformers import AutoModelForCausalLM

        from bench.traces.deltas import REAL_BASE, merge_into
        from bench.traces.real_model import ensure_real_model
        from bench.traces.record.lora import add_lora, lora_parameters, save_lora

        model = AutoModelForCausalLM.from_pretrained(str(ensure_real_model()), dtype=torch.float32)
        wrapped = add_lora(model, rank=self.lora_rank, alpha=self.lora_alpha, seed=self.seed)

        def save(folder: Path, scratch: Path) -> Path:
            save_lora(wrapped, folder, base=REAL_BASE)
            return merge_into(folder, scratch / "merged")
        return Policy(model.eval(), lora_parameters(wrapped), save, [])
