"""The vLLM engine on the tiny trace: every method runs, greedy exactness, distribution tests at
temperature 1 (and that they catch a biased rule), checkpoint swaps, logprobs against transformers;
the baseline on an LLM with no speculative config, scoring that asks for what the rule needs,
SPEC-RL's scoring pass counted as on torch_ref, run-ahead admission.

    bash .ci/engine-vllm.sh        (builds the vLLM environment, then: python -m pytest -m vllm tests/test_engine_vllm.py)
"""
import contextlib
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from hydra.utils import get_class, instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench.harness.cli import CONF_DIR  # noqa: E402
from bench.engines import make_engine  # noqa: E402
from bench.engines.checkpoint import CheckpointError  # noqa: E402
from bench.harness.replay import step_requests  # noqa: E402
from bench.core.sampling import SamplingConfig  # noqa: E402
from bench.traces.format import Trace  # noqa: E402
from bench.core.verify import VerifyConfig  # noqa: E402
from methods.base import Draft, NullDrafter  # noqa: E402
from methods.baseline import Baseline  # noqa: E402
from bench.harness.replay import RunAheadQueue, run_ahead_requests  # noqa: E402

METHODS = sorted(p.stem for p in (Path(CONF_DIR) / "method").glob("*.yaml"))
EXACT = [m for m in METHODS if OmegaConf.load(Path(CONF_DIR) / "method" / f"{m}.yaml").verify.rule != "ratio"]
# drafters that read the policy's hidden states (the EAGLE-style head): vLLM cannot hand them over
READS_FEATURES = [m for m in METHODS if getattr(get_class(OmegaConf.load(Path(CONF_DIR) / "method" / f"{m}.yaml")
                                                          .drafter._target_), "reads_features", False)]
EXACT = [m for m in EXACT if m not in READS_FEATURES]


WARM = [0, 1, 2]  # every prompt of step 2 was visited at step 0 or 1: caches have its earlier rollouts


def method(name):
    cfg = OmegaConf.load(Path(CONF_DIR) / "method" / f"{name}.yaml")
    return (lambda: instantiate(cfg.drafter)), VerifyConfig(**OmegaConf.to_container(cfg.verify, resolve=True))


@pytest.fixture(scope="module")
def trace(tiny_trace):
    return Trace.load(tiny_trace)


@pytest.fixture(scope="module")
def engine(trace):
    eng = make_engine("vllm", **{k: v for k, v in OmegaConf.load(Path(CONF_DIR) / "engine" / "vllm.yaml").items()
                                 if k != "name"})
    eng.load(trace.checkpoint(0))
    yield eng
    eng.close()


def replay(engine, trace, drafter, verify, sampling, steps, n):
    """Rollouts of every step in ``steps`` (the drafter keeps its caches); returns the last step's."""
    for step in steps:
        engine.load(trace.checkpoint(step))
        drafter.begin_step(step)
        out = engine.rollout(step_requests(trace, step, n), sampling, drafter, verify)
    return out


@pytest.mark.parametrize("name", METHODS)
def test_every_method_completes(engine, trace, name):
    make, verify = method(name)
    sampling = SamplingConfig(max_new_tokens=trace.sampling.max_new_tokens)
    if name in READS_FEATURES:  # refused by name, not left to draft nothing
        engine.load(trace.checkpoint(WARM[0]))
        with pytest.raises(ValueError, match="hidden states.*engine=torch_ref"):
            engine.rollout(step_requests(trace, WARM[0], 1), sampling, make(), verify)
        return
    rollouts = replay(engine, trace, make(), verify, sampling, WARM, 4)
    assert len(rollouts) == len(trace.step(WARM[-1]).prompt_ids) * 4
    for r in rollouts:
        assert 1 <= len(r.token_ids) <= sampling.max_new_tokens and len(r.logprobs) == len(r.token_ids)
        assert r.finish_reason in ("stop", "length") and r.num_forward_passes >= 1
        assert r.num_accepted_tokens <= r.num_draft_tokens
    if name not in ("baseline", "baseline_again"):  # speculation happened at the prompts' second visit
        assert sum(r.num_draft_tokens for r in rollouts) > 0


