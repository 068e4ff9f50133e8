"""The torch reference engine: exactness by equality, logprobs, tree drafts, checkpoints, bad input."""
import json
import random

import pytest
import torch

from bench.core.engine_protocol import Request
from bench.engines.checkpoint import CheckpointError
from bench.engines.torch.engine import TorchRefEngine
from bench.core.sampling import SamplingConfig
from bench.core.verify import VerifyConfig
from methods.base import Draft, NullDrafter, RolloutKey
from methods.baseline import Baseline
from methods.oracle import OracleDrafter
from tiny_models import make_checkpoint, reference_logprobs

SAMPLINGS = {"t1": SamplingConfig(max_new_tokens=48), "top_p": SamplingConfig(max_new_tokens=48, top_p=0.9),
             "greedy": SamplingConfig(temperature=0, max_new_tokens=48)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine64(ckpts):
    eng = TorchRefEngine(dtype="float64")
    eng.load(ckpts[0])
    return eng


def requests(n: int, step: int = 1) -> list[Request]:
    # ragged prompts: lengths 2..5
    return [Request(RolloutKey(f"p{i // 2}", i % 2), [0] + [3 + (7 * i + j) % 30 for j in range(1 + i % 4)], step)
            for i in range(n)]


class TreeOracle(OracleDrafter):
    """The oracle's chain plus decoy branches: a wrong sibling before every true node, and a wrong
    subtree under each decoy, so the accepted path is never the first nodes of the block."""

    name = "tree_oracle"

    def propose(self, key, output, budget):
        chain = super().propose(key, output, budget)
        toks, parents, prev = [], [], -1
        for tok in chain.token_ids:
            decoy = (tok + 1) % 40
            toks += [decoy, (decoy + 5) % 40, tok]
            parents += [prev, len(toks) - 3, prev]
            prev = len(toks) - 1
        return Draft(toks, parents).truncated(budget)


@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("batch", [1, 8])
def test_oracle_and_tree_drafts_are_token_identical_to_baseline(engine64, name, batch):
    sampling = SAMPLINGS[name]
    reqs = requests(batch)
    base = engine64.rollout(reqs, sampling, Baseline(), VerifyConfig())
    futures = {r.key: r.token_ids for r in base}
    if batch == 8:
        assert len({len(r.token_ids) for r in base}) > 1, "the ragged batch must finish at different lengths"
    for drafter in (OracleDrafter(futures, 8), TreeOracle(futures, 4)):
        out = engine64.rollout(reqs, sampling, drafter, VerifyConfig())
        assert [r.token_ids for r in out] == [r.token_ids for r in base]
        for a, b in zip(out, base):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)
            assert a.finish_reason == b.finish_reason
        # the drafts helped: fewer forward passes, and every accepted token was counted
        assert sum(r.num_forward_passes for r in out) < sum(r.num_forward_passes for r in base)
        assert all(r.num_accepted_tokens == sum(r.num_accepted_tokens_per_pos) for r in out)
    assert all(r.num_forward_passes == len(r.token_ids) for r in base)


def test_logprobs_equal_fresh_forward(ckpts):
    from transformers import AutoModelForCausalLM
    eng = TorchRefEngine(dtype="float32")
    eng.load(ckpts[0])
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.7)
    reqs = requests(4)
    base = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
    out = eng.rollout(reqs, sampling, OracleDrafter({r.key: r.token_ids for r in base}, 6), VerifyConfig())
    model = AutoModelForCausalLM.from_pretrained(str(ckpts[0]), dtype=torch.float32).eval()
    for r in out:
        ref = reference_logprobs(model, r.prompt_token_ids, r.token_ids, 0.7)
        assert r.logprobs == pytest.approx(ref, abs=1e-4)


