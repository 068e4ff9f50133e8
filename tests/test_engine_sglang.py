"""The SGLang engine on the tiny trace: baseline, prefix reuse (both rules), exactness, checkpoints;
the baseline on an engine with no speculative settings, scoring that asks for what the rule needs,
SPEC-RL's scoring pass counted as on torch_ref.

    python -m pytest -m sglang tests/test_engine_sglang.py     (in the rig venv: bash .ci/engine-sglang.sh)

SGLang runs in one worker process per module (a scheduler crash kills its caller, so it must not
be pytest), started once (~20 s). SGLang's continuation sampling is not coupled to the suite's
uniforms, so identity is asserted under greedy decoding and distributions are compared at
temperature 1 with two-sample tests; the draft region of the prefix path IS coupled (it goes
through bench.core.verify), which a test checks against torch_ref too.
"""
from __future__ import annotations

import importlib.util
import math
import multiprocessing as mp
from collections import Counter

import pytest

from bench.core.engine_protocol import Request
from bench.core.sampling import SamplingConfig
from bench.core.verify import VerifyConfig
from methods.base import RolloutKey
from methods.baseline import Baseline
from methods.prefix_reuse import PrefixReuseDrafter
from tiny_models import reference_logprobs

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
_skip_without = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed here (CPU: bash rigs/sglang_cpu/build.sh)")


def needs_sglang(test):
    """Marked ``sglang`` (CI selects these in the rig venv) and skipped where sglang is missing."""
    return pytest.mark.sglang(_skip_without(test))


WAIT_S = 900


def _serve(conn, engine_kwargs):
    """Worker process: owns one SGLangEngine and answers (method, args) messages."""
    from bench.engines.sglang.adapter import SGLangEngine
    engine = SGLangEngine(**engine_kwargs)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            method, args = msg
            try:
                out = getattr(engine, method)(*args)
                if method == "rollout":  # send the drafter back: its caches changed
                    out = (out, args[2])
                conn.send(("ok", out))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        engine.close()


