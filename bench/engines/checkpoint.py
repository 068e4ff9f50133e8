"""Checks a Hugging Face checkpoint directory before any engine loads it, so a bad path, a model
that is not a causal LM or a tokenizer that does not fit the vocabulary gives one clear error.

Exercised by ``pytest tests/test_torch_ref.py -k checkpoint``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.core.errors import UserError


class CheckpointError(UserError, ValueError):
    """A checkpoint directory that cannot serve as a policy; the message names the path and fix."""


@dataclass
class CheckpointInfo:
    path: Path
    config: object  # transformers.PretrainedConfig
    weight_files: list[Path]
    eos_token_ids: list[int]
    max_context: int
    vocab_size: int
    tokenizer_size: int | None  # None when the directory holds no tokenizer


def _eos_ids(path: Path, config) -> list[int]:
    eos = None
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    """Validate ``path`` as a causal-LM checkpoint and read what the engines need from it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist: check the path "
                              f"(a Hugging Face model directory with config.json and *.safetensors)")
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} has no config.json: it is not a Hugging Face checkpoint "
                              f"(save one with model.save_pretrained(dir))")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}/config.json could not be read by transformers: {exc}") from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CheckpointError(f"{path}: model_type {config.model_type!r} is not a causal language model "
                              f"transformers can load with AutoModelForCausalLM; use a decoder-only policy checkpoint")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"{path} has no *.safetensors weights: save the policy with "
                              f"model.save_pretrained(dir) (safetensors is the default)")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    tokenizer_size = None
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer
        try:
            tokenizer_size = len(AutoTokenizer.from_pretrained(str(path)))
        except Exception as exc:
            raise CheckpointError(f"{path}: its tokenizer files could not be loaded: {exc}") from exc
        if vocab and tokenizer_size > vocab:
            raise CheckpointError(f"{path}: the tokenizer has {tokenizer_size} tokens but config.json "
                                  f"vocab_size is {vocab}: the tokenizer does not belong to this model; "
                                  f"save the matching tokenizer with the checkpoint")
    max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
    return CheckpointInfo(path, config, weights, _eos_ids(path, config), max_context, vocab, tokenizer_size)
