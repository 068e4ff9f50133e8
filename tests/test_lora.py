"""LoRA for the real-model recorder: the adapted model starts as its base, a GRPO update moves
only the adapters and raises the logprob of the rewarded response, and the saved delta checkpoint
merges into a model with the adapted model's logits."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.traces import deltas
from bench.traces.record.lora import add_lora, lora_parameters, save_lora
from bench.traces.record.policy_gradient import grpo_update
from tiny_models import make_checkpoint


def _model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _logp(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response))


def test_lora_trains_only_adapters_and_saves_a_delta_with_its_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLLOUT_CACHE", str(tmp_path / "cache"))
    base = make_checkpoint(tmp_path / "base", vocab=40, hidden=32)
    model = _model(base)
    prompt, good, bad = [5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]
    before = (_logp(model, prompt, good), _logp(model, prompt, bad))
    frozen = {n: p.clone() for n, p in model.named_parameters()}
    wrapped = add_lora(model, rank=4, alpha=8)
    assert sorted(wrapped) == [f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1) for p in ("q_proj", "v_proj")]
    assert (_logp(model, prompt, good), _logp(model, prompt, bad)) == pytest.approx(before, abs=1e-6)  # starts as the base
    opt = torch.optim.Adam(lora_parameters(wrapped), lr=3e-2)
    cfg = SimpleNamespace(grad_steps=5, temperature=1.0, clip=10.0, micro_batch_tokens=0)
    grpo_update(model, opt, [(prompt, good, [0.0] * 4, 1.0), (prompt, bad, [0.0] * 4, -1.0)], cfg)
    after = (_logp(model, prompt, good), _logp(model, prompt, bad))
    assert after[0] > before[0] + 0.1 and after[1] < before[1] - 0.1
    base_params = {n.replace(".base.", "."): p for n, p in model.named_parameters() if "lora_" not in n}
    assert all(torch.equal(base_params[n], frozen[n]) for n in frozen)  # only the adapters moved
    delta = save_lora(wrapped, tmp_path / "step_1", "../base")
    assert (delta / deltas.TENSORS).stat().st_size < (base / "model.safetensors").stat().st_size / 4
    merged = _model(deltas.materialize(delta))
    assert (_logp(merged, prompt, good), _logp(merged, prompt, bad)) == pytest.approx(after, abs=1e-4)


def test_bad_lora_requests_say_what_to_change(tmp_path):
    model = _model(make_checkpoint(tmp_path / "base", vocab=40, hidden=32))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        add_lora(model, rank=0)
    with pytest.raises(ValueError, match="no linear layer of the model ends in"):
        add_lora(model, targets=("nope_proj",))
    add_lora(model)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(model)


def test_the_cost_benchmark_refuses_bad_sizes():
    from bench.benchmarks import lora_costs
    for argv, flag in ((["--rank", "0"], "--rank"), (["--tokens", "60"], "--tokens"), (["--rollouts", "0"], "--rollouts")):
        with pytest.raises(SystemExit, match=flag):
            lora_costs.main(argv)