def test_greedy_exact_methods_equal_the_baseline(engine, trace):
    sampling = SamplingConfig(temperature=0, max_new_tokens=trace.sampling.max_new_tokens)
    steps = WARM
    base = [r.token_ids for r in replay(engine, trace, Baseline(), VerifyConfig(), sampling, steps, 2)]
    for name in EXACT + ["prefix_reuse"]:  # the ratio rule accepts exactly the argmax under greedy
        make, verify = method(name)
        rollouts = replay(engine, trace, make(), verify, sampling, steps, 2)
        assert [r.token_ids for r in rollouts] == base, f"{name} differs from the vLLM baseline under greedy"
        if name in ("prefix_reuse_exact", "tree_cache", "hybrid"):  # history_spec's 4-token match may not occur
            assert sum(r.num_accepted_tokens for r in rollouts) > 0, name


# ---------------------------------------------------------------- distribution at temperature 1

def chi2_pvalue(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of equal distributions of two samples of categories."""
    cats = sorted(set(a) | set(b))
    table = torch.tensor([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=torch.float64)
    keep = table.sum(0) >= 5  # pool rare categories into one
    table = torch.cat([table[:, keep], table[:, ~keep].sum(1, keepdim=True)], 1)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def features(rollouts):
    """Per rollout: (prompt, first token), (prompt, length), (prompt, second token)."""
    return ([(r.key.prompt_id, r.token_ids[0]) for r in rollouts],
            [(r.key.prompt_id, len(r.token_ids)) for r in rollouts],
            [(r.key.prompt_id, r.token_ids[1] if len(r.token_ids) > 1 else -1) for r in rollouts])


class FixedDraft(NullDrafter):
    """Drafts the same tokens for every rollout at output 0 with a tiny draft logprob, so the lenient
    ratio rule accepts them almost always (a deliberately biased acceptance), while exact is lossless."""

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def propose(self, key, output, budget):
        if output:
            return Draft()
        toks = self.tokens[:budget]
        return Draft(toks, None, [-30.0] * len(toks))


N = 64  # samples per prompt: enough power for first-token and length distributions


@pytest.fixture(scope="module")
def t1_baseline(engine, trace):
    sampling = SamplingConfig(max_new_tokens=trace.sampling.max_new_tokens, seed=1)
    return sampling, replay(engine, trace, Baseline(), VerifyConfig(), sampling, WARM[-1:], N)


@pytest.mark.parametrize("name", ["prefix_reuse_exact", "tree_cache", "hybrid"])
def test_exact_methods_match_the_baseline_in_distribution(engine, trace, t1_baseline, name):
    sampling, base = t1_baseline
    make, verify = method(name)
    rollouts = replay(engine, trace, make(), verify, SamplingConfig(max_new_tokens=sampling.max_new_tokens, seed=2),
                      WARM, N)
    assert sum(r.num_accepted_tokens for r in rollouts) > 0
    for fa, fb in zip(features(base), features(rollouts)):
        assert chi2_pvalue(fa, fb) > 1e-3, f"{name}: rollouts differ in distribution from the vLLM baseline"


def test_the_distribution_test_catches_a_biased_rule(engine, trace, t1_baseline):
    sampling, base = t1_baseline
    fixed = base[0].token_ids  # one baseline rollout, proposed to everyone
    exact = replay(engine, trace, FixedDraft(fixed), VerifyConfig(), sampling, WARM[-1:], N)
    biased = replay(engine, trace, FixedDraft(fixed), VerifyConfig("ratio", 1.0), sampling, WARM[-1:], N)
    assert min(chi2_pvalue(a, b) for a, b in zip(features(base), features(exact))) > 1e-3
    assert min(chi2_pvalue(a, b) for a, b in zip(features(base), features(biased))) < 1e-6


# ---------------------------------------------------------------- scores and checkpoints

def hf_logprobs(checkpoint, rollouts, temperature):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float64).eval()
    out = []
    for r in rollouts:
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_token_ids + r.token_ids])).logits[0]
        lp = torch.log_softmax(logits / (temperature or 1.0), -1)
        P = len(r.prompt_token_ids)
        out.append([float(lp[P - 1 + i, t]) for i, t in enumerate(r.token_ids)])
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("name", ["baseline", "tree_cache", "prefix_reuse"])
def test_logprobs_match_transformers(engine, trace, name, temperature):
    make, verify = method(name)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=trace.sampling.max_new_tokens)
    rollouts = replay(engine, trace, make(), verify, sampling, WARM, 2)
    ref = hf_logprobs(trace.checkpoint(WARM[-1]), rollouts, temperature)
    for r, lp in zip(rollouts, ref):
        assert r.logprobs == pytest.approx(lp, abs=2e-3), f"{name} T={temperature}: logprobs differ"


def score(engine, ids):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    return [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]


def test_checkpoint_swap_changes_scores_and_back(engine, trace):
    ids = trace.prompts[trace.step(0).prompt_ids[0]] + [5, 6, 7, 8]
    last = trace.step_numbers[-1]
    engine.load(trace.checkpoint(0))
    first = score(engine, ids)
    engine.load(trace.checkpoint(last))
    other = score(engine, ids)
    engine.load(trace.checkpoint(0))
    back = score(engine, ids)
    assert max(abs(a - b) for a, b in zip(first, other)) > 1e-3
    assert back == pytest.approx(first, abs=1e-5)


def test_bad_checkpoints_name_the_path(engine, tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path / "missing")):
        engine.load(tmp_path / "missing")


def test_checkpoint_vllm_cannot_load_names_the_path(tmp_path):
    from tiny_models import make_checkpoint
    path = make_checkpoint(tmp_path / "hd16", hidden=32, heads=2)  # head_dim 16: vLLM's CPU attention refuses it
    eng = make_engine("vllm")
    try:
        with pytest.raises(CheckpointError, match=str(path)):
            eng.load(path)
    finally:
        eng.close()


# ---------------------------------------------------------------- engine configurations

def spec_config(llm):
    return llm.llm_engine.vllm_config.speculative_config


def test_the_baseline_runs_on_an_llm_with_no_speculative_config(engine, trace):
    # greedy: tree methods on vLLM's own loop (at T > 0 on CPU the suite's scheduler serves them)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=trace.sampling.max_new_tokens)
    assert spec_config(engine.llm_for(Baseline())) is None
    for name, want in (("baseline", "plain"), ("prefix_reuse", "plain"), ("tree_cache", "speculative")):
        make, verify = method(name)
        drafter = make()
        assert engine.engine_for(drafter) == want, name
        replay(engine, trace, drafter, verify, sampling, WARM[-1:], 2)
        assert engine.last_engine == want and engine.last_path == "vllm", name
        assert (spec_config(engine.llm_for(drafter)) is None) == (want == "plain"), name
    assert spec_config(engine.llm).method == "custom_class"


def test_with_vllm_ngram_the_baseline_does_not_speculate(trace):
    """The old setup (one LLM with the speculative config for every method) made the baseline
    speculate with vLLM's ngram drafter; now only the methods do, unless plain_engine_for=[]."""
    eng = make_engine("vllm", speculative_method="ngram", num_speculative_tokens=4, gpu_memory_utilization=0.05)
    try:
        eng.load(trace.checkpoint(0))
        sampling = SamplingConfig(temperature=0, max_new_tokens=trace.sampling.max_new_tokens)
        requests = step_requests(trace, 0, 4)
        eng.rollout(requests, sampling, Baseline(), VerifyConfig())
        assert eng.last_engine == "plain" and not eng.last_spec_metrics.get("num_drafts")
        make, verify = method("tree_cache")
        eng.rollout(requests, sampling, make(), verify)
        assert eng.last_engine == "speculative" and eng.last_spec_metrics.get("num_drafts", 0) > 0
        eng.plain_engine_for = []  # every method on the speculative LLM (labelled so in the engine settings)
        eng.rollout(requests, sampling, Baseline(), VerifyConfig())
        assert eng.last_engine == "speculative" and eng.last_spec_metrics.get("num_drafts", 0) > 0
    finally:
        eng.close()


@pytest.mark.parametrize("name,temperature,want", [("prefix_reuse", 1.0, "draft"), ("prefix_reuse_exact", 1.0, "full"),
                                                   ("prefix_reuse_exact", 0.0, "top1")])
def test_scoring_asks_for_what_the_rule_needs_and_is_labelled(engine, trace, name, temperature, want):
    make, verify = method(name)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=trace.sampling.max_new_tokens)
    rollouts = replay(engine, trace, make(), verify, sampling, WARM, 2)
    scoring = engine.last_scoring
    assert scoring["scoring_logprobs"] == want and scoring["engine"] == "plain"
    assert scoring["scoring_passes"] == sum(r.num_drafts for r in rollouts) > 0  # prefix reuse: one draft each
    assert scoring["scoring_tokens"] == sum(len(r.prompt_token_ids) + r.num_draft_tokens for r in rollouts
                                            if r.num_drafts)


