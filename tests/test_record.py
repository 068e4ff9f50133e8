"""The bundled recorder: task parser and reward, char tokenizer, and the tiny GRPO trace it records.

    pytest tests/test_record.py
"""
from __future__ import annotations

import json
import statistics

import pytest

from bench.traces.record import task as countdown
from bench.traces.record.task import Problem, parse_answer, reward
from bench.traces.format import Trace

P = Problem((3, 5, 7), 15)  # prompt "3 5 7>15:"


@pytest.mark.parametrize("answer, expected", [
    ("3+5+7=15", 1.0),        # all three numbers
    ("7+5+3=15", 1.0),        # any order
    ("3*5=15", 1.0),          # a subset of the numbers is allowed
    ("(7-5)*3+9=15", 0.1),    # 9 is not one of the numbers: well formed but wrong
    ("5*3+7-7=15", 0.1),      # 7 used twice
    ("3+5+7=16", 0.1),        # claims the wrong value
    ("3+5=15", 0.1),          # claims the target but evaluates to 8
    ("35-7*3=15", 0.1),       # digits glued into 35 (not a given number)
    ("(3+5)*7/8=7", 0.1),     # parses, wrong target and an unknown 8
    ("3+5+7", 0.0),           # no "=N"
    ("3+5+7=", 0.0),          # no claimed value
    ("3++5=8", 0.0),          # operator without operand
    ("(3+5=8", 0.0),          # unbalanced parenthesis
    ("3/(5-5)=0", 0.0),       # division by zero is not a value
    ("3+5=1=5", 0.0),         # two '='
    ("__import__('os')=1", 0.0),  # never evaluated as Python
    ("", 0.0),
])
def test_reward_cases(answer, expected):
    assert reward(P, answer) == expected


def test_parser_is_exact_arithmetic():
    value, literals, claimed = parse_answer("(7+5)/3*2=8")  # 12 / 3 * 2, left to right
    assert (value, literals, claimed) == (8, [7, 5, 3, 2], 8)
    value, _, _ = parse_answer("7/2*2=7")  # exact fractions: 7/2 is not truncated
    assert value == 7
    assert parse_answer("7-5-1=1")[0] == 1  # left associative


def test_problems_are_deterministic_and_solvable():
    a = countdown.make_problems(20, seed=5)
    assert a == countdown.make_problems(20, seed=5)
    assert a != countdown.make_problems(20, seed=6)
    assert len(set(a)) == 20
    for p in a:
        sols = countdown.solutions(p)
        assert len(sols) >= 4  # many valid answers per problem (the policy stays stochastic)
        assert all(1 <= x <= 9 for x in p.numbers) and p.target not in p.numbers
        assert all(reward(p, s) == 1.0 for s in sols)
    assert countdown.score(P.metadata(), "3*5=15") == 1.0


def test_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    from bench.traces.record.tokenizer import ALPHABET, SPECIALS, save_tokenizer

    save_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tok) == len(SPECIALS) + len(ALPHABET)
    text = "3 5 7>15:(7-5)*3*5/2=15"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids + [tok.eos_token_id]).endswith("=15<eos>")
    assert tok("x")["input_ids"] == [tok.bos_token_id, tok.unk_token_id]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_tiny_trace_is_valid_and_stores_stats(tiny_trace):
    trace = Trace.load(tiny_trace)
    recorder = trace.manifest["recorder"]
    n, steps = recorder["n"], recorder["steps"]
    assert trace.task == "countdown" and trace.sampling.n == n and len(trace.steps) == steps
    for s in trace.steps:
        ckpt = trace.checkpoint(s.step)
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
            assert (ckpt / f).exists(), f
        df = trace.rollouts(s.step)
        assert len(df) == len(s.prompt_ids) * n
        assert sorted(set(df.prompt_id)) == sorted(s.prompt_ids)
        for pid, ids, lps, r in zip(df.prompt_id, df.token_ids, df.logprobs, df.reward):
            assert len(ids) == len(lps) <= trace.sampling.max_new_tokens
            assert max(lps) <= 0.0
            assert trace.reward(pid, ids) == r  # the trace scores replays like the recorder did
    stats = json.loads((tiny_trace / "stats.json").read_text())
    rows = stats["steps"]
    assert [r["step"] for r in rows] == trace.step_numbers
    for key in ("reward_mean", "length_mean", "length_p90", "repeat_frac", "distinct_frac"):
        assert key in rows[0]
    repeats = [r["repeat_frac"] for r in rows if r["repeat_frac"] is not None]
    assert repeats and statistics.mean(repeats) < 0.9  # a stochastic policy: visits differ
    assert statistics.mean(r["distinct_frac"] for r in rows) > 0.3
    # every prompt is visited once per epoch
    per_epoch = recorder["num_prompts"] // recorder["prompts_per_step"]
    for e in range(steps // per_epoch):
        epoch = [p for s in trace.steps[e * per_epoch:(e + 1) * per_epoch] for p in s.prompt_ids]
        assert sorted(epoch) == sorted(trace.prompts)


def test_baseline_replay_reproduces_the_recording(tiny_trace):
    """Coupled sampling: the recorder's seed makes a baseline replay emit the recorded tokens."""
    from bench.core.engine_protocol import Request
    from bench.engines.torch.engine import TorchRefEngine
    from bench.core.verify import VerifyConfig
    from methods.base import RolloutKey
    from methods.baseline import Baseline

    trace = Trace.load(tiny_trace)
    engine = TorchRefEngine(dtype="float32")  # as recorded
    for step in (trace.step_numbers[0], trace.step_numbers[-1]):
        engine.load(trace.checkpoint(step))
        df = trace.rollouts(step)
        requests = [Request(RolloutKey(p, int(i)), trace.prompts[p], step=step)
                    for p, i in zip(df.prompt_id, df.sample_idx)]
        out = engine.rollout(requests, trace.sampling.to_config(), Baseline(), VerifyConfig())
        assert [o.token_ids for o in out] == [list(t) for t in df.token_ids]


def test_ensure_trace_is_atomic(tmp_path, monkeypatch):
    from bench.traces.record.cache import ensure_trace
    from bench.traces.record import grpo

    def killed(out, cfg, progress=True):
        (out / "trace.yaml").write_text("name: half\n")  # a half-written trace
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "record", killed)
    with pytest.raises(KeyboardInterrupt):
        ensure_trace(tmp_path / "t", tiny=True)
    assert not (tmp_path / "t").exists() and list(tmp_path.iterdir()) == []


