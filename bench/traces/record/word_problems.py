"""Arithmetic word problems for the real model (SmolLM2-135M-Instruct): the task, its reward, and
its pass rate measured before any GRPO run is recorded on it.

    python -m bench.traces.record.word_problems --steps 1 --prompts 16 --samples 4 --temperature 0.7

A problem is a short story whose answer is one integer: someone starts with a count of items, then
``steps`` events change it (buys k more, gives k away, the count doubles), e.g. "Ben has 7 books.
Then Ben gives 1 books to a friend. How many books does Ben have now?" (6). ``steps=0`` is a
single addition ("... has 4 apples and gets 5 more ..."). The model answers in its chat template
under a system prompt that asks for step-by-step reasoning ending in "The answer is N."; the
reward is 1 when the number after the last "answer is" (else the last integer of the response)
equals the answer, else 0. GRPO needs groups that disagree, so a task is worth recording only if
the model starts between 10% and 60% (the real-model issue's bounds): the probe samples the
model through torch_ref (coupled sampling, the baseline drafter) and prints the pass rate, the
prompts whose group of samples is mixed, and the response lengths.
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass

NAME = "word_problems"
NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Zoe")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies")
SYSTEM = "Solve the problem step by step. End with 'The answer is N.'"
ANSWER_IS = re.compile(r"answer is\s*\$?\s*(-?\d[\d,]*)", re.IGNORECASE)
INTEGER = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class Problem:
    text: str
    answer: int

    def metadata(self) -> dict:
        return {"text": self.text, "answer": self.answer}

    @classmethod
    def from_metadata(cls, meta: dict) -> "Problem":
        return cls(str(meta["text"]), int(meta["answer"]))


def make_problem(rng: random.Random, steps: int) -> Problem:
    """One story with ``steps`` events (0: a single addition); its answer is tracked as it is told."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if steps == 0:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return Problem(f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?", a + b)
    total = rng.randint(5, 20)
    text = [f"{name} has {total} {item}."]
    for _ in range(steps):
        event = rng.choice(("buy", "give", "double") if steps > 1 else ("buy", "give"))
        if event == "give" and total > 2:
            k = rng.randint(1, total - 1)
            total -= k
            text.append(f"Then {name} gives {k} {item} to a friend.")
        elif event == "double":
            total *= 2
            text.append(f"Then the number of {item} doubles.")
        else:
            k = rng.randint(2, 9)
            total += k
            text.append(f"Then {name} buys {k} more {item}.")
    text.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(text), total)


def make_problems(seed: int, count: int, steps: int) -> list[Problem]:
    rng = random.Random(f"{NAME}:{seed}:{steps}")
    return [make_problem(rng, steps) for _ in range(count)]


def final_answer(text: str) -> int | None:
    """The number after the last "answer is", else the last integer in the text, else None."""
    found = ANSWER_IS.findall(text) or INTEGER.findall(text)
    if not found:
        return None
    return int(found[-1].replace(",", ""))


def reward(problem: Problem, text: str) -> float:
    return 1.0 if final_answer(text) == problem.answer else 0.0


def score(metadata: dict, text: str) -> float:
    """The trace-level reward hook: the problem's metadata and the decoded response."""
    return reward(Problem.from_metadata(metadata), text)


def chat_prompt(tokenizer, problem: Problem, system: str = SYSTEM) -> list[int]:
    """The prompt's token ids in the model's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                          {"role": "user", "content": problem.text}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def pass_rate(a: argparse.Namespace) -> dict:
    """Sample ``a.samples`` responses to each of ``a.prompts`` problems on the real model."""
    from transformers import AutoTokenizer

    from methods.base import RolloutKey
    from methods.baseline import Baseline

    from bench.core.engine_protocol import Request
    from bench.core.sampling import SamplingConfig
    from bench.core.verify import VerifyConfig
    from bench.engines.torch.engine import TorchRefEngine
    from bench.traces.real_model import ensure_real_model

    checkpoint = ensure_real_model()
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    problems = make_problems(a.seed, a.prompts, a.steps)
    engine = TorchRefEngine(dtype="float32", threads=a.threads)
    engine.load(checkpoint)
    requests = [Request(RolloutKey(f"p{i}", j), chat_prompt(tok, p, a.system), 0)
                for i, p in enumerate(problems) for j in range(a.samples)]
    sampling = SamplingConfig(temperature=a.temperature, max_new_tokens=a.max_new_tokens, seed=a.seed)
    t0 = time.perf_counter()
    out = engine.rollout(requests, sampling, Baseline(), VerifyConfig())
    seconds = time.perf_counter() - t0
    texts = [tok.decode(r.token_ids, skip_special_tokens=True) for r in out]
    rewards = [reward(problems[int(r.key.prompt_id[1:])], t) for r, t in zip(out, texts)]
    groups = [rewards[i * a.samples:(i + 1) * a.samples] for i in range(a.prompts)]
    lengths = sorted(len(r.token_ids) for r in out)

    def q(f: float) -> int:
        return lengths[min(len(lengths) - 1, int(f * len(lengths)))]

    return {"steps": a.steps, "prompts": a.prompts, "samples": a.samples, "temperature": a.temperature,
            "max_new_tokens": a.max_new_tokens, "pass_rate": statistics.mean(rewards),
            "mixed_groups": sum(0 < statistics.mean(g) < 1 for g in groups),
            "length_mean": statistics.mean(lengths), "length_p50": q(0.5), "length_p90": q(0.9),
            "length_p99": q(0.99), "length_max": lengths[-1],
            "truncated": sum(r.finish_reason == "length" for r in out), "seconds": seconds,
            "example": f"{problems[0].text} ({problems[0].answer}) -> {texts[0][:300]!r}"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.traces.record.word_problems", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1, help="events per story (0: one addition)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="responses per problem (GRPO's n)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--system", default=SYSTEM, help="the system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    for name in ("prompts", "samples", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise SystemExit(f"word_problems: --{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.steps < 0:
        raise SystemExit(f"word_problems: --steps must be >= 0, got {a.steps}")
    if a.temperature < 0:
        raise SystemExit(f"word_problems: --temperature must be >= 0, got {a.temperature}")
    row = pass_rate(a)
    for k, v in row.items():
        print(f"{k:>15}: {v:.3f}" if isinstance(v, float) else f"{k:>15}: {v}")


if __name__ == "__main__":
    main(sys.argv[1:])
