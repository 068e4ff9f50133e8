"""The one verifier: every branch of each rule, and a statistical test that exact verification
reproduces the target distribution for random chain and tree drafts (and catches a wrong rule)."""
import functools
import math
import random

import pytest
import torch

from bench.core.sampling import SamplingConfig, rollout_seed
from bench.core.verify import VerifyConfig, descend, ratio_accept, verify_batch
from methods.base import Draft

T1 = SamplingConfig(temperature=1.0)


def test_descend_chain_accepts_until_first_mismatch():
    # sampled tokens equal the draft at nodes 0 and 1, differ at node 2: emit 5, 6, then the sample 9
    assert descend([5, 6, 9, 2], Draft([5, 6, 7])) == ([5, 6, 9], [0, 1, 2])


def test_descend_full_acceptance_emits_bonus():
    # every draft token matches: the token sampled after the last node is the bonus
    assert descend([5, 6, 7, 3], Draft([5, 6, 7])) == ([5, 6, 7, 3], [0, 1, 2, 3])


def test_descend_empty_draft_is_plain_sampling():
    assert descend([4], Draft()) == ([4], [0])


def test_descend_tree_takes_the_branch_that_matches():
    # root children: node0=5, node1=8; node2=6 under node0; node3=9 under node1
    d = Draft([5, 8, 6, 9], parents=[-1, -1, 0, 1])
    # the sample at the root is 8: descend to node1 (local 2), its sample 9 matches node3 (local 4)
    sampled = [8, 0, 9, 0, 1]
    assert descend(sampled, d) == ([8, 9, 1], [0, 2, 4])


def test_ratio_rule_branches():
    d = Draft([5, 6, 7], logprobs=[math.log(0.5)] * 3)
    target = [math.log(0.5), math.log(0.1), math.log(0.9)]
    # node 0: ratio 1 -> accept whatever u; node 1: ratio 0.2*l -> u=0.5 rejects at l=1 and emits the plain sample 3
    assert ratio_accept(d, [0, 3, 0, 0], [0.99, 0.5, 0.1], target, 1.0) == ([5, 3], [0, 1])
    # lenience e^2 lifts node 1's ratio above 1: all accepted, then the bonus sample 4
    assert ratio_accept(d, [0, 3, 0, 4], [0.99, 0.5, 0.1], target, math.e ** 2) == ([5, 6, 7, 4], [0, 1, 2, 3])
    # at the first rejection the plain sample may equal the rejected token itself (no residual)
    assert ratio_accept(d, [0, 6, 0, 0], [0.99, 0.5, 0.1], target, 1.0) == ([5, 6], [0, 1])
    with pytest.raises(ValueError, match="logprobs"):
        ratio_accept(Draft([1]), [0, 0], [0.5], [0.0], 1.0)


def test_verify_config_errors():
    with pytest.raises(ValueError, match="rule"):
        VerifyConfig(rule="lenient")
    with pytest.raises(ValueError, match="lenience"):
        VerifyConfig(rule="ratio", lenience=0.5)


def test_greedy_rule_accepts_argmax_only():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]], dtype=torch.float64)
    keys = torch.tensor([rollout_seed(0, 0, "p", 0)])
    # argmax at node 0 is 1 (matches the draft), at node 1 is 0 (the draft says 2): emit 1 then 0
    v = verify_batch(logits, [Draft([1, 2])], keys, [0], SamplingConfig(temperature=0), VerifyConfig("greedy"))[0]
    assert (v.emitted, v.path) == ([1, 0], [0, 1])
    assert v.logprobs == pytest.approx(torch.log_softmax(logits[0], -1)[[0, 1], [1, 0]].tolist())


# ------------------------------------------------------------------ statistical test

V, L = 4, 3  # vocabulary and sequence length of the toy target


@functools.lru_cache(maxsize=None)
def toy_logits(prefix: tuple) -> torch.Tensor:
    """A context-dependent target: deterministic pseudo-random logits per prefix."""
    g = torch.Generator().manual_seed(1 + sum(t * 7 ** (i + 1) for i, t in enumerate(prefix)) + 1000 * len(prefix))
    return torch.randn(V, generator=g, dtype=torch.float64) * 1.5


def exact_sequence_probs() -> dict:
    out = {}

    def rec(prefix, p):
        if len(prefix) == L:
            out[prefix] = p
            return
        probs = torch.softmax(toy_logits(prefix), -1)
        for t in range(V):
            rec(prefix + (t,), p * probs[t].item())
    rec((), 1.0)
    return out


def random_draft(rng: random.Random, tree: bool, with_logprobs: bool) -> Draft:
    n = rng.randint(0, 4)
    toks = [rng.randrange(V) for _ in range(n)]
    parents = [rng.randint(-1, i - 1) for i in range(n)] if tree else None
    lps = [math.log(rng.uniform(0.05, 1.0)) for _ in range(n)] if with_logprobs else None
    return Draft(toks, parents, lps)


