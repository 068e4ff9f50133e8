"""The composed config checked against the schemas, before bench.harness.cli loads a trace or writes anything.

    from bench.knobs.check import validate; validate(cfg)    # raises UserError with one line

bench.harness.config_checks.prepare calls :func:`validate` first: every method's drafter knobs, verify rule and entry
keys, the engine's settings and the sampling group. A drafter class or engine without a schema (a
config from another search path) is left to its constructor's own checks.
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from bench.core.errors import UserError
from bench.knobs import Knob, check_all, check_keys, check_value
from bench.knobs.engines import ENGINES, SAMPLING, VERIFY
from bench.knobs.methods import DRAFTERS, METHODS
from bench.knobs.run import EXPERIMENT, GROUPS, TRACE

ENTRY_KEYS = ("name", "drafter", "verify", "run_ahead")  # the keys of one conf/method/*.yaml
RUN_AHEAD = Knob("run_ahead", "bool", False, "admit next-step prompts when the batch shrinks")


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})


def validate(cfg: DictConfig) -> None:
    """Refuse an unknown key, a wrong type or an out-of-range value anywhere the schemas cover."""
    validate_run({k: v for k, v in _plain(cfg).items() if k not in GROUPS})
    if isinstance(cfg.get("trace"), DictConfig):
        check_all(TRACE, _plain(cfg.trace), "trace", "see conf/trace/", noun="key")
    validate_methods(cfg)
    engine = cfg.get("engine")
    if isinstance(engine, DictConfig):
        validate_engine(_plain(engine))
    if cfg.get("sampling") is not None:
        validate_sampling(_plain(cfg.sampling))


def validate_methods(cfg: DictConfig) -> None:
    """Every ``method.NAME`` node of a config (bench.harness.cli's and bench.train's)."""
    for name, entry in (cfg.get("method") or {}).items():
        if isinstance(entry, DictConfig):
            validate_method(str(name), _plain(entry))


def validate_method(name: str, entry: dict) -> None:
    """One ``method.NAME`` node: its keys, run_ahead, verify and (for a known class) its drafter knobs."""
    where = f"see conf/method/{name}.yaml; python -m bench.harness.cli method={name} --knobs lists them"
    check_keys(ENTRY_KEYS, entry, f"method.{name}", where, noun="key")
    method = METHODS.get(name)
    run_ahead, *verify_knobs = method.entry_knobs() if method else (RUN_AHEAD, *VERIFY)
    if "run_ahead" in entry:
        check_value(run_ahead, f"method.{name}.run_ahead", entry["run_ahead"], where)
    if isinstance(entry.get("verify"), dict):
        check_all(tuple(verify_knobs), entry["verify"], f"method.{name}.verify", where, noun="key")
    drafter = entry.get("drafter")
    if not isinstance(drafter, dict) or drafter.get("_target_") not in DRAFTERS:
        return  # no drafter: bench.harness.config_checks says how to select a method; an unknown class checks itself
    values = {k: v for k, v in drafter.items() if not k.startswith("_")}
    check_all(DRAFTERS[drafter["_target_"]], values, f"method.{name}.drafter", where,
              head=f"method.{name}.drafter cannot be built: it has")


def validate_engine(settings: dict) -> None:
    """The ``engine`` node of a known engine (an unknown name is refused where the engine is built, bench.harness.cli)."""
    name = settings.get("name")
    if name not in ENGINES:
        return
    values = {k: v for k, v in settings.items() if k != "name"}
    check_all(ENGINES[name], values, "engine", f"settings: conf/engine/{name}.yaml; python -m bench.harness.cli "
              f"engine={name} --knobs lists them", head=f"engine={name} has", noun="setting")
    if values.get("seconds") == "table" and values.get("latency_table") is None:
        raise UserError("engine.seconds=table prices every pass by engine.latency_table, which is null: set "
                        "engine.latency_table=auto or a CSV from python -m bench.benchmarks latency profile")


def validate_run(values: dict) -> None:
    """The run's own options (conf/bench.yaml's top-level keys); ``steps`` may be one number. Keys of
    one's own (``+tag=x``) pass: ``check_override_keys`` refuses a misspelt known one before Hydra."""
    if isinstance(values.get("steps"), int) and not isinstance(values["steps"], bool):
        values = {**values, "steps": [values["steps"]]}
    known = {k.name: k for k in EXPERIMENT}  # a key of one's own added with +KEY=VALUE (a tag) is let through;
    for key, value in values.items():  # a misspelt one without + was refused before composing
        if key in known:
            check_value(known[key], key, value, "see conf/bench.yaml")


def validate_sampling(values: dict) -> None:
    """The ``sampling`` node as configured (nulls: the trace's values, checked once resolved)."""
    check_all(SAMPLING, values, "sampling", "fix it on the command line or in conf/sampling/", noun="key")


__all__ = ["validate", "validate_methods", "validate_engine", "validate_method", "validate_run", "validate_sampling"]


def check_override_keys(args: list[str], top_level: bool = True) -> None:
    """Refuse ``KEY=VALUE`` naming no known knob, before Hydra composes (its own message for a key not
    in the config spans a screen). Covers ``method.NAME.drafter.*``, ``method.NAME.verify.*``,
    ``method.NAME.*``, ``engine.*`` (of the engine the arguments select), ``sampling.*``, ``trace.*`` and,
    with ``top_level``, the run's own options. ``+KEY=`` (append) is left to :func:`validate`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parser = OverridesParser.create()
    engine = "torch_ref"
    parsed = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg or arg.startswith(("+", "~", "hydra")):
            continue
        try:
            override = parser.parse_overrides([arg])[0]
        except Exception:  # Hydra reports its own syntax errors
            continue
        if override.key_or_group == "engine" and isinstance(override.value(), str):
            engine = override.value()
        parsed.append((arg, override.key_or_group.split(".")))
    for arg, path in parsed:
        known = _known_names(path, engine, top_level)
        if known is not None and path[-1] not in known:
            where = ("conf/bench.yaml" if len(path) == 1 else f"python -m bench.harness.cli method={path[1]} --knobs"
                     if path[0] == "method" else f"python -m bench.harness.cli engine={engine} --knobs"
                     if path[0] == "engine" else f"conf/{path[0]}/")
            check_keys(known, {path[-1]: arg.split("=", 1)[1]}, ".".join(path[:-1]), f"see {where}",
                       head=None if len(path) > 1 else "the config has", noun="key")


def _known_names(path: list[str], engine: str, top_level: bool):
    """The names allowed at ``path``'s last part (None: not covered by a schema)."""
    head, depth = path[0], len(path)
    if depth == 1:
        return [k.name for k in EXPERIMENT] + list(GROUPS) + ["experiment", "sweep"] if top_level else None
    if head == "trace" and depth == 2:
        return [k.name for k in TRACE]
    if head == "sampling" and depth == 2:
        return [k.name for k in SAMPLING]
    if head == "engine" and depth == 2 and engine in ENGINES:
        return ["name"] + [k.name for k in ENGINES[engine]]
    if head == "method" and path[1] in METHODS:
        if depth == 3:
            return list(ENTRY_KEYS)
        if depth == 4 and path[2] == "drafter":
            return ["_target_"] + [k.name for k in METHODS[path[1]].knobs()]
        if depth == 4 and path[2] == "verify":
            return [k.name for k in VERIFY]
    return None
