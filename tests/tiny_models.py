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


# Qwen2.5-0.5B's shape where it matters to the engine: its 151,936-token vocabulary, grouped-query
# attention (14 query heads share 2 KV heads there: 4 share 1 here), a head tied to the input
# embedding, its special token ids and RoPE base; hidden size and depth cut so CPU tests stay fast.
QWEN2_VOCAB = 151_936
QWEN2_EOS = 151_643  # <|endoftext|>, also the base model's bos


def make_qwen2_checkpoint(out: Path, vocab: int = QWEN2_VOCAB, hidden: int = 32, layers: int = 2, heads: int = 8,
                          kv_heads: int = 2, max_pos: int = 1024, seed: int = 0, scale: float = 1.0) -> Path:
    """Save a random-init Qwen2 policy with Qwen2.5-0.5B's vocabulary, tied head and GQA.

    ``scale`` multiplies the final norm's weight: with a tied head that scales every logit (a
    random-init model over 152k tokens is otherwise almost uniform, and no draft is ever accepted).
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      bos_token_id=QWEN2_EOS, eos_token_id=QWEN2_EOS)
    model = Qwen2ForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the head must be tied, as in Qwen2.5-0.5B"
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    GenerationConfig(bos_token_id=QWEN2_EOS, eos_token_id=QWEN2_EOS).save_pretrained(str(out))
    return out


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / temperature) of each token of a response, from one plain forward."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    n = len(prompt)
    return logp[n - 1:n - 1 + len(tokens)].gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