def test_continuous_batching_gives_the_same_tokens(ckpts, engine64):
    eng = TorchRefEngine(dtype="float64", max_batch_size=3)
    eng.load(ckpts[0])
    reqs = requests(8)
    sampling = SAMPLINGS["t1"]
    assert [r.token_ids for r in eng.rollout(reqs, sampling, Baseline(), VerifyConfig())] == \
        [r.token_ids for r in engine64.rollout(reqs, sampling, Baseline(), VerifyConfig())]


def test_checkpoint_swap_changes_the_policy_and_back(ckpts):
    eng = TorchRefEngine(dtype="float64")
    reqs, sampling = requests(4), SAMPLINGS["t1"]
    eng.load(ckpts[0])
    first = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
    model_before = eng.model
    eng.load(ckpts[1])
    assert eng.model is model_before, "same architecture: weights swapped in place"
    second = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
    assert [r.logprobs for r in first] != [r.logprobs for r in second]
    eng.load(ckpts[0])
    again = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


class Recorder(NullDrafter):
    def __init__(self):
        self.calls = []

    def start(self, key, prompt):
        self.calls.append(("start", key))

    def observe(self, key, new_tokens):
        self.calls.append(("observe", key))

    def finish(self, key, rollout):
        self.calls.append(("finish", key, rollout.run_ahead))


def test_run_ahead_requests_feed_the_drafter_and_come_back_after_the_trained_ones(engine64):
    reqs = requests(4)
    extra = [Request(RolloutKey(f"next{i}", 0), [0, 9, 9, i + 3], step=2, run_ahead=True) for i in range(6)]
    asked = []

    def source(free):
        asked.append(free)
        take = extra[:free]
        del extra[:free]
        return take

    rec = Recorder()
    sampling = SAMPLINGS["t1"]
    out = engine64.rollout(reqs, sampling, rec, VerifyConfig(), run_ahead=source)
    base = engine64.rollout(reqs, sampling, Baseline(), VerifyConfig())
    trained, ahead = out[:4], out[4:]
    assert [r.token_ids for r in trained] == [r.token_ids for r in base]
    assert asked and all(f > 0 for f in asked)
    observed = {c[1].prompt_id for c in rec.calls if c[0] == "observe"}
    assert any(p.startswith("next") for p in observed)
    assert all(not r.run_ahead for r in trained)
    # every admitted run-ahead request comes back, finished or aborted when the main batch ended
    assert ahead and all(r.run_ahead and r.key.prompt_id.startswith("next") for r in ahead)
    assert len(ahead) == 6 - len(extra)
    assert all(r.finish_reason in ("stop", "length", "abort") for r in ahead)


def test_bad_checkpoints_name_the_path(tmp_path, ckpts):
    eng = TorchRefEngine()
    with pytest.raises(CheckpointError, match="does not exist"):
        eng.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        eng.load(tmp_path / "empty")
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(CheckpointError, match="not a causal language model"):
        eng.load(tmp_path / "t5")


def test_tokenizer_vocab_mismatch_is_refused(tmp_path, ckpts):
    import shutil
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    d = tmp_path / "mismatch"
    shutil.copytree(ckpts[0], d)
    vocab = {chr(ord("a") + i % 26) + str(i): i for i in range(60)}  # 60 tokens > vocab_size 40
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a0"))).save_pretrained(str(d))
    with pytest.raises(CheckpointError, match="60 tokens but config.json vocab_size is 40"):
        TorchRefEngine().load(d)


def test_prompt_longer_than_context_is_refused(engine64):
    long = [Request(RolloutKey("long", 0), [3] * 500)]
    with pytest.raises(ValueError, match="'long' has 500 tokens.*context of 512"):
        engine64.rollout(long, SamplingConfig(max_new_tokens=48), Baseline(), VerifyConfig())