def _prefix_pair(engine, trace, name, sampling):
    """The same prefix-reuse cache (filled on vLLM at the first WARM steps) replayed at the last
    WARM step on torch_ref and on vLLM: (torch_ref rollouts, vLLM rollouts)."""
    import copy
    from bench.engines.torch.engine import TorchRefEngine
    make, verify = method(name)
    cache = make()
    replay(engine, trace, cache, verify, sampling, WARM[:-1], 4)
    step = WARM[-1]
    requests = step_requests(trace, step, 4)
    ref = TorchRefEngine(dtype="float32")
    ref.load(trace.checkpoint(step))
    expected_cache, got_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    expected_cache.begin_step(step)
    expected = ref.rollout(requests, sampling, expected_cache, verify)
    engine.load(trace.checkpoint(step))
    got_cache.begin_step(step)
    got = engine.rollout(requests, sampling, got_cache, verify)
    assert sum(r.num_draft_tokens for r in got) > 0
    return expected, got


def test_draft_only_ratio_scoring_accepts_what_torch_ref_accepts(engine, trace):
    """SPEC-RL's ratio rule from the draft tokens' logprobs alone: the acceptance test uses the
    suite's coupled uniforms, so the accepted prefix equals torch_ref's (near-ties aside)."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=trace.sampling.max_new_tokens)
    expected, got = _prefix_pair(engine, trace, "prefix_reuse", sampling)
    assert engine.last_scoring["scoring_logprobs"] == "draft"
    same = sum(g.num_accepted_tokens == e.num_accepted_tokens and g.num_draft_tokens == e.num_draft_tokens
               and g.token_ids[:g.num_accepted_tokens] == e.token_ids[:e.num_accepted_tokens]
               for g, e in zip(got, expected))
    assert same >= len(got) - 1, f"only {same}/{len(got)} accepted prefixes match torch_ref"
    assert 0 < sum(r.num_accepted_tokens for r in got) < sum(r.num_draft_tokens for r in got)


def test_prefix_reuse_passes_are_counted_as_on_torch_ref(engine, trace):
    """The scoring request is one of the rollout's forward passes and yields the token after the
    accepted prefix, as torch_ref's prefill does: same tokens, same counters."""
    sampling = SamplingConfig(temperature=0, max_new_tokens=trace.sampling.max_new_tokens)
    expected, got = _prefix_pair(engine, trace, "prefix_reuse_exact", sampling)
    fields = lambda r: (r.token_ids, r.num_forward_passes, r.num_drafts, r.num_draft_tokens,  # noqa: E731
                        r.num_accepted_tokens, r.num_accepted_tokens_per_pos)
    same = sum(fields(g) == fields(e) for g, e in zip(got, expected))
    assert same >= len(got) - 1, [(fields(g), fields(e)) for g, e in zip(got, expected) if fields(g) != fields(e)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_run_ahead_admission_counts_the_run_ahead_rows_in_flight(engine, trace, temperature):
    """Run-ahead rows fill the batch up to its size, the ones already admitted included; they come
    back after the trained rollouts, flagged, finished or aborted."""
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=trace.sampling.max_new_tokens)
    make, verify = method("tree_cache_runahead")
    drafter = make()
    step, nxt = trace.step_numbers[0], trace.step_numbers[1]
    engine.load(trace.checkpoint(step))
    drafter.begin_step(step)
    requests = step_requests(trace, step, 4)
    pool = RunAheadQueue(run_ahead_requests(trace, step, nxt, 4))
    calls = []

    def source(free):
        calls.append((free, engine.llm_for(drafter).llm_engine.get_num_unfinished_requests()))
        return pool(free)

    out = engine.rollout(requests, sampling, drafter, verify, run_ahead=source)
    assert calls, "the batch shrank, so run-ahead rows should have been asked for"
    assert all(free + in_flight <= len(requests) for free, in_flight in calls), calls
    trained, ahead = out[:len(requests)], out[len(requests):]
    assert [r.key for r in trained] == [q.key for q in requests] and not any(r.run_ahead for r in trained)
    assert ahead and all(r.run_ahead and r.anticipates == nxt for r in ahead)
    assert {r.key for r in ahead} <= {q.key for q in run_ahead_requests(trace, step, nxt, 4)}
    assert all(r.finish_reason in ("stop", "length", "abort") for r in ahead)
    assert all(len(r.logprobs) == len(r.token_ids) for r in ahead)


