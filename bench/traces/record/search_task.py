"""Countdown solved by writing out a search (Stream-of-Search style): long, long-tailed responses.

    python -m bench.traces.record.search_task --seed 0 --count 3

A problem is three or four numbers (1-9) and a reachable target; the prompt is ``"3 5 7 2>24:"``. A
response is a depth-first search written out line by line: each line applies one operation to
two of the numbers left and shows what remains, ``"3+5=8 (7 2 8)"``; with two numbers left every
operation is checked against the target (``"8+14=22 vs 24 no"`` or ``"2*12=24 vs 24 yes"``); a state whose
operations are exhausted is left with ``"back (7 2 8)"``, restating the state returned to (so the
state a line works on is always a few lines up, as in Stream-of-Search's restated states). The solver that writes the warm-start
transcripts tries the operations of every state in a random order, so the same problem yields
searches of very different lengths (a geometric-like tail); past ``max_lines`` (or ``max_chars``
characters) it writes ``"give up"``. The recorded trace writes it in a form a 0.4M policy copies
more reliably (``restate_path``, ``verdict_first``): every line below the first level starts with
the path to its state, ``"3+5=8, 7-2=5 (8 5)"``, and a last move is judged right after its value,
``"3+5=8, 7-2=5, 8*5=40 == 40"`` / ``"... != 40"``; a line's prefix is then its parent's line and the
answer is the line above it, not a path gathered from lines far up (the policy got 2 of 3 of those
wrong). The last line is the successful path, ``"answer 3+5=8, 7-2=5, 8*5=40"``: 1.0 if
every equation is right, uses only numbers still available (the given ones, then results, each
once) and the last result is the target; 0 otherwise. There is no credit for a well-formed wrong
answer (the short task's 0.1): with it, GRPO shortened the searches to quick well-formed wrong
answers within 15 steps (lengths fell from a mean of 130 to 50 tokens, LOG.md 2026-12-01).
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
from collections import Counter

from bench.traces.record import task as countdown
from bench.traces.record.task import Problem

NAME = "countdown_search"
PRECEDENCE = countdown.PRECEDENCE
ANSWER = "answer "
GIVE_UP = "give up"


def _wrap(expr: str, op: str, right: bool) -> str:
    """Parenthesise a sub-expression (with its top operator) as an operand of ``op``."""
    text, top = expr
    if top is None:
        return text
    if PRECEDENCE[top] < PRECEDENCE[op] or (right and PRECEDENCE[top] == PRECEDENCE[op] and op in "-/"):
        return f"({text})"
    return text


OPS = "+-*/"


def _moves(state: list[tuple[int, tuple[str, str | None]]], ops: str = OPS):
    """Every (i, j, op, a, b, value) combining two entries with one of ``ops``; subtraction and
    division keep the larger first and only exact, nontrivial quotients; commutative duplicates
    dropped."""
    out = []
    for i in range(len(state)):
        for j in range(i + 1, len(state)):
            a, b = state[i][0], state[j][0]
            hi, lo = (i, j) if a >= b else (j, i)
            x, y = state[hi][0], state[lo][0]
            if "+" in ops:
                out.append((i, j, "+", hi, lo, x + y))
            if "*" in ops:
                out.append((i, j, "*", hi, lo, x * y))
            if "-" in ops and x != y:
                out.append((i, j, "-", hi, lo, x - y))
            if "/" in ops and y > 1 and x % y == 0:
                out.append((i, j, "/", hi, lo, x // y))
    return out


def solve_transcript(problem: Problem, rng: random.Random, max_lines: int = 80,
                     ops: str = OPS, restate_path: bool = False, max_chars: int = 0,
                     verdict_first: bool = False) -> tuple[str, bool]:
    """A random-order depth-first search of ``problem`` written out; (text, solved).

    ``restate_path``: every line below the first level starts with the path that led to its state
    (``"3+3=6, 6+3=9 vs 9 yes"``), so the answer line copies the line above it and each line's
    prefix is its parent's line (what a tiny policy gets right). ``max_chars``: also give up once
    the transcript is this long (0: lines only), a budget in text rather than lines.
    ``verdict_first``: a last move is checked as ``"6+3=9 == 9"`` / ``"10*3=30 != 9"`` (the verdict
    right after the value it judges) instead of ``"... vs 9 yes"`` (after the restated target)."""
    lines: list[str] = []
    size = [0]

    def out_of_budget() -> bool:
        return len(lines) >= max_lines or bool(max_chars) and size[0] >= max_chars

    def write(line: str) -> None:
        lines.append(line)
        size[0] += len(line) + 1
    start = [(x, (str(x), None)) for x in problem.numbers]
    found: list[str] = []

    path: list[str] = []

    def dfs(state) -> bool:
        moves = _moves(state, ops)
        rng.shuffle(moves)
        for i, j, op, hi, lo, value in moves:
            if out_of_budget():
                return False
            x, y = state[hi], state[lo]
            expr = (_wrap(x[1], op, False) + op + _wrap(y[1], op, True), op)
            rest = [s for k, s in enumerate(state) if k not in (i, j)] + [(value, expr)]
            head = f"{x[0]}{op}{y[0]}={value}"
            shown = ", ".join(path + [head]) if restate_path else head
            if len(rest) == 1:
                if value == problem.target:
                    write(f"{shown} == {problem.target}" if verdict_first else f"{shown} vs {problem.target} yes")
                    found.append(", ".join(path + [head]))
                    return True
                write(f"{shown} != {problem.target}" if verdict_first else f"{shown} vs {problem.target} no")
                continue
            write(shown + " (" + " ".join(str(s[0]) for s in rest) + ")")
            path.append(head)
            if dfs(rest):
                return True
            path.pop()
            if out_of_budget():
                return False
            write("back (" + " ".join(str(s[0]) for s in state) + ")")  # the state returned to
        return False

    solved = dfs(start)
    if solved:
        write(f"{ANSWER}{found[0]}")
    else:
        write(GIVE_UP)
    return "\n".join(lines), solved


def final_answer(text: str) -> str | None:
    """The expression of the response's ``answer`` line (the last one), or None."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith(ANSWER):
            return line[len(ANSWER):].strip()
    return None


