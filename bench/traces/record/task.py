"""A Countdown-style verifiable task with many valid answers, so a tiny policy stays stochastic.

    python -m bench.traces.record.task --seed 0 --count 5

A problem is three numbers (1-9) and a reachable target; the prompt is ``"3 5 7>15:"`` and an
answer is an arithmetic expression over some of the numbers (each used at most once) followed by
``=`` and the claimed value, e.g. ``"5+7+3=15"`` or ``"3*5=15"``. Answers are scored with a small
recursive-descent parser over exact fractions (never Python ``eval``).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

NAME = "countdown"
OPS = "+-*/"
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
REWARD_CORRECT = 1.0
REWARD_WELL_FORMED = 0.1  # parses as EXPR=N but is wrong: a small shaping signal
REWARD_MALFORMED = 0.0


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]
    target: int

    @property
    def prompt(self) -> str:
        return " ".join(str(x) for x in self.numbers) + f">{self.target}:"

    def metadata(self) -> dict:
        return {"numbers": list(self.numbers), "target": self.target}

    @classmethod
    def from_metadata(cls, meta: dict) -> "Problem":
        return cls(tuple(int(x) for x in meta["numbers"]), int(meta["target"]))


class ParseError(ValueError):
    pass


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ;
    factor := NUMBER | '(' expr ')'. Returns the value and the literals used."""

    def __init__(self, text: str):
        self.s, self.i, self.literals = text, 0, []

    def parse(self) -> Fraction:
        value = self.expr()
        if self.i != len(self.s):
            raise ParseError(f"unexpected {self.s[self.i]!r} at {self.i}")
        return value

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.s[self.i]
            self.i += 1
            rhs = self.factor()
            if op == "/" and rhs == 0:
                raise ParseError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(self) -> Fraction:
        c = self.peek()
        if c == "(":
            self.i += 1
            value = self.expr()
            if self.peek() != ")":
                raise ParseError(f"missing ')' at {self.i}")
            self.i += 1
            return value
        start = self.i
        while self.peek().isdigit() and self.peek().isascii():
            self.i += 1
        if start == self.i:
            raise ParseError(f"expected a number at {start}")
        literal = int(self.s[start:self.i])
        self.literals.append(literal)
        return Fraction(literal)


def parse_answer(text: str) -> tuple[Fraction, list[int], int]:
    """``"EXPR=N"`` -> (value of EXPR, number literals used, N); raises ParseError."""
    if text.count("=") != 1:
        raise ParseError("an answer is EXPR=N with exactly one '='")
    lhs, rhs = text.split("=")
    if not rhs.isdigit() or not rhs.isascii():
        raise ParseError(f"claimed value {rhs!r} is not a number")
    parser = _Parser(lhs)
    return parser.parse(), parser.literals, int(rhs)


def reward(problem: Problem, answer: str) -> float:
    """1.0 if correct, 0.1 if it parses but is wrong, 0.0 if it does not parse."""
    try:
        value, literals, claimed = parse_answer(answer)
    except ParseError:
        return REWARD_MALFORMED
    uses_allowed = not (Counter(literals) - Counter(problem.numbers))
    if uses_allowed and value == problem.target and claimed == problem.target:
        return REWARD_CORRECT
    return REWARD_WELL_FORMED


def score(metadata: dict, text: str) -> float:
    """The trace-level reward hook: problem metadata (numbers, target) and the decoded answer."""
    return reward(Problem.from_metadata(metadata), text)


def _render(tree) -> str:
    """A tree is an int or (op, left, right); parentheses only where needed."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    ls, rs = _render(left), _render(right)
    if not isinstance(left, int) and PRECEDENCE[left[0]] < PRECEDENCE[op]:
        ls = f"({ls})"
    if not isinstance(right, int) and (PRECEDENCE[right[0]] < PRECEDENCE[op]
                                       or (PRECEDENCE[right[0]] == PRECEDENCE[op]
                                           and op in "-/")):
        rs = f"({rs})"
    return ls + op + rs


def _trees(numbers: tuple[int, ...]):
    """Every binary expression tree over all of ``numbers`` in this order."""
    if len(numbers) == 1:
        yield numbers[0]
        return
    for split in range(1, len(numbers)):
        for left in _trees(numbers[:split]):
            for right in _trees(numbers[split:]):
                for op in OPS:
                    yield (op, left, right)


def _value(tree) -> Fraction | None:
    if isinstance(tree, int):
        return Fraction(tree)
    op, left, right = tree
    a, b = _value(left), _value(right)
    if a is None or b is None:
        return None
    if op == "/":
        return None if b == 0 else a / b
    return a + b if op == "+" else a - b if op == "-" else a * b


def all_expressions(numbers: tuple[int, ...], min_numbers: int = 2) -> dict[str, Fraction]:
    """Every expression (minimal parentheses) over ordered subsets of ``numbers`` -> value."""
    return dict(_expressions(tuple(sorted(numbers)), min_numbers))


@functools.lru_cache(maxsize=4096)
def _expressions(numbers: tuple[int, ...], min_numbers: int) -> tuple[tuple[str, Fraction], ...]:
    out: dict[str, Fraction] = {}
    for k in range(min_numbers, len(numbers) + 1):
        for subset in sorted(set(itertools.permutations(numbers, k))):
            for tree in _trees(subset):
                value = _value(tree)
                if value is not None:
                    out.setdefault(_render(tree), value)
    return tuple(out.items())


def solutions(problem: Problem) -> list[str]:
    """All valid answers ``EXPR=target``, sorted (deterministic SFT data)."""
    return sorted(f"{e}={problem.target}" for e, v in all_expressions(problem.numbers).items()
                  if v == problem.target)


def make_problems(count: int, seed: int, count_numbers: int = 3, max_number: int = 9,
                  min_solutions: int = 4, max_target: int = 40) -> list[Problem]:
    """``count`` distinct problems, deterministic for ``seed``. Targets are reachable integers in
    [1, max_target] that are not one of the numbers and have at least ``min_solutions`` answers."""
    rng = random.Random(seed)
    seen: set[Problem] = set()
    problems: list[Problem] = []
    while len(problems) < count:
        numbers = tuple(rng.randint(1, max_number) for _ in range(count_numbers))
        values = Counter(v for v in all_expressions(numbers).values()
                         if v.denominator == 1 and 1 <= v <= max_target and v not in numbers)
        targets = sorted(int(v) for v, c in values.items() if c >= min_solutions)
        if not targets:
            continue
        problem = Problem(numbers, rng.choice(targets))
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=5)
    args = ap.parse_args()
    for p in make_problems(args.count, args.seed):
        sols = solutions(p)
        print(f"{p.prompt:<12} {len(sols):3d} answers, e.g. {', '.join(sols[:4])}")


if __name__ == "__main__":
    main()