def test_every_engine_step_is_an_iteration_row(engine, trace):
    """vLLM's steps in the iteration log: plain decoding's rows add up to the prompts once and every
    output token once; a drafting method's steps show the draft tokens it got accepted."""
    sampling = SamplingConfig(max_new_tokens=trace.sampling.max_new_tokens)
    out = replay(engine, trace, Baseline(), VerifyConfig(), sampling, [0], 4)
    log = engine.last_iteration_log
    assert len(log) == engine.last_iterations >= max(len(r.token_ids) for r in out)
    assert sum(row["query_tokens"] for row in log) == sum(len(r.prompt_token_ids) + len(r.token_ids) for r in out)
    assert all(row["accepted_tokens"] == 0 and row["draft_budget"] == 0 for row in log)
    assert all(1 <= row["rows"] <= row["live_rows"] <= len(out) for row in log)
    make, verify = method("tree_cache")
    for temperature in (0.0, 1.0):  # vLLM's rejection sampler; on CPU at T > 0 the suite's verifier
        sampling = SamplingConfig(temperature=temperature, max_new_tokens=trace.sampling.max_new_tokens)
        out = replay(engine, trace, make(), VerifyConfig("greedy") if temperature == 0 else verify,
                     sampling, WARM, 4)
        log = engine.last_iteration_log
        accepted = sum(row["accepted_tokens"] for row in log)
        assert accepted <= sum(r.num_accepted_tokens for r in out), temperature
        if temperature > 0:  # greedy: the first draft's scoring pass may already accept the whole response
            assert accepted > 0 and sum(row["draft_tokens"] or 0 for row in log) >= accepted
        assert all(row["forward_s"] > 0 for row in log)


