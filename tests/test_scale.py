"""Real shapes: a Qwen2-style policy (151,936-token vocabulary, grouped-query attention, tied head)
through the engine, token-identical in float64 and free of rule divergences in bf16; the
verifier's memory at that vocabulary (bounded by its chunks, not by batch x nodes x vocabulary)
and long chain drafts read in windows that stop at the first rejection."""
import random
from pathlib import Path

import hydra.utils
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

import bench.core.verify as verify_mod
from bench.benchmarks.verify_scale import PeakTensorBytes
from bench.core.engine_protocol import Request
from bench.engines.torch.engine import TorchRefEngine
from bench.core.precision import divergence_summary, near_tie_threshold
from bench.report.results import rollout_row
from bench.core.sampling import SamplingConfig, rollout_seed
from bench.core.verify import VerifyConfig, verify_nodes
from methods.base import Draft, RolloutKey
from tiny_models import QWEN2_EOS, QWEN2_VOCAB, make_qwen2_checkpoint

CONF = Path(__file__).resolve().parent.parent / "conf" / "method"

# output scale 40 at temperature 0.5: sharp enough that siblings and revisits share long stretches
# (drafts accepted across windows), loose enough that some part ways early (drafts rejected)
SAMPLING = SamplingConfig(temperature=0.5, max_new_tokens=40)
PROMPTS = {f"p{i}": [QWEN2_EOS] + [1000 + 37_001 * i + 7_919 * j for j in range(3 + i)] for i in range(3)}
STEPS = (1, 2)


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
    return make_qwen2_checkpoint(tmp_path_factory.mktemp("qwen2") / "policy", scale=40.0)


@pytest.fixture(scope="module")
def engine64(qwen2_ckpt):
    eng = TorchRefEngine(dtype="float64")
    eng.load(qwen2_ckpt)
    return eng


def _requests(step):
    return [Request(RolloutKey(p, s), toks, step) for p, toks in PROMPTS.items() for s in range(2)]


def _method(name):
    return hydra.utils.instantiate(OmegaConf.load(CONF / f"{name}.yaml").drafter)


def _run(engine, name, sampling=SAMPLING):
    """Every step's rollouts with one drafter across steps; returns (rows, the engine's iteration log)."""
    rows, log, drafter = [], [], _method(name)
    for step in STEPS:
        drafter.begin_step(step)
        rows += [rollout_row(r, method=name) for r in engine.rollout(_requests(step), sampling, drafter, VerifyConfig())]
        log += engine.last_iteration_log
    return pd.DataFrame(rows), log


@pytest.fixture(scope="module")
def baseline64(engine64):
    return _run(engine64, "baseline")[0]


def test_the_policy_has_qwen2_shapes(engine64):
    cfg = engine64.model.config
    assert cfg.model_type == "qwen2" and cfg.vocab_size == QWEN2_VOCAB
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    assert engine64.model.get_output_embeddings().weight is engine64.model.get_input_embeddings().weight
    assert engine64._base is not None  # the engine applies the head to the verified nodes only


def _same_tokens(rows, base):
    key = ["step", "prompt_id", "sample_idx"]
    a, b = rows.sort_values(key), base.sort_values(key)
    assert [list(t) for t in a.output_tokens] == [list(t) for t in b.output_tokens]
    for x, y in zip(a.logprobs, b.logprobs):
        assert list(x) == pytest.approx(list(y), abs=1e-9)


def test_tree_method_is_token_identical_in_float64(engine64, baseline64):
    rows, log = _run(engine64, "tree_cache_tree")
    _same_tokens(rows, baseline64)
    assert rows.num_accepted_tokens.sum() > 0 and rows.num_draft_tokens.sum() > rows.num_accepted_tokens.sum()
    assert all(c["forward_s"] >= 0 and c["verify_s"] >= 0 for c in log)  # one entry per forward call, timed


def test_prefix_reuse_long_chains_in_windows_are_token_identical(engine64, baseline64, monkeypatch):
    # first windows of 4 nodes (4, 8, 16, 32, ...): a 40-token draft crosses several of them
    monkeypatch.setattr(verify_mod, "WINDOW", 4)
    read = []
    real = TorchRefEngine._node_logits

    def counting(self, block, cache):
        logits_at, head_s = real(self, block, cache)
        return (lambda rows, nodes: (read.append(len(rows)), logits_at(rows, nodes))[1]), head_s

    monkeypatch.setattr(TorchRefEngine, "_node_logits", counting)
    rows, log = _run(engine64, "prefix_reuse_exact")
    _same_tokens(rows, baseline64)
    assert any(c["draft_tokens"] > 8 * c["rows"] for c in log), "prefix reuse drafted no long chains"
    # some drafts were accepted past the first windows (4 and 8 nodes), some rejected early
    assert max(len(p) for p in rows.num_accepted_tokens_per_pos) > 12
    assert rows.num_draft_tokens.sum() > rows.num_accepted_tokens.sum()
    nodes = sum(c["rows"] + c["draft_tokens"] for c in log)
    assert sum(read) < nodes  # nodes past a rejection were never read


