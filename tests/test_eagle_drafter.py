"""The EAGLE-style drafter (bench/drafters/eagle.py): torch_ref hands it the policy's true hidden
states, it trains on them and on features the policy computes, its snapshot leaves the policy
out, the stale-drafter guard catches an injected fault, and engines that cannot hand it features
refuse it by name. Identity with the baseline on torch_ref in float64 is tests/test_replay.py's
(eagle is one of its exact methods)."""
from __future__ import annotations

import pickle
import random

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from bench.core.engine_protocol import Request
from bench.core.errors import UserError
from bench.core.sampling import SamplingConfig
from bench.core.verify import VerifyConfig
from bench.drafters.eagle import EagleDrafter
from bench.engines.torch.engine import TorchRefEngine
from bench.harness.config_checks import check_policy_readers
from bench.harness.sim_methods import SimulationError, check_simulable, method_config
from methods.base import Rollout, RolloutKey
from methods.tree_cache import TreeCacheDrafter
from tiny_models import make_checkpoint

PROMPTS = {f"p{i}": [1, 2 + i] for i in range(4)}


class FeatureRecorder(TreeCacheDrafter):
    """SRT's tree drafts (so accepted paths leave the first branch), recording the features handed over."""

    reads_features = True

    def __init__(self):
        super().__init__()
        self.features: dict = {}

    def observe_features(self, key, feats):
        self.features.setdefault(key, []).append(feats.clone())


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("eagle") / "policy", vocab=80, hidden=32)


def test_torch_ref_hands_over_the_hidden_state_behind_every_emitted_token(policy_dir):
    eng = TorchRefEngine(dtype="float64")
    eng.load(policy_dir)
    drafter = FeatureRecorder()
    requests = [Request(RolloutKey(pid, s), prompt, 0) for pid, prompt in PROMPTS.items() for s in range(3)]
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0)
    out = eng.rollout(requests, sampling, drafter, VerifyConfig())
    out += eng.rollout(requests, sampling, drafter, VerifyConfig())  # the tree now holds the first call's rollouts
    assert sum(r.num_accepted_tokens for r in out) > 0  # drafts were accepted, so paths went past the root
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float64).eval()
    for r in out[len(requests):]:
        got = torch.cat(_last_call(drafter.features[r.key], len(r.token_ids)))
        ids = torch.tensor([list(r.prompt_token_ids) + list(r.token_ids[:-1])])
        with torch.no_grad():
            want = model.model(input_ids=ids).last_hidden_state[0, len(r.prompt_token_ids) - 1:]
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-9), r.key


def _last_call(chunks: list, n: int) -> list:
    """The chunks of a key's last rollout call: the trailing ones that hold its n tokens."""
    out, total = [], 0
    for c in reversed(chunks):
        if total >= n:
            break
        out.insert(0, c)
        total += len(c)
    assert total == n
    return out