def test_the_drafter_hears_the_same_calls_as_on_torch_ref(engine, trace):
    """The scheduler's call order on vLLM's Python-verified path: a first draft after
    ``begin_iteration``, ``finish`` per row as it ends (after that iteration's ``observe`` calls),
    so an in-flight tree sees siblings exactly when it does on torch_ref. Same tokens (coupled
    sampling at T=1, float32), same calls."""
    import copy
    from recording_drafter import recording
    from bench.engines.torch.engine import TorchRefEngine
    from methods.tree_cache import TreeCacheDrafter
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=trace.sampling.max_new_tokens)
    cache = recording(TreeCacheDrafter)()
    replay(engine, trace, cache, VerifyConfig(), sampling, WARM[:-1], 4)
    step = WARM[-1]
    requests = step_requests(trace, step, 4)
    ref = TorchRefEngine(dtype="float32")
    ref.load(trace.checkpoint(step))
    on_ref, on_vllm = copy.deepcopy(cache), copy.deepcopy(cache)
    on_ref.calls, on_vllm.calls = [], []
    on_ref.begin_step(step)
    expected = ref.rollout(requests, sampling, on_ref, VerifyConfig())
    engine.load(trace.checkpoint(step))
    on_vllm.begin_step(step)
    got = engine.rollout(requests, sampling, on_vllm, VerifyConfig())
    assert engine.last_path == "scheduler" and sum(r.num_draft_tokens for r in got) > 0
    if [r.token_ids for r in got] != [r.token_ids for r in expected]:
        pytest.skip("a float32 near-tie flipped a token: the call sequences cannot be compared")
    assert on_vllm.calls == on_ref.calls


@contextlib.contextmanager
def requests_sent(engine):
    """The SamplingParams of every request the engine sends to vLLM while the block runs."""
    sent, run = [], engine._run

    def spy(llm, items, *args, **kwargs):
        sent.extend(params for _, _, params in items)
        return run(llm, items, *args, **kwargs)

    engine._run = spy
    try:
        yield sent
    finally:
        del engine._run


