"""Tiny random Hugging Face checkpoints for engine tests (real config, safetensors, generation config)."""
from __future__ import annotations

from pathlib import Path

import torch


def make_checkpoint(out: Path, vocab: int = 40, hidden: int = 64, layers: int = 2, heads: int = 2,
                    max_pos: int = 512, eos: int = 1, seed: int = 0, scale: float = 3.0) -> Path:
    """Save a random Llama policy; ``scale`` sharpens the output layer so sampling is not uniform."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=max_pos, bos_token_id=0, eos_token_id=eos, pad_token_id=2,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=0, eos_token_id=eos, pad_token_id=2).save_pretrained(str(out))
    return out


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / temperature) of each token of a response, from one plain forward."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    n = len(prompt)
    return logp[n - 1:n - 1 + len(tokens)].gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