class EngineProxy:
    """The test side of the worker: same calls as the engine; drafters come back updated."""

    def __init__(self, **engine_kwargs):
        # on CPU SGLang's default static memory is most of host RAM (a 16 GB scheduler was seen
        # killed for memory on this 24 GB machine): a bounded share leaves room for the tests
        engine_kwargs.setdefault("mem_fraction_static", 0.3)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, engine_kwargs), daemon=False)
        self.proc.start()

    def call(self, method, *args):
        self.conn.send((method, args))
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"the SGLang worker did not answer {method} within {WAIT_S} s")
        try:
            status, out = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the SGLang worker died during {method} (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(out)
        return out

    def load(self, path):
        self.call("load", str(path))

    def rollout(self, requests, sampling, drafter, verify=VerifyConfig()):
        rollouts, updated = self.call("rollout", requests, sampling, drafter, verify)
        if hasattr(drafter, "__dict__"):
            drafter.__dict__.update(updated.__dict__)
        return rollouts

    def close(self):
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def trace(tiny_trace):
    from bench.traces.format import Trace
    return Trace.load(tiny_trace)


@pytest.fixture(scope="module")
def sgl(trace):
    if not HAVE_SGLANG:
        pytest.skip("sglang is not installed here (CPU: bash rigs/sglang_cpu/build.sh)")
    proxy = EngineProxy()
    try:
        proxy.load(trace.checkpoint(0))
        yield proxy
    finally:
        proxy.close()


def reqs(trace, step, n, as_step=None):
    """The n-sample groups of ``step``'s prompts (labelled ``as_step`` when given)."""
    return [Request(RolloutKey(pid, i), trace.prompts[pid], step if as_step is None else as_step)
            for pid in trace.step(step).prompt_ids for i in range(n)]


def check_rollouts(rollouts, requests, sampling):
    assert [r.key for r in rollouts] == [q.key for q in requests]
    for r in rollouts:
        assert 1 <= len(r.token_ids) <= sampling.max_new_tokens
        assert len(r.logprobs) == len(r.token_ids)
        assert all(lp <= 1e-6 and math.isfinite(lp) for lp in r.logprobs)
        assert r.finish_reason in ("stop", "length")
        assert r.num_accepted_tokens == sum(r.num_accepted_tokens_per_pos) <= r.num_draft_tokens
        assert r.num_forward_passes >= 1


# ---------------------------------------------------------------- bad input (runs without sglang too)

@pytest.mark.skipif(HAVE_SGLANG, reason="checks the error raised when sglang is missing")
def test_missing_sglang_names_the_install():
    from bench.engines import make_engine
    from bench.engines.sglang.adapter import SGLangUnavailable
    with pytest.raises(SGLangUnavailable, match=r"rigs/sglang_cpu/build.sh.*\.\[sglang\]|\.\[sglang\].*rigs/sglang_cpu"):
        make_engine("sglang")


@pytest.mark.sglang
def test_bad_checkpoint_names_the_path(tmp_path):
    from bench.engines.checkpoint import CheckpointError
    from bench.engines.sglang.adapter import SGLangEngine
    with pytest.raises(CheckpointError, match=str(tmp_path / "nope")):
        SGLangEngine().load(tmp_path / "nope")


def test_baseline_and_prefix_reuse_run_on_an_engine_with_no_speculative_settings():
    """With NGRAM set, tree methods get the NGRAM engine and the baseline and prefix reuse a plain
    one (no engine is started here: the routing and the settings each engine gets)."""
    from bench.engines.sglang.adapter import SGLangEngine
    from methods.tree_cache import TreeCacheDrafter
    eng = SGLangEngine(speculative_algorithm="NGRAM")
    assert eng.engine_for(Baseline()) == eng.engine_for(PrefixReuseDrafter()) == "plain"
    assert eng.engine_for(TreeCacheDrafter()) == "speculative"
    assert "speculative_algorithm" not in eng.kwargs and eng.spec_kwargs["speculative_algorithm"] == "NGRAM"
    assert eng.kwargs["mem_fraction_static"] == eng.spec_kwargs["mem_fraction_static"] == 0.4  # two engines share it
    shared = SGLangEngine(speculative_algorithm="NGRAM", plain_engine_for=[])
    assert shared.engine_for(Baseline()) == "speculative"
    assert SGLangEngine().engine_for(Baseline()) == "plain" and SGLangEngine().spec_kwargs is None
    with pytest.raises(ValueError, match="plain_engine_for"):
        SGLangEngine(plain_engine_for=["tree"])


# ---------------------------------------------------------------- on the engine

@needs_sglang
def test_baseline_logprobs_are_temperature_scaled(sgl, trace):
    import torch
    from transformers import AutoModelForCausalLM
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=16)
    requests = reqs(trace, 0, 2)
    out = sgl.rollout(requests, sampling, Baseline())
    check_rollouts(out, requests, sampling)
    model = AutoModelForCausalLM.from_pretrained(str(trace.checkpoint(0)), dtype=torch.float32).eval()
    for r in out:
        assert r.logprobs == pytest.approx(reference_logprobs(model, r.prompt_token_ids, r.token_ids, 0.7), abs=1e-4)


TARGET = 2  # the step replayed; its prompts' earlier rollouts come from checkpoint 0


def _two_steps(sgl, trace, sampling, rules, n, draft_sampling=None):
    """Rollouts of step 2's prompts under checkpoint 0 fill a prefix-reuse cache; then step 2
    (checkpoint 2) runs the baseline and prefix reuse under each rule from copies of that cache."""
    import copy
    sgl.load(trace.checkpoint(0))
    cache = PrefixReuseDrafter()
    sgl.rollout(reqs(trace, TARGET, n, as_step=0), draft_sampling or sampling, cache)
    sgl.load(trace.checkpoint(TARGET))
    requests = reqs(trace, TARGET, n)
    out = {"baseline": sgl.rollout(requests, sampling, Baseline())}
    for name, verify in rules.items():
        out[name] = sgl.rollout(requests, sampling, copy.deepcopy(cache), verify)
    sgl.load(trace.checkpoint(0))
    return requests, out