def test_rollout_steps_yield_once_per_iteration_and_keep_their_own_clock(ckpts, engine64):
    """``rollout_steps`` is ``rollout`` one iteration at a time (the replay's interleaved timing):
    the same rollouts, one yield per logged iteration, and token times that leave out the time
    spent between its iterations. A sibling engine runs the same weights with a policy of its own."""
    import time
    reqs, sampling = requests(6), SAMPLINGS["t1"]
    whole = engine64.rollout(reqs, sampling, Baseline(), VerifyConfig())
    futures = {r.key: r.token_ids[:len(r.token_ids) // 2] for r in whole}  # drafts right for half of each rollout
    twin = TorchRefEngine(dtype="float64").sibling()
    twin.share_model(engine64)
    assert twin.model is engine64.model and twin.policy is not engine64.policy
    steps, yields, pause = twin.rollout_steps(reqs, sampling, OracleDrafter(futures, 4), VerifyConfig()), 0, 0.02
    start = time.perf_counter()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            stepped = done.value
            break
        yields += 1
        time.sleep(pause)  # another method's iteration would run here
    elapsed = time.perf_counter() - start
    assert [r.token_ids for r in stepped] == [r.token_ids for r in whole]
    assert sum(r.num_accepted_tokens for r in stepped) > 0
    assert yields == twin.last_iterations == len(twin.last_iteration_log) > 5
    assert max(r.last_token_time for r in stepped) < elapsed - yields * pause + 0.01


def test_rollout_before_load_is_refused():
    with pytest.raises(RuntimeError, match="before load"):
        TorchRefEngine().rollout(requests(1), SamplingConfig(), Baseline(), VerifyConfig())


def test_drafts_never_overshoot_max_new_tokens(engine64):
    class Greedy(NullDrafter):
        def propose(self, key, output, budget):
            return Draft([random.randrange(40) for _ in range(100)])  # ignores the budget on purpose
    out = engine64.rollout(requests(8), SamplingConfig(max_new_tokens=20), Greedy(), VerifyConfig())
    assert all(len(r.token_ids) <= 20 for r in out)


def test_forward_groups_split_only_when_padding_is_wasted():
    from bench.spec.groups import forward_groups as _forward_groups
    # three one-token rows and one 25-token row: two passes cost 28 tokens instead of 100
    assert _forward_groups([1, 1, 1, 25], min_tokens=1) == [[0, 1, 2], [3]]
    # similar sizes: padding wastes little, one pass
    assert _forward_groups([9, 10, 10, 11], min_tokens=1) == [[0, 1, 2, 3]]
    # a small block is never split: a second call costs more than the padding
    assert _forward_groups([1, 1, 1, 9]) == [[0, 1, 2, 3]]
    # with a latency table the seconds decide: a pass costing 1.3 ms plus 10 us a token (this CPU's
    # small model) is never worth splitting; one costing 1 us a token is, where padding is most of it
    overhead = lambda rows, width: 1.3e-3 + 1e-5 * rows * width  # noqa: E731
    assert _forward_groups([1] * 25 + [3] * 7, seconds=overhead) == [list(range(32))]
    assert _forward_groups([1, 1, 1, 25], seconds=overhead) == [[0, 1, 2, 3]]
    per_token = lambda rows, width: 1e-6 * rows * width  # noqa: E731
    assert _forward_groups([1, 1, 1, 25], seconds=per_token) == [[0, 1, 2], [3]]
    assert _forward_groups([9, 10, 10, 11], seconds=per_token) == [[0, 1, 2, 3]]


def test_split_forward_passes_give_the_same_tokens(engine64, monkeypatch):
    import bench.spec.scheduler as tr
    reqs, sampling = requests(8), SAMPLINGS["t1"]
    base = engine64.rollout(reqs, sampling, Baseline(), VerifyConfig())
    futures = {r.key: r.token_ids for r in base}
    # interleaved rows in two passes exercise the row-subset path of the KV cache
    monkeypatch.setattr(tr, "forward_groups", lambda sizes, **kw: [list(range(0, len(sizes), 2)),
                                                                   list(range(1, len(sizes), 2))]
                        if len(sizes) > 1 else [[0]])
    for drafter in (Baseline(), OracleDrafter(futures, 5), TreeOracle(futures, 3)):
        out = engine64.rollout(reqs, sampling, drafter, VerifyConfig())
        assert [r.token_ids for r in out] == [r.token_ids for r in base]
        for a, b in zip(out, base):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_token_identity_on_gpu(ckpts, name):
    eng = TorchRefEngine(device="cuda", dtype="float64")
    eng.load(ckpts[0])
    reqs, sampling = requests(8), SAMPLINGS[name]
    base = eng.rollout(reqs, sampling, Baseline(), VerifyConfig())
    futures = {r.key: r.token_ids for r in base}
    for drafter in (OracleDrafter(futures, 8), TreeOracle(futures, 4)):
        out = eng.rollout(reqs, sampling, drafter, VerifyConfig())
        assert [r.token_ids for r in out] == [r.token_ids for r in base]


def test_slot_cache_keeps_rows_in_place_and_reuses_freed_ones():
    from bench.engines.torch.kv_slots import SlotKVCache
    cache = SlotKVCache(capacity=6)
    cache.add_rows(4, 6)
    keys = torch.arange(4 * 1 * 3 * 2, dtype=torch.float32).reshape(4, 1, 3, 2)
    cache.set_block(torch.tensor([[0, 1, 2]] * 4), 3)
    cache.update(keys, -keys, 0)
    before = cache.keys[0].clone()
    cache.keep_rows([0, 2, 3], used=3)  # row 1 finished: rows 2 and 3 move up, row 0 stays
    assert cache.rows == 3 and cache.keys[0].shape[0] == 3
    assert torch.equal(cache.keys[0][:, :, :3], before[[0, 2, 3], :, :3])
    assert torch.equal(cache.values[0][:, :, :3], -before[[0, 2, 3], :, :3])
    buffer = cache._keys[0]
    cache.add_rows(1, 6)  # the freed row is reused, nothing is reallocated
    assert cache.rows == 4 and cache._keys[0] is buffer
    with pytest.raises(ValueError):
        cache.keep_rows([2, 1])


def test_no_pass_reads_cache_memory_before_it_is_zeroed_or_written(ckpts, engine64, monkeypatch):
    """The KV cache is allocated uninitialised and zeroed only as far as passes read; with new
    memory filled with NaN (``poison``), any slot read before it is zeroed or written turns the
    logits into NaN (a masked slot weighs 0, and 0 x NaN is NaN). Rows are admitted, dropped and
    reused (a live-batch cap), the prompts grow the capacity, tree drafts move accepted slots."""
    import functools

    import bench.engines.torch.block as tb  # where the backend builds its cache
    from bench.engines.torch.kv_slots import SlotKVCache
    reqs, sampling = requests(8), SAMPLINGS["t1"]
    reqs.append(Request(RolloutKey("long", 0), [0] + [5 + j % 20 for j in range(30)], 1))  # admitted last: grows
    capped = TorchRefEngine(dtype="float64", max_batch_size=3)
    capped.load(ckpts[0])
    base = engine64.rollout(reqs, sampling, Baseline(), VerifyConfig())
    futures = {r.key: r.token_ids for r in base}
    monkeypatch.setattr(tb, "SlotKVCache", functools.partial(SlotKVCache, poison=True))
    for eng in (engine64, capped):
        for drafter in (Baseline(), OracleDrafter(futures, 5), TreeOracle(futures, 3)):
            out = eng.rollout(reqs, sampling, drafter, VerifyConfig())
            assert [r.token_ids for r in out] == [r.token_ids for r in base]
            for a, b in zip(out, base):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)


def test_slot_cache_zeroes_new_rows_and_slots_as_far_as_passes_read():
    from bench.engines.torch.kv_slots import SlotKVCache
    cache = SlotKVCache(capacity=4, poison=True)
    cache.add_rows(2, 4)
    cache.set_block(torch.tensor([[0, 1], [0, 1]]), 3)  # a pass reading 3 slots, writing 2 of them
    k, _ = cache.update(torch.ones(2, 1, 2, 2), torch.ones(2, 1, 2, 2), 0)
    assert torch.equal(k[:, :, :2], torch.ones(2, 1, 2, 2)) and torch.equal(k[:, :, 2], torch.zeros(2, 1, 2))
    assert cache._keys[0][:, :, 3:].isnan().all()  # never read yet: never touched
    cache.add_rows(1, 6)  # a new row and a longer capacity: new memory again
    assert cache._keys[0].shape == (3, 1, 7, 2)
    assert torch.equal(cache._keys[0][2, :, :3], torch.zeros(1, 3, 2))  # as far as every row is zeroed
    cache.set_block(torch.tensor([[5], [5], [5]]), 6)
    k, v = cache.update(torch.full((3, 1, 1, 2), 2.0), torch.full((3, 1, 1, 2), 2.0), 0)
    assert not k.isnan().any() and not v.isnan().any()
    assert torch.equal(k[:, :, :2], torch.tensor([[[[1.0, 1.0]] * 2]] * 2 + [[[[0.0, 0.0]] * 2]]))


def test_slot_cache_zeroes_live_rows_only_and_a_reused_row_when_it_returns():
    """A long tail with one live row must not touch every finished row's slots (at 15 interleaved
    methods on a real model those pages were most of the process's memory); a finished row that is
    reused is zeroed as far as the live ones before any pass reads it."""
    from bench.engines.torch.kv_slots import SlotKVCache
    cache = SlotKVCache(capacity=8, poison=True)
    cache.add_rows(3, 8)
    cache.set_block(torch.tensor([[0], [0], [0]]), 2)
    cache.update(torch.ones(3, 1, 1, 2), torch.ones(3, 1, 1, 2), 0)
    cache.keep_rows([0], used=1)  # rows 1 and 2 finished
    cache.set_block(torch.tensor([[4]]), 6)  # the tail: one row reads 6 slots
    k, _ = cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 0)
    assert not k.isnan().any()
    assert cache._keys[0][1:, :, 2:6].isnan().all()  # the dead rows' slots were left untouched
    cache.add_rows(2, 8)  # both reused
    assert not cache._keys[0][:, :, :6].isnan().any() and not cache._values[0][:, :, :6].isnan().any()
    cache.set_block(torch.tensor([[6], [6], [6]]), 7)
    k, v = cache.update(torch.ones(3, 1, 1, 2), torch.ones(3, 1, 1, 2), 0)
    assert not k.isnan().any() and not v.isnan().any()