def toy_rollouts(n: int, make_draft, verify: VerifyConfig, seed: int = 0) -> list[list[int]]:
    """n independent length-L rollouts of the toy target through the verifier, drafts from
    ``make_draft(rng)`` at every iteration."""
    rng = random.Random(seed)
    keys = torch.tensor([rollout_seed(seed, 0, "toy", i) for i in range(n)])
    outs = [[] for _ in range(n)]
    while any(len(o) < L for o in outs):
        live = [i for i in range(n) if len(outs[i]) < L]
        drafts = [make_draft(rng) for _ in live]
        K = 1 + max(len(d) for d in drafts)
        logits = torch.zeros(len(live), K, V, dtype=torch.float64)
        for b, (i, d) in enumerate(zip(live, drafts)):
            ctx = [tuple(outs[i])]
            for tok, p in zip(d.token_ids, d.parent_list()):
                ctx.append(ctx[p + 1] + (tok,))
            for j, c in enumerate(ctx):
                logits[b, j] = toy_logits(c)
        for i, v in zip(live, verify_batch(logits, drafts, keys[live], [len(outs[i]) for i in live], T1, verify)):
            outs[i] = (outs[i] + v.emitted)[:L]
    return outs


def generate_many(n: int, tree: bool, verify: VerifyConfig, seed: int = 0) -> dict:
    """Counts of each length-L sequence over n rollouts with random drafts."""
    counts: dict = {}
    for o in toy_rollouts(n, lambda rng: random_draft(rng, tree, verify.rule == "ratio"), verify, seed):
        counts[tuple(o)] = counts.get(tuple(o), 0) + 1
    return counts


def chi_square(counts: dict, probs: dict, n: int) -> float:
    return sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in probs.items())


# df = 63 cells - 1: mean 63, sd ~11; 140 is ~7 sd out, so a correct rule never fails by chance
CHI2_LIMIT = 140.0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_exact_rule_reproduces_target_distribution(tree):
    n = 12000
    counts = generate_many(n, tree, VerifyConfig("exact"))
    assert chi_square(counts, exact_sequence_probs(), n) < CHI2_LIMIT


def test_statistical_test_catches_a_wrong_rule():
    # the lenient ratio rule (with made-up draft probabilities) is biased: the same test must reject it
    n = 12000
    counts = generate_many(n, False, VerifyConfig("ratio", lenience=math.e))
    assert chi_square(counts, exact_sequence_probs(), n) > 5 * CHI2_LIMIT


def test_exact_rule_emits_plain_sampling_tokens():
    # coupling: with the same keys, any draft gives exactly the tokens of drafting nothing
    n = 300
    base = toy_rollouts(n, lambda rng: Draft(), VerifyConfig(), seed=5)
    for tree in (False, True):
        assert toy_rollouts(n, lambda rng: random_draft(rng, tree, False), VerifyConfig(), seed=5) == base


# ------------------------------------------------------------------ windows and chunks

def _accepting_case(rng: random.Random, V: int, tree: bool, ratio: bool, n_max: int):
    """Random logits [1, K, V] and a draft whose tokens are mostly the argmax of their parent
    node (so chains run long before their first rejection), float64."""
    n = rng.randint(0, n_max)
    parents = [rng.randint(max(-1, i - 3), i - 1) for i in range(n)] if tree else None
    logits = torch.randn(1, n + 1, V, dtype=torch.float64) * 4
    d = Draft([0] * n, parents, [math.log(rng.uniform(0.05, 1.0)) for _ in range(n)] if ratio else None)
    for i, p in enumerate(d.parent_list()):
        d.token_ids[i] = int(logits[0, p + 1].argmax()) if rng.random() < 0.9 else rng.randrange(V)
    return logits, d


@pytest.mark.parametrize("sampling", [T1, SamplingConfig(top_p=0.8, temperature=0.7), SamplingConfig(temperature=0)],
                         ids=["t1", "top_p", "greedy"])