@needs_sglang
def test_prefix_reuse_both_rules_complete_with_logprobs(sgl, trace):
    import torch
    from transformers import AutoModelForCausalLM
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=16)
    rules = {"exact": VerifyConfig("exact"), "ratio": VerifyConfig("ratio", math.exp(0.5))}
    requests, out = _two_steps(sgl, trace, sampling, rules, n=4)
    model = AutoModelForCausalLM.from_pretrained(str(trace.checkpoint(TARGET)), dtype=torch.float32).eval()
    for name in rules:
        check_rollouts(out[name], requests, sampling)
        assert sum(r.num_draft_tokens for r in out[name]) > 0
        assert sum(r.num_accepted_tokens for r in out[name]) > 0
        for r in out[name]:  # scoring path (rescaled raw logprobs) and continuation agree with a fresh forward
            assert r.logprobs == pytest.approx(reference_logprobs(model, r.prompt_token_ids, r.token_ids, 0.7),
                                               abs=1e-4)


@needs_sglang
def test_greedy_exact_prefix_reuse_equals_baseline(sgl, trace):
    sampling = SamplingConfig(temperature=0, max_new_tokens=16)
    # drafts from checkpoint 0 at temperature 1: partly right, partly wrong under checkpoint 1's argmax
    _, out = _two_steps(sgl, trace, sampling, {"exact": VerifyConfig("exact")}, n=4,
                        draft_sampling=SamplingConfig(temperature=1.0, max_new_tokens=16))
    assert [r.token_ids for r in out["exact"]] == [r.token_ids for r in out["baseline"]]
    for a, b in zip(out["exact"], out["baseline"]):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    accepted = [r.num_accepted_tokens for r in out["exact"]]
    drafted = [r.num_draft_tokens for r in out["exact"]]
    assert sum(accepted) > 0 and sum(accepted) < sum(drafted), "the drafts must be partly accepted"


@needs_sglang
def test_exact_draft_region_is_coupled_with_torch_ref(sgl, trace):
    """The prefix path verifies with bench.core.verify and the suite's uniforms: the accepted prefix and
    the token after it equal torch_ref's exact prefix reuse (near-ties aside)."""
    import copy
    from bench.engines.torch.engine import TorchRefEngine
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    sgl.load(trace.checkpoint(0))
    cache = PrefixReuseDrafter()
    sgl.rollout(reqs(trace, TARGET, 4, as_step=0), sampling, cache)
    requests = reqs(trace, TARGET, 4)
    ref = TorchRefEngine(dtype="float32")
    ref.load(trace.checkpoint(TARGET))
    expected = ref.rollout(requests, sampling, copy.deepcopy(cache), VerifyConfig())
    sgl.load(trace.checkpoint(TARGET))
    got = sgl.rollout(requests, sampling, copy.deepcopy(cache), VerifyConfig())
    sgl.load(trace.checkpoint(0))
    assert sum(r.num_draft_tokens for r in got) > 0
    same = 0
    for g, e in zip(got, expected):
        k = min(g.num_accepted_tokens + 1, len(g.token_ids))
        same += g.token_ids[:k] == e.token_ids[:k] and g.num_accepted_tokens == e.num_accepted_tokens
    assert same >= len(got) - 1, f"only {same}/{len(got)} draft regions match torch_ref"


def _ref_pair(sgl, trace, sampling, verify, draft_sampling=None):
    """The same prefix cache (filled on SGLang under checkpoint 0) replayed at TARGET on torch_ref
    and on SGLang: (torch_ref rollouts, SGLang rollouts, SGLang's last_scoring)."""
    import copy
    from bench.engines.torch.engine import TorchRefEngine
    sgl.load(trace.checkpoint(0))
    cache = PrefixReuseDrafter()
    sgl.rollout(reqs(trace, TARGET, 4, as_step=0), draft_sampling or sampling, cache)
    requests = reqs(trace, TARGET, 4)
    ref = TorchRefEngine(dtype="float32")
    ref.load(trace.checkpoint(TARGET))
    expected = ref.rollout(requests, sampling, copy.deepcopy(cache), verify)
    sgl.load(trace.checkpoint(TARGET))
    got = sgl.rollout(requests, sampling, copy.deepcopy(cache), verify)
    scoring = sgl.call("__getattribute__", "last_scoring")
    sgl.load(trace.checkpoint(0))
    assert sum(r.num_draft_tokens for r in got) > 0
    return expected, got, scoring