def check_path(problem: Problem, answer: str) -> bool:
    """Is ``"a+b=c, c*d=e, ..."`` a valid derivation of the target (raises ParseError if malformed)?"""
    pool = Counter(problem.numbers)
    value = None
    for eq in answer.split(","):
        eq = eq.strip()
        m = _EQUATION.fullmatch(eq)
        if not m:
            raise countdown.ParseError(f"not an equation a?b=c: {eq!r}")
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        exact = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else None}[op]
        if exact != c:
            return False
        for operand in (a, b):
            pool[operand] -= 1
            if pool[operand] < 0:  # not available (any more)
                return False
        pool[c] += 1
        value = c
    return value == problem.target


_EQUATION = re.compile(r"(\d+)([-+*/])(\d+)=(\d+)")


REWARD_WRONG = 0.0  # a well-formed wrong answer earns nothing (see the module docstring)


def reward(problem: Problem, text: str) -> float:
    answer = final_answer(text)
    if answer is None:
        return countdown.REWARD_MALFORMED
    try:
        return countdown.REWARD_CORRECT if check_path(problem, answer) else REWARD_WRONG
    except countdown.ParseError:
        return countdown.REWARD_MALFORMED


def score(metadata: dict, text: str) -> float:
    """The trace-level reward hook: problem metadata (numbers, target) and the decoded response."""
    return reward(Problem.from_metadata(metadata), text)


def reachable(numbers: tuple[int, ...], ops: str = OPS) -> Counter:
    """Final value -> number of search paths (the solver's moves) that end with it."""
    out: Counter = Counter()

    def walk(state):
        for i, j, op, hi, lo, value in _moves(state, ops):
            rest = [s for k, s in enumerate(state) if k not in (i, j)] + [(value, None)]
            if len(rest) == 1:
                out[value] += 1
            else:
                walk(rest)

    walk([(x, None) for x in numbers])
    return out


def make_problems(count: int, seed: int, four_share: float = 0.2, max_number: int = 9,
                  min_paths: int = 2, max_target: int = 60, ops: str = OPS) -> list[Problem]:
    """``count`` distinct problems, deterministic for ``seed``: three numbers (1-9), or four with
    probability ``four_share`` (the long searches of the tail); the target is a value the
    solver's moves reach by at least ``min_paths`` paths, in [1, max_target], not a given number."""
    rng = random.Random(seed)
    seen: set[Problem] = set()
    problems: list[Problem] = []
    while len(problems) < count:
        k = 4 if rng.random() < four_share else 3
        numbers = tuple(rng.randint(1, max_number) for _ in range(k))
        paths = reachable(numbers, ops)
        targets = sorted(v for v, c in paths.items() if c >= min_paths and 1 <= v <= max_target
                         and v not in numbers)
        if not targets:
            continue
        problem = Problem(numbers, rng.choice(targets))
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    return problems


def sft_example(problem: Problem, rng: random.Random, max_lines: int = 80, ops: str = OPS,
                restate_path: bool = False, max_chars: int = 0, verdict_first: bool = False) -> str:
    """One warm-start response for ``problem`` (a fresh random search order every call)."""
    return solve_transcript(problem, rng, max_lines, ops, restate_path, max_chars, verdict_first)[0]


def corpus(problems: list[Problem], seed: int, per_problem: int = 2, max_lines: int = 80,
           ops: str = OPS, restate_path: bool = False, max_chars: int = 0,
           verdict_first: bool = False) -> list[str]:
    """Prompt + transcript texts (what the BPE tokenizer is trained on)."""
    rng = random.Random(seed)
    return [p.prompt + sft_example(p, rng, max_lines, ops, restate_path, max_chars, verdict_first)
            for p in problems for _ in range(per_problem)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=3)
    ap.add_argument("--stats", type=int, default=0, help="line-count statistics over this many searches")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    problems = make_problems(max(args.count, args.stats and 200), args.seed)
    for p in problems[:args.count]:
        text, solved = solve_transcript(p, rng)
        print(f"{p.prompt}\n{text}\n  -> solved {solved}, reward {reward(p, text)}\n")
    if args.stats:
        n = [solve_transcript(p, rng)[0].count("\n") + 1 for p in problems for _ in range(args.stats // 200 or 1)]
        q = sorted(n)
        print(f"lines: mean {statistics.mean(n):.1f} p50 {q[len(q) // 2]} p90 {q[int(.9 * len(q))]} "
              f"p99 {q[int(.99 * len(q))]} max {q[-1]}; {Counter(x >= 81 for x in n)}")


if __name__ == "__main__":
    main()