def test_long_chain_blocks_in_query_chunks_give_the_same_tokens(engine64, monkeypatch):
    """A block whose mask would pass MASK_BYTES runs its queries in chunks (memory rows x chunk x
    context instead of rows x queries x context): the same tokens and logprobs, first drafts of a
    whole rollout included."""
    import bench.engines.torch.block as tb
    reqs, sampling = requests(6), SAMPLINGS["t1"]
    base = engine64.rollout(reqs, sampling, Baseline(), VerifyConfig())
    futures = {r.key: r.token_ids for r in base}
    chunked = []
    real_chunked = tb.TorchBackend._chunked

    def spy(self, block):
        chunked.append(block.input_ids.shape)
        return real_chunked(self, block)

    monkeypatch.setattr(tb, "MASK_BYTES", 6 * 8 * 8 * 8)  # a few queries per chunk at this size
    monkeypatch.setattr(tb.TorchBackend, "_chunked", spy)
    for drafter in (Baseline(), OracleDrafter(futures, None), OracleDrafter(futures, 5)):
        out = engine64.rollout(reqs, sampling, drafter, VerifyConfig())
        assert [r.token_ids for r in out] == [r.token_ids for r in base]
        for a, b in zip(out, base):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)
    assert chunked and max(q for _, q in chunked) > 8