@needs_sglang
def test_draft_only_ratio_scoring_accepts_what_torch_ref_accepts(sgl, trace):
    """SPEC-RL's ratio rule at temperature 1 reads the draft tokens' logprobs only; its acceptance
    test uses the suite's coupled uniforms, so the accepted prefix equals torch_ref's."""
    import torch
    from transformers import AutoModelForCausalLM
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    expected, got, scoring = _ref_pair(sgl, trace, sampling, VerifyConfig("ratio", math.exp(0.5)))
    assert scoring["scoring_logprobs"] == "draft" and scoring["engine"] == "plain"
    assert scoring["scoring_passes"] == sum(r.num_drafts for r in got)
    assert scoring["scoring_tokens"] == sum(len(r.prompt_token_ids) + r.num_draft_tokens for r in got if r.num_drafts)
    same = sum(g.num_accepted_tokens == e.num_accepted_tokens and g.num_draft_tokens == e.num_draft_tokens
               and g.token_ids[:g.num_accepted_tokens] == e.token_ids[:e.num_accepted_tokens]
               for g, e in zip(got, expected))
    assert same >= len(got) - 1, f"only {same}/{len(got)} accepted prefixes match torch_ref"
    model = AutoModelForCausalLM.from_pretrained(str(trace.checkpoint(TARGET)), dtype=torch.float32).eval()
    for r in got:
        check_rollouts([r], [Request(r.key, r.prompt_token_ids, TARGET)], sampling)
        assert r.logprobs == pytest.approx(reference_logprobs(model, r.prompt_token_ids, r.token_ids, 1.0), abs=1e-4)


@needs_sglang
def test_prefix_reuse_passes_are_counted_as_on_torch_ref(sgl, trace):
    """Under greedy the scoring request (top-1 logprobs) is one forward pass that yields the token
    after the accepted prefix, as torch_ref's prefill: same tokens, same counters."""
    sampling = SamplingConfig(temperature=0, max_new_tokens=16)
    expected, got, scoring = _ref_pair(sgl, trace, sampling, VerifyConfig("exact"),
                                       draft_sampling=SamplingConfig(temperature=1.0, max_new_tokens=16))
    assert scoring["scoring_logprobs"] == "top1"
    fields = lambda r: (r.token_ids, r.num_forward_passes, r.num_drafts, r.num_draft_tokens,  # noqa: E731
                        r.num_accepted_tokens, r.num_accepted_tokens_per_pos)
    same = sum(fields(g) == fields(e) for g, e in zip(got, expected))
    assert same >= len(got) - 1, [(fields(g), fields(e)) for g, e in zip(got, expected) if fields(g) != fields(e)]


# ---------------------------------------------------------------- distribution tests at temperature 1

def _pvalues(a, b, trace) -> dict[str, float]:
    """Per-prompt two-sample chi-square p-values on first token, length and reward."""
    from scipy.stats import chi2_contingency
    out = {}
    for pid in sorted({r.key.prompt_id for r in a}):
        ra = [r for r in a if r.key.prompt_id == pid]
        rb = [r for r in b if r.key.prompt_id == pid]
        for what, f in (("first", lambda r: r.token_ids[0]), ("length", lambda r: len(r.token_ids)),
                        ("reward", lambda r: round(trace.reward(pid, r.token_ids), 3))):
            ca, cb = Counter(map(f, ra)), Counter(map(f, rb))
            cats = sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c]))
            big = [c for c in cats if ca[c] + cb[c] >= 10]  # pool rare categories: chi-square needs counts
            rows = [[ca[c] for c in big] + [sum(ca[c] for c in cats if c not in big)],
                    [cb[c] for c in big] + [sum(cb[c] for c in cats if c not in big)]]
            cols = [j for j in range(len(rows[0])) if rows[0][j] + rows[1][j] > 0]
            if len(cols) < 2:
                out[f"{pid}/{what}"] = 1.0
                continue
            out[f"{pid}/{what}"] = float(chi2_contingency([[r[j] for j in cols] for r in rows])[1])
    return out