def _responses(step: int, rng: random.Random, policy) -> list[tuple[RolloutKey, list[int]]]:
    """The policy's own greedy answers (so its features predict them, as a recorded run's do), two
    tokens of each replaced at random per step (the continuation follows the replaced token)."""
    out = []
    for pid, prompt in PROMPTS.items():
        for s in range(2):
            swaps = {rng.randrange(36): 60 + rng.randrange(8) for _ in range(2)}
            seq = list(prompt)
            with torch.no_grad():
                for j in range(36):
                    nxt = int(policy(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                    seq.append(swaps.get(j, nxt))
            out.append((RolloutKey(pid, s), seq[len(prompt):]))
    return out


def _drive_step(d: EagleDrafter, policy, step: int, recorded, fault: str | None = None) -> None:
    """A drafted step verified against recorded rollouts, the policy's features handed over as
    torch_ref hands them (the hidden state behind each emitted token)."""
    d.attach_policy(policy)
    d.begin_step(step)
    if fault:
        d.inject_fault(fault)
    d.reset_stats()
    feats = {}
    with torch.no_grad():
        for key, tokens in recorded:
            prompt = PROMPTS[key.prompt_id]
            ids = torch.tensor([prompt + tokens[:-1]])
            feats[key] = policy.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:]
    for key, _ in recorded:
        d.start(key, PROMPTS[key.prompt_id])
    pos = {key: 0 for key, _ in recorded}
    while any(pos[k] < len(t) for k, t in recorded):
        live = [(k, t) for k, t in recorded if pos[k] < len(t)]
        d.begin_iteration([(k, pos[k]) for k, _ in live])
        for k, t in live:
            p = pos[k]
            draft = d.propose(k, t[:p], len(t) - p).token_ids
            a = next((j for j, x in enumerate(draft) if x != t[p + j]), len(draft))
            d.observe_features(k, feats[k][p:p + a + 1])
            d.observe(k, t[p:p + a + 1])
            pos[k] = p + a + 1
    for k, t in recorded:
        d.finish(k, Rollout(k, step, PROMPTS[k.prompt_id], t, [0.0] * len(t), "stop"))


def _small(**kw) -> EagleDrafter:
    return EagleDrafter(**{"window": 8, "warmup_steps": 120, "update_steps": 5, "batch_windows": 16, "lr": 1e-2,
                           "feature_rollouts": 8, **kw})


@pytest.fixture(scope="module")
def policy(policy_dir):
    return AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()


def test_warm_up_then_drafts_then_the_guard_flags_an_injected_fault(policy):
    rng = random.Random(0)
    d = _small()
    for step in range(2):  # history: recorded, features computed by the policy at the warm-up
        d.begin_history_step(step)
        for k, t in _responses(step, rng, policy):
            d.start(k, PROMPTS[k.prompt_id])
            d.observe(k, t)
            d.finish(k, Rollout(k, step, PROMPTS[k.prompt_id], t, [0.0] * len(t), "stop"))
    with pytest.raises(RuntimeError, match="attach_policy"):  # no engine gave it the policy
        d.begin_step(2)
    rates, stale = [], []
    for step in range(2, 7):
        _drive_step(d, policy, step, _responses(step, rng, policy), fault="corrupt" if step == 6 else None)
        s = d.stats()
        rates.append(s["acceptance"])
        stale.append(s["stale"])
        if step == 2:
            assert s["warmups"] == 1 and s["feature_s"] > 0 and s["parameters"] > 0
    assert min(rates[:4]) > 0.15, rates  # the head drafts the policy's answers (chance: about 1 in 30)
    assert rates[4] < 0.5 * min(rates[:4]) and stale == [0, 0, 0, 0, 1], (rates, stale)


def test_a_snapshot_leaves_the_policy_out_and_drafts_the_same_after_reattaching(policy):
    rng = random.Random(1)
    d = _small()
    d.attach_policy(policy)
    for step in range(2):
        _drive_step(d, policy, step, _responses(step, rng, policy))
    blob = pickle.dumps(d)
    assert len(blob) < 2_000_000  # the head and its optimizer, not the policy
    twin = pickle.loads(blob)
    twin.attach_policy(policy)
    key = RolloutKey("p0", 0)
    feats = torch.randn(5, 32)
    for x in (d, twin):
        x.start(key, PROMPTS["p0"])
        x.observe_features(key, feats)
        x.observe(key, [10, 20, 30, 40, 50])
        x.begin_iteration([(key, 5)])
    assert d.propose(key, [10, 20, 30, 40, 50], 6).token_ids == twin.propose(key, [10, 20, 30, 40, 50], 6).token_ids


def test_engines_without_the_policys_hidden_states_refuse_it_by_name():
    with pytest.raises(SimulationError, match="hidden states.*torch_ref"):
        check_simulable("eagle", method_config("eagle"))
    cfg = OmegaConf.create({"engine": {"name": "vllm"}, "method": {"eagle": method_config("eagle")}})
    with pytest.raises(UserError, match="method eagle drafts from the policy's hidden states.*engine=torch_ref"):
        check_policy_readers(cfg, object())
    check_policy_readers(cfg, TorchRefEngine())  # torch_ref hands them over