def test_windowed_verification_gives_the_unwindowed_verdict(sampling, monkeypatch):
    import bench.core.verify as verify_mod
    rng = random.Random(3)
    rules = ["exact", "ratio"] + (["greedy"] if sampling.greedy else [])
    longest = 0
    for case in range(60):
        rule = rules[case % len(rules)]
        tree = rule != "ratio" and case % 2 == 1
        batch = [_accepting_case(rng, 30, tree, rule == "ratio", 40) for _ in range(3)]
        K = max(lg.shape[1] for lg, _ in batch)
        logits = torch.full((3, K, 30), float("nan"), dtype=torch.float64)  # padding: never read
        for b, (lg, _) in enumerate(batch):
            logits[b, :lg.shape[1]] = lg[0]
        drafts = [d for _, d in batch]
        keys = torch.tensor([rollout_seed(case, 1, "w", b) for b in range(3)])
        verify = VerifyConfig(rule, lenience=1.3 if rule == "ratio" else 1.0)
        monkeypatch.setattr(verify_mod, "WINDOW", 10_000)
        whole = verify_batch(logits, drafts, keys, [case, 0, 7], sampling, verify)
        longest = max([longest] + [v.num_accepted for v in whole])
        for window, chunk in ((1, 1), (2, 7 * 30 * 4), (5, 1 << 20)):
            monkeypatch.setattr(verify_mod, "WINDOW", window)
            monkeypatch.setattr(verify_mod, "CHUNK_BYTES", {"cpu": chunk})
            read = []

            def logits_at(rows, nodes):
                read.append(len(rows))
                return logits[rows, nodes]
            got = verify_mod.verify_nodes(logits_at, 30, drafts, keys, [case, 0, 7], sampling, verify)
            assert [(v.emitted, v.path, v.logprobs, v.margins) for v in got] == \
                [(v.emitted, v.path, v.logprobs, v.margins) for v in whole]
            # windows double from ``window``: a row reads at most about twice the nodes its verdict needs,
            # and exactly what ``nodes_read`` counts from its draft's length and its verdict's path
            assert sum(read) <= sum(min(1 + len(d), 2 * len(v.path) + window) for d, v in zip(drafts, whole))
            assert sum(read) == sum(verify_mod.nodes_read(len(d), v.path, window, rule == "ratio")
                                   for d, v in zip(drafts, whole))
    assert longest > 10  # the cases do run past the small windows


def test_nodes_read_counts_the_windows_of_a_path():
    from bench.core.verify import nodes_read
    assert nodes_read(0, [0]) == 1 and nodes_read(31, [0]) == 32  # one window: every node, rejected ones too
    assert nodes_read(100, [0, 1, 2], window=32) == 32  # rejected in the first window: it alone
    assert nodes_read(100, list(range(33)), window=32) == 32 + 64  # past it: the next window, twice as long
    assert nodes_read(100, list(range(101)), window=32) == 101  # accepted whole: every node once
    assert nodes_read(10, [0, 6, 7], window=4) == 4 + 5  # a tree's path jumps to a later branch (node 6): 4, 5 unread
    # the ratio rule reads on while every node read was accepted, though the next token is then rejected
    assert nodes_read(10, [0, 1, 2, 3], window=4) == 4 and nodes_read(10, [0, 1, 2, 3], window=4, ratio=True) == 4 + 7


@pytest.mark.parametrize("sampling", [T1, SamplingConfig(top_p=0.8, temperature=0.7), SamplingConfig(temperature=0)],
                         ids=["t1", "top_p", "greedy"])
def test_reads_computed_elsewhere_give_the_verdict_of_logits(sampling):
    """An engine that reads each node where its logits are (vLLM's worker: ``read_logits`` over one
    node at a time, its probe tokens the children's draft tokens) and hands the reads to
    ``verify_nodes(reads_at=...)`` gets the verdict of verifying the logits here: same tokens,
    path, logprobs, margins, chains and trees, every rule."""
    from bench.core.verify import node_depths, node_probes, read_logits, verify_nodes
    rng = random.Random(5)
    rules = ["exact", "ratio"] + (["greedy"] if sampling.greedy else [])
    for case in range(30):
        rule = rules[case % len(rules)]
        batch = [_accepting_case(rng, 30, rule != "ratio" and case % 2 == 1, rule == "ratio", 20) for _ in range(3)]
        drafts = [d for _, d in batch]
        keys = [rollout_seed(case, 1, "r", b) for b in range(3)]
        out_lens = [case, 0, 3]
        verify = VerifyConfig(rule, lenience=1.3 if rule == "ratio" else 1.0)
        greedy = rule == "greedy" or sampling.greedy
        expected = verify_nodes(lambda rows, nodes: torch.stack([batch[b][0][0, j] for b, j in
                                                                 zip(rows.tolist(), nodes.tolist())]),
                                30, drafts, torch.tensor(keys), out_lens, sampling, verify)
        asked = []

        def reads_at(pairs):
            asked.extend(pairs)
            return [read_logits(batch[b][0][0, j][None], [keys[b]], [out_lens[b] + node_depths(drafts[b])[j]],
                                [node_probes(drafts[b])[j]], sampling, greedy)[0] for b, j in pairs]
        got = verify_nodes(None, 30, drafts, torch.tensor(keys), out_lens, sampling, verify, reads_at=reads_at)
        assert asked and len(set(asked)) == len(asked)  # each node read once
        assert [(v.emitted, v.path, v.logprobs, v.margins) for v in got] == \
            [(v.emitted, v.path, v.logprobs, v.margins) for v in expected]


def test_a_pass_reads_the_sum_of_its_rows_nodes():
    from bench.core.verdicts import WINDOW, nodes_read, pass_nodes_read
    lens, paths = [0, 3, 2 * WINDOW + 5], [[0], [0, 1], list(range(WINDOW + 3))]
    assert pass_nodes_read(lens[:2], paths[:2]) == 1 + 4  # within one window: every node
    for ratio in (False, True):
        assert pass_nodes_read(lens, iter(paths), ratio) == sum(nodes_read(k, p, ratio=ratio)
                                                               for k, p in zip(lens, paths))
    assert pass_nodes_read([], []) == 0