@needs_sglang
def test_exact_prefix_reuse_matches_baseline_distribution_and_catches_a_wrong_rule(sgl, trace):
    n = 64
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    # off-policy drafts (checkpoint 0 at temperature 2.5): exact verification must still give the
    # policy's distribution; a ratio rule with a huge lenience accepts them and must be caught
    rules = {"exact": VerifyConfig("exact"), "wrong": VerifyConfig("ratio", 1e6)}
    _, out = _two_steps(sgl, trace, sampling, rules, n=n,
                        draft_sampling=SamplingConfig(temperature=2.5, max_new_tokens=16))
    tests = _pvalues(out["exact"], out["baseline"], trace)
    alpha = 1e-3 / len(tests)  # Bonferroni: a false alarm in under 0.1% of runs
    assert min(tests.values()) > alpha, {k: v for k, v in tests.items() if v <= alpha}
    assert sum(r.num_accepted_tokens for r in out["exact"]) > 0
    wrong = _pvalues(out["wrong"], out["baseline"], trace)
    assert min(wrong.values()) < 1e-6, f"the distribution test missed a lossy rule: {wrong}"


# ---------------------------------------------------------------- checkpoints

@needs_sglang
def test_checkpoint_swap_changes_scores_and_back(sgl, trace):
    sampling = SamplingConfig(temperature=0, max_new_tokens=16)
    requests = reqs(trace, 0, 1)
    sgl.load(trace.checkpoint(0))
    first = sgl.rollout(requests, sampling, Baseline())
    prompts = [r.prompt_token_ids for r in first]
    tokens = [r.token_ids for r in first]
    score_a = sgl.call("score", prompts, tokens, 1.0)
    sgl.load(trace.checkpoint(trace.step_numbers[-1]))
    score_b = sgl.call("score", prompts, tokens, 1.0)
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(score_a) != pytest.approx(flat(score_b), abs=1e-3), "new weights must change the logprobs"
    sgl.load(trace.checkpoint(0))
    assert flat(sgl.call("score", prompts, tokens, 1.0)) == pytest.approx(flat(score_a), abs=1e-5)  # fp32, another batch/cache layout
    again = sgl.rollout(requests, sampling, Baseline())
    assert [r.token_ids for r in again] == tokens
    for a, b in zip(score_a, first):  # the scoring path agrees with the generation logprobs
        assert a == pytest.approx(b.logprobs, abs=1e-4)
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(trace.checkpoint(0)), dtype=torch.float32).eval()
    for p, t, got in zip(prompts, tokens, sgl.call("score", prompts, tokens, 0.7)):  # temperature-scaled
        assert got == pytest.approx(reference_logprobs(model, p, t, 0.7), abs=1e-4)


# ---------------------------------------------------------------- tree methods on the suite's scheduler

LOG_COLUMNS = ("rows", "live_rows", "query_tokens", "block_tokens", "context_sum", "draft_tokens", "accepted_tokens")


def _method(name):
    from pathlib import Path
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from bench.harness.cli import CONF_DIR
    cfg = OmegaConf.load(Path(CONF_DIR) / "method" / f"{name}.yaml")
    return instantiate(cfg.drafter), VerifyConfig(**OmegaConf.to_container(cfg.verify, resolve=True))


