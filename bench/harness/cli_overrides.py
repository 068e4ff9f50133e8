"""The command line's arguments read before Hydra composes a config: the listings and unknown options.

``python -m bench.harness.cli`` (and ``python -m bench.train``) hand their arguments here first:
``--methods`` / ``--knobs`` print the schemas instead of running (:func:`print_listing`), and a
config-group option that does not exist is refused in one line (:func:`check_overrides`) rather
than with Hydra's screen of text. Kept apart from the command line because it reads Hydra's
override grammar, not a composed config.

    python -m bench.harness.cli --methods                      # every method in a line
    python -m bench.harness.cli method=das engine=vllm --knobs  # those knob tables
    python -m bench.harness.cli method=nope                    # refused here: one line, exit 2
    python -m pytest -q tests/test_knobs.py tests/test_cli_errors.py
"""
from __future__ import annotations

from bench.core.errors import UserError
from bench.core.paths import CONF_DIR

# arguments that compose from other config files than conf/ (the schemas' checks leave those to Hydra)
OTHER_CONFIGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "hydra.searchpath",
                 "+hydra.searchpath")


def _group_options() -> dict[str, set[str]]:
    """{config group: its options} of conf/ (Hydra's own groups left out)."""
    return {d.name: {f.stem for f in d.glob("*.yaml")} for d in CONF_DIR.iterdir()
            if d.is_dir() and d.name != "hydra"}


def _choices(args: list[str], group: str) -> list[str]:
    """The options ``args`` select in a config group (``method=[a,b]``, ``-m method=a,b``,
    ``method=glob(*)``), in order, as names of conf/GROUP/."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, Glob
    parser, out = OverridesParser.create(), []
    options = sorted(_group_options().get(group, ()))
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_overrides([arg])[0]
        except Exception:
            continue
        if override.key_or_group != group or override.is_delete():
            continue
        todo = [override.value()]
        while todo:
            item = todo.pop(0)
            if isinstance(item, Glob):
                out += item.filter(options)
            elif isinstance(item, ChoiceSweep):
                todo = list(item.list) + todo
            elif isinstance(item, (list, tuple)):
                todo = list(item) + todo
            else:
                out.append(str(item))
    return list(dict.fromkeys(out))


def print_listing(args: list[str]) -> bool:
    """``--methods``: every method in a line; ``--knobs``: the knob tables of the methods and engine
    the other arguments select (every method when none is). True when something was printed."""
    from bench.knobs.listing import knobs_text, methods_text
    from bench.knobs.engines import ENGINES
    from bench.knobs.methods import METHODS
    if "--methods" in args:
        print(methods_text())
        return True
    if "--knobs" not in args:
        return False
    methods, engines = _choices(args, "method"), _choices(args, "engine")
    groups = _group_options()
    for name, known, group in [*((m, METHODS, "method") for m in methods), *((e, ENGINES, "engine") for e in engines)]:
        if name not in groups.get(group, ()) and name not in known:
            raise UserError(f"{group}={name}: no {group} of that name; choose from {', '.join(sorted(groups[group]))}")
    unschemed = [n for n in methods if n not in METHODS] + [n for n in engines if n not in ENGINES]
    methods, engines = [m for m in methods if m in METHODS], [e for e in engines if e in ENGINES]
    if methods or engines or not unschemed:
        print(knobs_text(methods, engines), end="")
    for name in unschemed:
        print(f"({name}: a config without a schema in bench/knobs/; its constructor checks its own knobs)")
    return True


def check_overrides(args: list[str]) -> None:
    """Refuse a config-group option that does not exist (``method=nope``) with one line, before
    Hydra composes the config (its own message spans a screen). Anything this cannot parse, and
    any command that adds config search paths, is left to Hydra."""
    if any(a.startswith(OTHER_CONFIGS) for a in args):
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    groups = _group_options()
    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_overrides([arg])[0]
        except Exception:  # Hydra reports its own syntax errors
            continue
        group = override.key_or_group
        if group not in groups or override.is_delete() or override.package:
            continue
        value = override.value()
        names = value.list if isinstance(value, ChoiceSweep) else value
        flat, todo = [], [names]
        while todo:
            item = todo.pop()
            if isinstance(item, (list, tuple)):
                todo.extend(item)
            elif isinstance(item, str):
                flat.append(item)
        unknown = sorted(set(flat) - groups[group])
        if unknown:
            raise UserError(f"{arg}: no {group} named {', '.join(map(repr, unknown))}; choose from "
                            f"{', '.join(sorted(groups[group]))} (conf/{group}/)")
