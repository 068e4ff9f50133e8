"""Imports of real runs' rollout dumps (verl, TRL) on fixtures written in exactly those formats.

    pytest tests/test_trace_import.py

tests/fixtures/verl_dump/{step}.jsonl: verl's ``trainer.rollout_data_dir`` rows (input, output, gts, score,
step, a reward extra), the n samples of a prompt consecutive. tests/fixtures/trl_run/completions/
completions_{step:05d}.parquet: TRL GRPOTrainer's ``log_completions`` files (step, prompt, completion, one
column per reward function, advantage). OpenRLHF writes no rollout dump, so it has no fixture.
"""
from __future__ import annotations

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