@pytest.mark.parametrize("name", ["baseline", "prefix_reuse_exact"])
def test_plain_generation_at_another_temperature_rescales_on_the_worker(engine, trace, name):
    """At T = 0.7 the LLM without a speculative config asks only for the sampled token's logprob
    (logprobs=0, never -1): its logits processor reads each row's log-partitions, and the
    rescaled logprobs are transformers' log_softmax(logits / T)."""
    make, verify = method(name)
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=trace.sampling.max_new_tokens)
    drafter = make()
    replay(engine, trace, drafter, verify, sampling, WARM[:-1], 2)
    with requests_sent(engine) as sent:
        rollouts = replay(engine, trace, drafter, verify, sampling, WARM[-1:], 2)
    generation = [p for p in sent if p.max_tokens > 1]
    assert generation and all(p.logprobs == 0 for p in generation) and not [p for p in sent if p.logprobs == -1]
    ref = hf_logprobs(trace.checkpoint(WARM[-1]), rollouts, 0.7)
    for r, lp in zip(rollouts, ref):
        assert r.logprobs == pytest.approx(lp, abs=2e-3), f"{name}: logprobs differ"


LOG_COLUMNS = ("rows", "live_rows", "run_ahead_rows", "query_tokens", "block_tokens", "context_sum", "context_max",
               "draft_tokens", "accepted_tokens", "draft_budget")


@pytest.mark.parametrize("name", ["tree_cache", "hybrid", "das"])
def test_the_python_verified_path_is_the_scheduler_with_torch_refs_log(engine, trace, name):
    """On vLLM's Python-verified path the loop is the suite's scheduler: same tokens (coupled
    sampling, float32; a near-tie aside), same counters and the same iteration log as torch_ref,
    and no request ever asks vLLM for a full-vocabulary distribution (prompt_logprobs=-1 or
    logprobs=-1): the rule is read on the worker."""
    import copy
    from bench.engines.torch.engine import TorchRefEngine
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=trace.sampling.max_new_tokens)
    make, verify = method(name)
    cache = make()
    replay(engine, trace, cache, verify, sampling, WARM[:-1], 4)
    step = WARM[-1]
    requests = step_requests(trace, step, 4)
    ref = TorchRefEngine(dtype="float32")
    ref.load(trace.checkpoint(step))
    on_ref, on_vllm = copy.deepcopy(cache), copy.deepcopy(cache)
    on_ref.begin_step(step)
    expected = ref.rollout(requests, sampling, on_ref, verify)
    engine.load(trace.checkpoint(step))
    on_vllm.begin_step(step)
    with requests_sent(engine) as sent:
        got = engine.rollout(requests, sampling, on_vllm, verify)
    assert sent and not [p for p in sent if p.prompt_logprobs == -1 or p.logprobs == -1]
    assert sum(r.num_draft_tokens for r in got) > 0 and engine.last_path == "scheduler"
    if [r.token_ids for r in got] != [r.token_ids for r in expected]:
        pytest.skip("a float32 near-tie flipped a token: the logs cannot be compared")
    for a, b in zip(got, expected):
        assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens, a.num_forward_passes) == \
            (b.num_drafts, b.num_draft_tokens, b.num_accepted_tokens, b.num_forward_passes)
    assert [{c: row[c] for c in LOG_COLUMNS} for row in engine.last_iteration_log] == \
        [{c: row[c] for c in LOG_COLUMNS} for row in ref.last_iteration_log]


def test_exact_prefix_scoring_at_t1_is_read_on_the_worker(engine, trace):
    """SPEC-RL's exact rule at T=1 needs the coupled sample at every draft position: read on vLLM's
    worker by node requests, no full-vocabulary logprobs requested, and the accepted prefix and the
    token after it (the coupled sample at the first rejection) equal torch_ref's."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=trace.sampling.max_new_tokens)
    with requests_sent(engine) as sent:
        expected, got = _prefix_pair(engine, trace, "prefix_reuse_exact", sampling)
    assert engine.last_scoring["scoring_logprobs"] == "full"
    assert sent and not [p for p in sent if p.prompt_logprobs == -1 or p.logprobs == -1]
    same = sum(g.num_accepted_tokens == e.num_accepted_tokens and g.num_draft_tokens == e.num_draft_tokens
               and g.token_ids[:g.num_accepted_tokens + 1] == e.token_ids[:e.num_accepted_tokens + 1]
               for g, e in zip(got, expected))
    assert same >= len(got) - 1, f"only {same}/{len(got)} accepted prefixes match torch_ref"
