"""The tiny Llama-architecture policy of the recorder, and how its checkpoints are saved.

    python -m bench.traces.record.model --out tiny_policy

Small enough to train on a laptop CPU in seconds, yet a standard ``LlamaForCausalLM`` that every
engine loads (head_dim 64: vLLM's CPU attention refuses smaller heads).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


@dataclass
class ModelConfig:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False


def build_model(tokenizer: PreTrainedTokenizerBase, cfg: ModelConfig | None = None,
                seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised float32 policy whose vocab is exactly the tokenizer's."""
    cfg = cfg or ModelConfig()
    if cfg.hidden_size != cfg.num_attention_heads * cfg.head_dim:
        raise ValueError(f"hidden_size {cfg.hidden_size} != heads {cfg.num_attention_heads} x "
                         f"head_dim {cfg.head_dim}")
    config = LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=cfg.num_attention_heads,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
                         **asdict(cfg))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase,
                    out: Path) -> Path:
    """An HF checkpoint dir: config.json, generation_config.json, model.safetensors, tokenizer."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def main() -> None:
    from bench.traces.record.tokenizer import build_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tok = build_tokenizer()
    model = build_model(tok)
    save_checkpoint(model, tok, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved a {n / 1e6:.2f}M-parameter policy (vocab {len(tok)}) to {args.out}")


if __name__ == "__main__":
    main()
