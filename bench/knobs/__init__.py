"""Every config knob declared once, typed and range-checked, so a bad value is refused before a run starts.

    python -m bench.harness.cli --methods                    # every method: what it drafts, its verify rule
    python -m bench.harness.cli method=tree_cache --knobs    # its knobs: type, default, range, where the default comes from
    python -m bench.knobs docs --write               # regenerate docs/methods.md from these schemas

A :class:`Knob` is one setting (type, default, range or choices, a one-line meaning and the source
of its default); a drafter class, an engine and the sampling group each have a tuple of them
(``bench/knobs/methods.py``, ``bench/knobs/engines.py``). :func:`check_value` and
:func:`check_keys` raise :class:`UserError` with one line naming the key, the value and the allowed
range or the closest known name; ``bench/knobs/check.py`` applies them to a composed config.
tests/test_knobs.py keeps the schemas equal to the constructors and conf/ defaults.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from bench.core.errors import UserError

TYPES = ("int", "float", "bool", "str", "list", "dict")
SOURCES = ("paper", "released code", "suite")  # where a default comes from


@dataclass(frozen=True)
class Knob:
    """One setting: ``lo``/``hi`` bound numbers (``open_lo``/``open_hi``: strict), ``choices`` strings."""

    name: str
    type: str
    default: Any
    meaning: str
    source: str = "suite"  # paper | released code | suite
    ref: str = ""  # which paper or code, where the source says so
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    choices: tuple = ()
    nullable: bool = False

    def __post_init__(self) -> None:
        assert self.type in TYPES, self.type
        assert self.source in SOURCES, self.source

    def with_default(self, default, source: str | None = None, ref: str | None = None) -> "Knob":
        """The same knob with another default (a method config that sets it differently)."""
        from dataclasses import replace
        return replace(self, default=default, source=source or self.source,
                       ref=self.ref if ref is None else ref)

    @property
    def bounded(self) -> bool:
        return self.lo is not None or self.hi is not None

    def rule(self) -> str:
        """The allowed values in words: 'an int >= 1', 'a float in [0, 1]', 'one of ...'."""
        if self.choices:
            text = f"one of {list(self.choices)}"
        elif self.lo is not None and self.hi is not None:
            text = (f"{_article(self.type)} in {'(' if self.open_lo else '['}{_num(self.lo)}, "
                    f"{_num(self.hi)}{')' if self.open_hi else ']'}")
        elif self.lo is not None:
            text = f"{_article(self.type)} {'>' if self.open_lo else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            text = f"{_article(self.type)} {'<' if self.open_hi else '<='} {_num(self.hi)}"
        else:
            text = _article(self.type)
        return f"null or {text}" if self.nullable else text

    def out_of_range(self) -> list:
        """Values just outside the range (for tests and for the docs' examples)."""
        bad = []
        if self.lo is not None:
            bad.append(self.lo if self.open_lo else (self.lo - 1 if self.type == "int" else self.lo - 0.5))
        if self.hi is not None:
            bad.append(self.hi if self.open_hi else (self.hi + 1 if self.type == "int" else self.hi + 0.5))
        if self.choices:
            bad.append("no-such-choice")
        return bad


def _article(type_: str) -> str:
    return {"int": "an int", "float": "a float", "bool": "true or false", "str": "a string",
            "list": "a list", "dict": "a mapping"}[type_]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _type_ok(value, type_: str) -> bool:
    if type_ == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, {"int": int, "float": (int, float), "str": str, "list": (list, tuple),
                              "dict": dict}[type_])


def check_value(knob: Knob, path: str, value, where: str) -> None:
    """Refuse a value of the wrong type or outside the knob's range: one line naming both."""
    if value is None:
        if knob.nullable:
            return
        raise UserError(f"{path}=null must be {knob.rule()}; {where}")
    if not _type_ok(value, knob.type):
        raise UserError(f"{path}={value!r} must be {knob.type}; {where}")
    if knob.choices and value not in knob.choices:
        raise UserError(f"{path} must be {knob.rule()}, got {value!r}{_close(value, knob.choices)}; {where}")
    below = knob.lo is not None and (value <= knob.lo if knob.open_lo else value < knob.lo)
    above = knob.hi is not None and (value >= knob.hi if knob.open_hi else value > knob.hi)
    if below or above:
        raise UserError(f"{path} must be {knob.rule()}, got {value!r}; {where}")


def check_keys(names, values: dict, path: str, where: str, head: str | None = None, noun: str = "knob") -> None:
    """Refuse a key not in ``names``, naming the closest one (``head``: the text before 'no knob')."""
    names = list(names)
    for key in values:
        if key not in names:
            raise UserError(f"{head or path + ' has'} no {noun} {key}={values[key]!r}{_close(key, names)}; "
                            f"its {noun}s are {', '.join(names)} ({where})")


def check_all(knobs: tuple[Knob, ...], values: dict, path: str, where: str, head: str | None = None,
              noun: str = "knob") -> None:
    """Keys first (a typo is likelier than a bad value), then every value."""
    check_keys([k.name for k in knobs], values, path, where, head, noun)
    by_name = {k.name: k for k in knobs}
    for key, value in values.items():
        check_value(by_name[key], f"{path}.{key}" if path else key, value, where)


def _close(word, names) -> str:
    if not isinstance(word, str):
        return ""
    match = difflib.get_close_matches(word, [str(n) for n in names], n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


__all__ = ["Knob", "SOURCES", "TYPES", "check_all", "check_keys", "check_value"]