@needs_sglang
@pytest.mark.parametrize("name", ["tree_cache", "das", "tree_cache_runahead"])
def test_tree_methods_run_on_the_scheduler_with_torch_refs_tokens_and_log(sgl, trace, name):
    """Without NGRAM a method that drafts while decoding runs through the suite's one scheduler with
    SGLang as its backend (every draft node a one-token request read in SGLang's scheduler): the
    same tokens (coupled, float32; a near-tie aside), counters and iteration log as torch_ref."""
    import copy
    from bench.engines.torch.engine import TorchRefEngine
    from bench.harness.replay import RunAheadQueue, run_ahead_requests
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    cache, verify = _method(name)
    steps = trace.step_numbers[:3]
    for s in steps[:-1]:
        sgl.load(trace.checkpoint(s))
        cache.begin_step(s)
        sgl.rollout(reqs(trace, s, 4), sampling, cache, verify)
    step, nxt = steps[-1], trace.step_numbers[3]
    ahead = (lambda: RunAheadQueue(run_ahead_requests(trace, step, nxt, 4))) if name.endswith("runahead") else None
    requests = reqs(trace, step, 4)
    ref = TorchRefEngine(dtype="float32")
    ref.load(trace.checkpoint(step))
    on_ref, on_sgl = copy.deepcopy(cache), copy.deepcopy(cache)
    on_ref.begin_step(step)
    expected = ref.rollout(requests, sampling, on_ref, verify, ahead() if ahead else None)
    sgl.load(trace.checkpoint(step))
    on_sgl.begin_step(step)
    got, _ = sgl.call("rollout", requests, sampling, on_sgl, verify, ahead() if ahead else None)
    assert sgl.call("__getattribute__", "last_path") == "scheduler"
    assert sum(r.num_draft_tokens for r in got) > 0
    if ahead:
        assert any(r.run_ahead for r in got)
    same = [a for a, b in zip(got, expected) if a.token_ids == b.token_ids]
    assert len(same) >= len(got) - 1, "more than one rollout left torch_ref's tokens: not a float32 near-tie"
    for a, b in zip(got, expected):
        if a.token_ids == b.token_ids:
            assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens, a.num_forward_passes) == \
                (b.num_drafts, b.num_draft_tokens, b.num_accepted_tokens, b.num_forward_passes)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    if len(same) == len(got):  # a near-tie moves every later pass of the call: compare logs only without one
        log = sgl.call("__getattribute__", "last_iteration_log")
        assert [{c: r[c] for c in LOG_COLUMNS} for r in log] == \
            [{c: r[c] for c in LOG_COLUMNS} for r in ref.last_iteration_log]


@needs_sglang
def test_exact_prefix_scoring_at_t1_asks_for_no_full_distribution(sgl, trace):
    """SPEC-RL's exact rule at T=1 is read in SGLang's scheduler by node requests: the
    full-distribution request (``_score_distributions``, top_logprobs_num=V) is never made, and the
    accepted prefix and the token after it still equal torch_ref's."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    sgl.call("__setattr__", "_score_distributions", None)  # calling it now fails the rollout
    try:
        expected, got, scoring = _ref_pair(sgl, trace, sampling, VerifyConfig("exact"))
    finally:
        sgl.call("__delattr__", "_score_distributions")
    assert scoring["scoring_logprobs"] == "full"
    same = sum(g.num_accepted_tokens == e.num_accepted_tokens
               and g.token_ids[:g.num_accepted_tokens + 1] == e.token_ids[:e.num_accepted_tokens + 1]
               for g, e in zip(got, expected))
    assert same >= len(got) - 1, f"only {same}/{len(got)} accepted prefixes match torch_ref"


# ---------------------------------------------------------------- tree methods (NGRAM: GPU only)

@needs_sglang
@pytest.mark.gpu
def test_tree_methods_run_through_ngram_speculation(trace):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("SGLang's NGRAM speculation needs a GPU (its CPU verify step does not run)")
    from methods.tree_cache import TreeCacheDrafter
    proxy = EngineProxy(device="cuda", speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    try:
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
        drafter = TreeCacheDrafter()
        steps = trace.step_numbers[:3]
        for s in steps:
            proxy.load(trace.checkpoint(s))
            out = proxy.rollout(reqs(trace, s, 8), sampling, drafter)
            check_rollouts(out, reqs(trace, s, 8), sampling)
        assert sum(r.num_drafts for r in out) > 0, "the corpus of earlier rollouts should yield drafts"
    finally:
        proxy.close()
