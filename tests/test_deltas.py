"""Delta checkpoints: low-rank and dense deltas on a base merge into the checkpoint they describe,
once (reused, an incomplete merge rebuilt), a trace's delta step loads on torch_ref as the merged
policy, and a bad delta is one clear error naming its file and tensor."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from bench.traces import deltas
from bench.traces.format import Trace
from tiny_models import make_checkpoint


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLLOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _lora(base_state, names, rank=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(rank, base_state[n].shape[1], generator=g),
                torch.randn(base_state[n].shape[0], rank, generator=g)) for n in names}


def test_a_delta_merges_into_base_plus_scaled_low_rank_and_dense(tmp_path, cache):
    base = make_checkpoint(tmp_path / "base", vocab=40, hidden=32)
    state = load_file(str(base / "model.safetensors"))
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"]
    lora = _lora(state, names)
    norm = "model.norm.weight"
    dense = {norm: torch.full_like(state[norm], 0.25)}
    delta = deltas.write_delta(tmp_path / "trace" / "checkpoints" / "step_00001", "../../../base", lora, dense,
                               scale=0.5)
    assert deltas.is_delta(delta) and not deltas.is_delta(base)
    assert deltas.base_of(delta) == base.resolve()
    merged = deltas.materialize(delta)
    assert merged.is_relative_to(cache) and (merged / "config.json").is_file()
    got = load_file(str(merged / "model.safetensors"))
    for n in names:
        a, b = lora[n]
        assert torch.equal(got[n], state[n] + 0.5 * (b @ a))
    assert torch.equal(got[norm], state[norm] + 0.25)
    untouched = [n for n in state if n not in names and n != norm]
    assert untouched and all(torch.equal(got[n], state[n]) for n in untouched)
    stamp = (merged / "model.safetensors").stat().st_mtime_ns
    assert deltas.materialize(delta) == merged and (merged / "model.safetensors").stat().st_mtime_ns == stamp
    (merged / deltas.DONE).unlink()  # an interrupted merge: rebuilt, not trusted
    assert deltas.materialize(delta) == merged and (merged / deltas.DONE).is_file()


def test_a_trace_step_stored_as_a_delta_replays_as_the_merged_policy(tmp_path, cache):
    from transformers import AutoModelForCausalLM
    from bench.engines.torch.engine import TorchRefEngine
    from bench.core.engine_protocol import Request
    from bench.core.sampling import SamplingConfig
    from bench.core.verify import VerifyConfig
    from bench.traces.format import TraceSampling
    from bench.traces.writer import TraceWriter
    from methods.base import RolloutKey
    from methods.baseline import Baseline
    from tiny_models import reference_logprobs
    root = tmp_path / "t"
    base = make_checkpoint(root / "checkpoints" / "step_00000", vocab=40, hidden=32)
    state = load_file(str(base / "model.safetensors"))
    deltas.write_delta(root / "checkpoints" / "step_00001", "../step_00000",
                       _lora(state, ["model.layers.0.mlp.down_proj.weight", "lm_head.weight"], seed=1))
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(40)}, unk_token="t3"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1").save_pretrained(str(root / "tokenizer"))
    w = TraceWriter(root, "delta", TraceSampling(max_new_tokens=8), vocab_size=40, task="none", tokenizer="tokenizer")
    w.write_prompts([{"prompt_id": "a", "token_ids": [5, 6, 7]}])
    empty = pd.DataFrame({"prompt_id": ["a"], "sample_idx": [0], "token_ids": [[4]], "logprobs": [[-1.0]],
                          "reward": [0.0]})
    for s in (0, 1):
        w.add_step(s, f"checkpoints/step_{s:05d}", ["a"], w.write_rollouts(s, empty))
    trace = Trace.load(root)
    trace.validate()
    merged = trace.checkpoint(1)
    assert merged != root / "checkpoints" / "step_00001" and trace.checkpoint(0) == base
    eng = TorchRefEngine(dtype="float32")
    eng.load(merged)
    out = eng.rollout([Request(RolloutKey("a", 0), [5, 6, 7], 1)], SamplingConfig(max_new_tokens=8), Baseline(),
                      VerifyConfig())
    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    assert out[0].logprobs == pytest.approx(reference_logprobs(model, [5, 6, 7], out[0].token_ids, 1.0), abs=1e-5)
    base_model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    assert reference_logprobs(base_model, [5, 6, 7], out[0].token_ids, 1.0) != \
        pytest.approx(out[0].logprobs, abs=1e-3)  # the delta changed the policy


def test_bad_deltas_name_the_file_and_tensor(tmp_path, cache):
    base = make_checkpoint(tmp_path / "base", vocab=40, hidden=32)
    state = load_file(str(base / "model.safetensors"))
    n = "model.layers.0.self_attn.q_proj.weight"
    wrong = deltas.write_delta(tmp_path / "wrong", "../base", dense={n: torch.zeros(3, 3)})
    with pytest.raises(deltas.DeltaError, match=r"q_proj.weight has shape \(3, 3\)"):
        deltas.materialize(wrong)
    unknown = deltas.write_delta(tmp_path / "unknown", "../base", dense={"model.nope.weight": torch.zeros(2)})
    with pytest.raises(deltas.DeltaError, match="'model.nope.weight' is not a tensor of the base"):
        deltas.materialize(unknown)
    half = deltas.write_delta(tmp_path / "half", "../base", lora=_lora(state, [n]))
    from safetensors.torch import save_file
    save_file({f"{n}.lora_A": torch.zeros(2, state[n].shape[1])}, str(half / deltas.TENSORS))
    with pytest.raises(deltas.DeltaError, match="only one of lora_A / lora_B"):
        deltas.materialize(half)
    nobase = deltas.write_delta(tmp_path / "nobase", "../missing", dense={n: torch.zeros_like(state[n])})
    with pytest.raises(deltas.DeltaError, match="is neither 'smollm2-135m-instruct' nor a checkpoint directory"):
        deltas.materialize(nobase)
    (nobase / deltas.MARKER).write_text(json.dumps({"scale": 1}))
    with pytest.raises(deltas.DeltaError, match="needs a `base`"):
        deltas.materialize(nobase)
    with pytest.raises(deltas.DeltaError, match="at least one"):
        deltas.write_delta(tmp_path / "empty", "../base")
    merged = cache / "merged"
    assert not merged.exists() or not any(merged.iterdir())  # nothing half-written is left behind


def test_merge_into_writes_what_materialize_caches(tmp_path, cache):
    base = make_checkpoint(tmp_path / "base", vocab=40, hidden=32)
    state = load_file(str(base / "model.safetensors"))
    delta = deltas.write_delta(tmp_path / "d", "../base", _lora(state, ["model.layers.0.self_attn.v_proj.weight"]),
                               scale=2.0)
    out = deltas.merge_into(delta, tmp_path / "scratch" / "merged")
    cached = deltas.materialize(delta)
    assert out != cached and not out.is_relative_to(cache)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(cached / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert deltas.merge_into(delta, out) == out  # a second step overwrites the same folder