def test_ensure_trace_reuses_an_existing_trace(tiny_trace, tmp_path, monkeypatch):
    from bench.traces.record.cache import ensure_trace
    from bench.traces.record import grpo

    monkeypatch.setattr(grpo, "record", lambda *a, **k: pytest.fail("must not record again"))
    assert ensure_trace(tiny_trace, tiny=True) == tiny_trace
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a trace"):
        ensure_trace(tmp_path / "junk")


def test_cli_refuses_to_overwrite(tiny_trace):
    from bench.traces.record.__main__ import main

    with pytest.raises(SystemExit, match="already holds a trace"):
        main(["--out", str(tiny_trace), "--tiny"])


# ---------------------------------------------------------------- the long-tailed reasoning trace

def test_search_transcripts_vary_in_length_and_score():
    import random

    from bench.traces.record import search_task as st
    problems = st.make_problems(40, seed=3)
    assert problems == st.make_problems(40, seed=3) and len(set(problems)) == 40
    assert {len(p.numbers) for p in problems} == {3, 4}
    rng = random.Random(0)
    lines, rewards = [], []
    for p in problems:
        assert p.target in st.reachable(p.numbers) and p.target not in p.numbers
        for _ in range(3):
            text, solved = st.solve_transcript(p, rng, max_lines=58)
            lines.append(text.count("\n") + 1)
            assert text.endswith(st.GIVE_UP) != solved
            rewards.append(st.reward(p, text))
            assert rewards[-1] == (1.0 if solved else 0.0)  # the solver's answers are right
    assert max(lines) >= 3 * sorted(lines)[len(lines) // 2]  # a tail: same problems, random search orders
    P = Problem((3, 5, 7), 15)
    for answer, expected in [("answer 3+5=8, 8+7=15", 1.0), ("answer 5*3=15", 1.0),
                             ("answer 3+5=8, 8+8=16", 0.0),    # 8 used twice
                             ("answer 5*5=25, 25-7=18", 0.0),  # 5 used twice, wrong value
                             ("answer 3+5=9, 9+7=16", 0.0),    # wrong arithmetic
                             ("answer 3+5", 0.0), ("3+5=8\n8+7=15 vs 15 yes", 0.0), ("", 0.0)]:
        assert st.reward(P, "7+3=10 (5 10)\nback\n" + answer) == expected, answer


def test_bpe_tokenizer_is_trained_on_the_task_text(tmp_path):
    import random

    from transformers import AutoTokenizer

    from bench.traces.record import search_task as st
    from bench.traces.record.bpe_tokenizer import train_tokenizer
    texts = st.corpus(st.make_problems(100, seed=1), seed=0)
    tok = train_tokenizer(texts, vocab_size=384)
    assert tok.get_vocab() == train_tokenizer(texts, vocab_size=384).get_vocab()  # deterministic
    tok.save_pretrained(str(tmp_path / "tok"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert 100 <= len(tok) <= 384 and (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    p = st.make_problems(1, seed=9)[0]
    text = st.sft_example(p, random.Random(1))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < 0.7 * len(text)  # chunks, not characters
    assert tok.decode(ids) == text
    assert tok(p.prompt)["input_ids"][0] == tok.bos_token_id


@pytest.fixture(scope="session")
def search_trace():
    from bench.traces.record.cache import ensure_trace
    return ensure_trace("countdown-search-tiny", tiny=True, progress=False)


def test_tiny_search_trace_is_sparse_and_stores_the_tail_statistics(search_trace):
    trace = Trace.load(search_trace)
    rec = trace.manifest["recorder"]
    assert trace.task == "countdown_search" and trace.is_sparse
    assert trace.all_step_numbers == list(range(rec["steps"]))
    assert trace.step_numbers == [s for s in range(rec["steps"]) if (rec["steps"] - 1 - s) % rec["checkpoint_every"] == 0]
    assert not (search_trace / ".policy").exists()  # the scratch policy of rollouts-only steps is gone
    for s in trace.step_numbers:  # every checkpoint carries the trained BPE tokenizer
        assert (trace.checkpoint(s) / "tokenizer.json").read_bytes() == (trace.tokenizer_dir / "tokenizer.json").read_bytes()
    for s in trace.all_step_numbers:
        df = trace.rollouts(s)
        assert len(df) == len(trace.step(s).prompt_ids) * rec["n"]
        for pid, ids, r in zip(df.prompt_id, df.token_ids, df.reward):
            assert trace.reward(pid, ids) == r
    stats = json.loads((search_trace / "stats.json").read_text())
    for key in ("reward_mean", "length_mean", "length_p50", "length_p90", "length_p99", "length_max",
                "repeat_frac", "ngram8_seen_frac", "checkpoint"):
        assert key in stats["steps"][0], key
    assert [r["checkpoint"] for r in stats["steps"]] == [s in trace.step_numbers for s in trace.all_step_numbers]
    assert set(stats["lengths"]) == {"mean", "p50", "p90", "p99", "max", "p99_over_p50"}


def test_baseline_replay_reproduces_the_search_recording(search_trace):
    from bench.core.engine_protocol import Request
    from bench.engines.torch.engine import TorchRefEngine
    from bench.core.verify import VerifyConfig
    from methods.base import RolloutKey
    from methods.baseline import Baseline

    trace = Trace.load(search_trace)
    engine = TorchRefEngine(dtype="float32")
    step = trace.step_numbers[-1]
    engine.load(trace.checkpoint(step))
    df = trace.rollouts(step)
    requests = [Request(RolloutKey(p, int(i)), trace.prompts[p], step=step) for p, i in zip(df.prompt_id, df.sample_idx)]
    out = engine.rollout(requests, trace.sampling.to_config(), Baseline(), VerifyConfig())
    assert [o.token_ids for o in out] == [list(t) for t in df.token_ids]


def test_bpe_tokenizer_keeps_numbers_one_token_wherever_they_stand():
    from bench.traces.record import search_task as st
    from bench.traces.record.bpe_tokenizer import train_tokenizer
    texts = st.corpus(st.make_problems(100, seed=1), seed=0)
    apart = train_tokenizer(texts, vocab_size=384, digits_apart=True)
    ids = apart("27+5=32 vs 27 no (5 27)", add_special_tokens=False)["input_ids"]
    tokens = apart.convert_ids_to_tokens(ids)
    assert tokens.count("27") == 3 and "Ġvs" in tokens  # at the start, after ' ' and after '(' alike; words stay chunks
    assert apart.decode(ids) == "27+5=32 vs 27 no (5 27)"
    gpt2 = train_tokenizer(texts, vocab_size=384)
    ids = gpt2("=27 27", add_special_tokens=False)["input_ids"]
    assert gpt2.decode(ids[-1:]) == " 27" != gpt2.decode(ids[1:2])  # GPT-2's split: '27' and ' 27' differ


# ---------------------------------------------------------------- traces bundled in the package

def test_a_current_bundled_trace_is_copied_not_recorded(tiny_trace, tmp_path, monkeypatch):
    import shutil

    import yaml

    from bench.traces.record import cache, grpo
    from bench.traces.record.cache import ensure_trace
    bundled = tmp_path / "bundled"
    shutil.copytree(tiny_trace, bundled / "countdown-tiny")
    monkeypatch.setattr(cache, "BUNDLED", bundled)
    monkeypatch.setenv("SPECROLLOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(grpo, "record", lambda *a, **k: pytest.fail("a current bundled trace is copied"))
    got = ensure_trace("countdown-tiny", tiny=True, progress=False)
    assert got == tmp_path / "cache" / "traces" / "countdown-tiny"
    for f in ("trace.yaml", "stats.json", "prompts.jsonl"):
        assert (got / f).read_bytes() == (tiny_trace / f).read_bytes()
    assert Trace.load(got).step_numbers == Trace.load(tiny_trace).step_numbers
    # recorded with other settings: not used, recorded instead
    manifest = bundled / "countdown-tiny" / "trace.yaml"
    data = yaml.safe_load(manifest.read_text())
    data["recorder"]["seed"] = 99
    manifest.write_text(yaml.safe_dump(data))
    shutil.rmtree(got)

    class Recorded(Exception):
        pass

    def record(out, cfg, progress=True):
        raise Recorded

    monkeypatch.setattr(grpo, "record", record)
    with pytest.raises(Recorded):
        ensure_trace("countdown-tiny", tiny=True, progress=False)


def test_the_bundled_search_trace_is_current_small_and_long_tailed():
    """The search trace ships in the package: recorded by this recorder with the preset's settings
    (else it would be recorded again on first use, 10-20 minutes), at most 10 MB, with the tail and
    the reward rise it was recorded with (the mean length of 150 is missed: LOG.md)."""
    from bench.traces.record import cache
    from bench.traces.record.grpo import SearchRecordConfig
    from bench.traces.record.summary import summary
    path = cache.BUNDLED / "countdown-search"
    if not (path / "trace.yaml").exists():
        pytest.skip("no bundled countdown-search trace in this install")
    assert cache.bundled_trace("countdown-search", SearchRecordConfig()) == path
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) <= 10 * 2 ** 20
    trace = Trace.load(path)
    assert trace.is_sparse and trace.task == "countdown_search"
    assert not (path / ".policy").exists()
    text = summary(path)
    for met in ("p99 >= 3x p50 met", "max_new_tokens >= 512 met", "repeat fraction <= 0.3 met",
                "reward last quarter >= first + 0.1 met"):
        assert met in text, text
    rows = json.loads((path / "stats.json").read_text())["steps"]
    k = len(rows) // 4
    assert statistics.mean(r["reward_mean"] for r in rows[-k:]) > statistics.mean(r["reward_mean"] for r in rows[:k])


def test_restated_paths_make_the_answer_a_copy_of_the_line_above():
    import random

    from bench.traces.record import search_task as st
    rng = random.Random(4)
    for k, p in enumerate(st.make_problems(30, seed=2, four_share=0.5, max_number=5, ops="+-*")):
        verdict_first = bool(k % 2)
        text, solved = st.solve_transcript(p, rng, 80, "+-*", restate_path=True, max_chars=560,
                                           verdict_first=verdict_first)
        lines = text.splitlines()
        assert len(text) <= 560 + 80 and st.reward(p, text) == (1.0 if solved else 0.0)
        yes, no = (f" == {p.target}", f" != {p.target}") if verdict_first else (f" vs {p.target} yes", f" vs {p.target} no")
        assert all(line.endswith((yes, no, ")")) or line in (st.GIVE_UP, lines[-1]) for line in lines)
        if solved:
            assert lines[-1] == st.ANSWER + lines[-2].removesuffix(yes)
        for line in lines:  # below the first level, a line starts with its parent's path
            if line.count(",") and not line.startswith(st.ANSWER):
                parent = line.rsplit(", ", 1)[0]
                assert any(other.startswith(parent + " (") for other in lines), line
        plain, _ = st.solve_transcript(p, random.Random(0), 80, "+-*")
        assert plain == st.solve_transcript(p, random.Random(0), 80, "+-*", restate_path=False)[0]


def test_a_baseline_replay_reproduces_the_bundled_search_trace():
    from bench.core.engine_protocol import Request
    from bench.engines.torch.engine import TorchRefEngine
    from bench.traces.record import cache
    from bench.core.verify import VerifyConfig
    from methods.base import RolloutKey
    from methods.baseline import Baseline
    path = cache.BUNDLED / "countdown-search"
    if not (path / "trace.yaml").exists():
        pytest.skip("no bundled countdown-search trace in this install")
    trace = Trace.load(path)
    step = trace.step_numbers[-1]
    engine = TorchRefEngine(dtype="float32")
    engine.load(trace.checkpoint(step))
    df = trace.rollouts(step)
    requests = [Request(RolloutKey(p, int(i)), trace.prompts[p], step=step) for p, i in zip(df.prompt_id, df.sample_idx)]
    out = engine.rollout(requests, trace.sampling.to_config(), Baseline(), VerifyConfig())
    assert [o.token_ids for o in out] == [list(t) for t in df.token_ids]