def test_bf16_exact_methods_have_no_rule_divergences(qwen2_ckpt):
    eng = TorchRefEngine(dtype="bfloat16")
    eng.load(qwen2_ckpt)
    assert eng.model.get_output_embeddings()(torch.ones(1, 32, dtype=torch.bfloat16)).dtype == torch.float32
    base, _ = _run(eng, "baseline")
    thr = near_tie_threshold("bfloat16")
    for name in ("tree_cache_tree", "prefix_reuse_exact"):
        rows, _ = _run(eng, name)
        assert rows.num_accepted_tokens.sum() > 0, name
        s = divergence_summary(rows, base, thr)
        assert s["compared"] == len(STEPS) * len(PROMPTS) * 2
        assert s["rule_divergences"] == 0, f"{name}: {s}"


# ---------------------------------------------------------------- the verifier at V = 151,936

H = 64  # hidden size of the synthetic output layer


def _head(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(QWEN2_VOCAB, H, generator=g) / H ** 0.5


def _peaked_chain(head, n, reject_at, seed=1):
    """Hidden states [n + 1, H] whose logits put almost all mass on one token per node, and the
    chain draft of those tokens with one wrong token at ``reject_at`` (None: accepted throughout)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, QWEN2_VOCAB, (n + 1,), generator=g)
    w = head[target]
    hidden = 40 * w / (w * w).sum(-1, keepdim=True)  # logit 40 on the target, about N(0, 25) elsewhere
    toks = target[:n].tolist()
    if reject_at is not None:
        toks[reject_at] = (toks[reject_at] + 1) % QWEN2_VOCAB
    return hidden, Draft(toks)


def test_verifier_memory_is_bounded_by_its_chunks_not_the_nodes():
    torch.manual_seed(0)
    head = _head()
    rng = random.Random(0)
    B = 12
    drafts = [Draft([rng.randrange(QWEN2_VOCAB) for _ in range(rng.randint(0, 24))]) for _ in range(B)]
    n_nodes = sum(len(d) + 1 for d in drafts)
    hidden = torch.randn(B, 25, H) * 3
    keys = torch.tensor([rollout_seed(0, 1, f"p{b}", 0) for b in range(B)])
    read = []

    def logits_at(rows, nodes):
        read.append(len(rows))
        return torch.nn.functional.linear(hidden[rows, nodes], head)

    logits_bytes = n_nodes * QWEN2_VOCAB * 4
    for sampling in (SamplingConfig(), SamplingConfig(top_p=0.9, temperature=0.8)):
        read.clear()
        with PeakTensorBytes() as mem:
            verify_nodes(logits_at, QWEN2_VOCAB, drafts, keys, [0] * B, sampling, VerifyConfig())
        assert sum(read) == n_nodes  # every real node once, no padding
        assert max(read) * QWEN2_VOCAB * 4 <= verify_mod.CHUNK_BYTES["cpu"]
        assert mem.peak <= 2.5 * logits_bytes, (mem.peak, logits_bytes)
        assert mem.peak <= 12 * verify_mod.CHUNK_BYTES["cpu"]  # a few chunks' workspace, whatever the batch


def test_long_chain_reads_a_window_past_its_first_rejection():
    head = _head()
    n = 4096
    for reject_at, seed in ((None, 1), (70, 2)):
        if reject_at is None:
            n_here = 600  # full acceptance over many windows, kept short for CPU time
        else:
            n_here = n
        hidden, d = _peaked_chain(head, n_here, reject_at, seed)
        read = []

        def logits_at(rows, nodes):
            read.append(len(rows))
            return torch.nn.functional.linear(hidden[nodes], head)

        with PeakTensorBytes() as mem:
            v = verify_nodes(logits_at, QWEN2_VOCAB, [d], torch.tensor([rollout_seed(0, 1, "p", 0)]), [0],
                             SamplingConfig(), VerifyConfig())[0]
        accepted = n_here if reject_at is None else reject_at
        assert v.num_accepted == accepted and v.emitted[:accepted] == d.token_ids[:accepted]
        assert sum(read) <= 2 * (accepted + 1) + verify_mod.WINDOW  # windows double: at most twice what is needed
        assert mem.peak <= 12 * verify_mod.CHUNK_BYTES["cpu"]  # the same bound as a 25-node batch
