"""The command line: replay a trace with methods on an engine, then print the table and draw the figures.

    python -m bench.harness.cli                                  # the main job (conf/bench.yaml)
    python -m bench.harness.cli trace=countdown_tiny method=tree_cache engine.dtype=float64
    python -m bench.harness.cli -m 'method=glob(*)'              # one run per method (Hydra multirun)

The whole config is checked before anything is written (:func:`prepare`): a bad value ends the
command with one line naming it and the fix (exit status 2; ``SPECROLLOUT_DEBUG=1`` shows the
traceback), and no run folder is created or changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from bench.core import verify as _verify
from bench.core.errors import UserError, debug_enabled, exit_on_user_error, one_line
from bench.core.paths import CONF_DIR as _CONF_PATH
from bench.harness.replay import MethodSpec, replay
from bench.core.verify import VerifyConfig

CONF_DIR = str(_CONF_PATH)
# keys that change where or how verbosely a run is written, not what it measures
NOT_IDENTITY = ("run_id", "results_root", "figures_root", "progress", "plots", "predict")
# arguments that compose from other config files than conf/ (the schemas' checks leave those to Hydra)
OTHER_CONFIGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "hydra.searchpath",
                 "+hydra.searchpath")


def load_trace(cfg: DictConfig):
    """The trace of the config: a directory, or the bundled one (recorded on first use)."""
    from bench.traces.format import Trace
    if cfg.trace.get("path"):
        return Trace.load(hydra.utils.to_absolute_path(str(cfg.trace.path)))
    from bench.traces.record import ensure_trace
    return Trace.load(ensure_trace(cfg.trace.name, tiny=bool(cfg.trace.get("tiny", False)),
                                   progress=bool(cfg.progress)))


def resolve_sampling(cfg: DictConfig, trace) -> dict:
    """The trace's recorded sampling with the config's non-null fields on top."""
    from dataclasses import asdict
    values = {k: v for k, v in asdict(trace.sampling).items() if k != "n"}
    values.update({k: v for k, v in OmegaConf.to_container(cfg.sampling).items() if v is not None})
    return values


def method_specs(cfg: DictConfig) -> list[MethodSpec]:
    """Every method selected in the ``method`` group, baseline first."""
    specs = []
    for name, mcfg in cfg.method.items():
        verify = VerifyConfig(**OmegaConf.to_container(mcfg.get("verify") or {}, resolve=True))
        specs.append(MethodSpec(name, lambda m=mcfg: hydra.utils.instantiate(m.drafter), verify,
                                bool(mcfg.get("run_ahead", False))))
    return sorted(specs, key=lambda s: s.name != "baseline")


def run_id_for(config: dict) -> str:
    identity = {k: v for k, v in config.items() if k not in NOT_IDENTITY}
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    methods = list(config["method"])
    label = methods[0] if len(methods) == 1 else f"{len(methods)}methods"
    return f"{config['trace']['name']}-{config['engine']['name']}-{label}-{digest}"


def _group_options() -> dict[str, set[str]]:
    """{config group: its options} of conf/ (Hydra's own groups left out)."""
    root = Path(CONF_DIR)
    return {d.name: {f.stem for f in d.glob("*.yaml")} for d in root.iterdir()
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


def _type_ok(value, hint) -> bool:
    """Whether a config value fits a constructor's simple annotation (unknown kinds pass)."""
    import types
    import typing
    if hint is typing.Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _check_knob_types(name: str, drafter_cfg: dict) -> None:
    import typing
    try:
        target = hydra.utils.get_object(drafter_cfg["_target_"])
        hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    except Exception:  # no usable annotations: the constructor's own checks are all there is
        return
    for key, value in drafter_cfg.items():
        if key.startswith("_") or key not in hints:
            continue
        if not _type_ok(value, hints[key]):
            hint = getattr(hints[key], "__name__", None) or str(hints[key]).replace("typing.", "")
            raise UserError(f"method.{name}.drafter.{key}={value!r} must be {hint}; see "
                            f"conf/method/{name}.yaml for its default")


def _check_methods(cfg: DictConfig) -> list[tuple[str, VerifyConfig]]:
    """Every selected method: a drafter that can be built with its knobs, a valid verify rule."""
    if not cfg.get("method"):
        raise UserError("no method selected: add method=NAME or method=[NAME,...] (conf/method/)")
    from bench.knobs.check import validate_methods
    validate_methods(cfg)  # names, types and ranges first; then the constructors' own checks
    out = []
    for name, mcfg in cfg.method.items():
        if not isinstance(mcfg, DictConfig) or "_target_" not in (mcfg.get("drafter") or {}):
            raise UserError(f"method.{name} has no drafter: select a method with method={name} "
                            f"(one of conf/method/), not by setting method.{name}.* keys alone")
        verify = OmegaConf.to_container(mcfg.get("verify") or {}, resolve=True)
        try:
            out.append((name, VerifyConfig(**verify)))
        except TypeError as exc:
            raise UserError(f"method.{name}.verify: {exc}; its keys are rule and lenience") from exc
        except ValueError as exc:
            raise UserError(f"method.{name}.{exc}") from exc
        drafter = OmegaConf.to_container(mcfg.drafter, resolve=True)
        _check_knob_types(name, drafter)
        try:
            hydra.utils.instantiate(mcfg.drafter)
        except Exception as exc:  # hydra wraps the constructor's error; show that one
            cause = exc.__cause__ or exc
            raise UserError(f"method.{name}.drafter cannot be built: {type(cause).__name__}: "
                            f"{one_line(cause)}; check its knobs (conf/method/{name}.yaml)") from exc
    return out


def _check_sampling(values: dict, verifies: list[tuple[str, VerifyConfig]]):
    from dataclasses import fields
    from bench.core.sampling import SamplingConfig
    known = [f.name for f in fields(SamplingConfig)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise UserError(f"sampling has no key {', '.join(unknown)}; its keys are {', '.join(known)}")
    try:
        sampling = SamplingConfig(**values)
    except ValueError as exc:
        raise UserError(f"{exc}; fix it on the command line or in conf/sampling/") from exc
    except TypeError as exc:
        raise UserError(f"sampling values must be numbers ({exc}): got {values}") from exc
    check_rule = getattr(_verify, "check_rule", None)
    for name, verify in verifies:
        try:
            if check_rule is not None:
                check_rule(verify, sampling)
            elif verify.rule == "greedy" and not sampling.greedy:
                raise ValueError(f"verify.rule=greedy decodes argmax, but sampling.temperature="
                                 f"{sampling.temperature} samples: set sampling.temperature=0 "
                                 f"(sampling=greedy) or use verify.rule=exact")
        except ValueError as exc:
            raise UserError(f"method {name}: {exc}") from exc
    return sampling


def _check_steps(cfg: DictConfig, trace) -> list[int]:
    max_steps = cfg.get("max_steps")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool)
                                  or max_steps < 1):
        raise UserError(f"max_steps={max_steps!r} must be a whole number >= 1 (or null: every step)")
    repeats = cfg.get("timing_repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise UserError(f"timing_repeats={repeats!r} must be a whole number >= 1 (1: every unit timed once)")
    steps = cfg.get("steps")
    if steps is None:
        steps = list(trace.step_numbers)
    else:
        steps = list(steps) if OmegaConf.is_list(steps) or isinstance(steps, (list, tuple)) else [steps]
        bad = [s for s in steps if not isinstance(s, int) or isinstance(s, bool)]
        missing = [s for s in steps if s not in trace.step_numbers]
        if bad or missing or not steps:
            raise UserError(f"steps={list(steps)}: trace {trace.name!r} has steps "
                            f"{trace.step_numbers}; give a list of those (steps=[0,1]) or "
                            f"steps=null for all")
    return steps[:max_steps] if max_steps is not None else steps


def _make_engine(name: str, settings: dict):
    from bench.engines import ENGINE_EXTRAS, make_engine
    if name not in ENGINE_EXTRAS:
        raise UserError(f"engine.name={name!r} is not an engine; choose one of "
                        f"{', '.join(sorted(ENGINE_EXTRAS))} (engine=NAME, conf/engine/)")
    try:
        engine = make_engine(name, **settings)
    except UserError:
        raise
    except TypeError as exc:
        raise UserError(f"engine={name}: {exc}; its settings are listed in conf/engine/{name}.yaml") from exc
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        raise UserError(f"engine={name}: {one_line(exc)} (settings: conf/engine/{name}.yaml)") from exc
    device = getattr(engine, "device", None)
    if getattr(device, "type", device) == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UserError(f"engine.device={settings.get('device')} but no CUDA device is visible "
                            f"here; use engine.device=cpu or run on a GPU machine")
    return engine


def prepare(cfg: DictConfig):
    """Check the whole config, cheapest first, before anything is written: (trace, sampling
    values, steps, engine). Raises UserError naming the bad value and the fix."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"{', '.join(missing)} must be set (it is ??? in the config), e.g. "
                        f"{missing[0]}=VALUE on the command line")
    from bench.knobs.check import validate
    validate(cfg)  # every option's name, type and range, from the schemas (bench/knobs/)
    verifies = _check_methods(cfg)
    trace = load_trace(cfg)
    values = resolve_sampling(cfg, trace)
    _check_sampling(values, verifies)
    steps = _check_steps(cfg, trace)
    settings = OmegaConf.to_container(cfg.engine, resolve=True)
    engine = _make_engine(settings.pop("name", None), settings)
    _check_interleave(cfg, engine)
    return trace, values, steps, engine


def _check_interleave(cfg: DictConfig, engine) -> None:
    interleave = cfg.get("interleave", False)
    if not isinstance(interleave, bool):
        raise UserError(f"interleave={interleave!r} must be true or false")
    turn = cfg.get("interleave_turn", 4)
    if not isinstance(turn, int) or isinstance(turn, bool) or turn < 1:
        raise UserError(f"interleave_turn={turn!r} must be a whole number >= 1 (iterations of a call a turn)")
    if interleave and not hasattr(engine, "rollout_steps"):
        raise UserError(f"interleave=true times the methods of a step a few iterations each in turn, which needs an "
                        f"engine that runs a call one iteration at a time (engine=torch_ref); engine "
                        f"{cfg.engine.name} does not: set interleave=false")


def run(cfg: DictConfig) -> Path:
    """Replay per the config; returns the run folder."""
    from bench.report.collect import collect, report
    from bench.report.results import RunWriter, check_parts
    from bench.core.sampling import SamplingConfig

    trace, sampling, steps, engine = prepare(cfg)  # every check, before any run folder is touched
    config = OmegaConf.to_container(cfg, resolve=True)
    config["sampling"] = sampling
    config["trace"]["name"] = trace.name
    config["trace"]["path"] = str(trace.root)
    if config.get("timing_repeats", 1) == 1:  # the default measures what runs before the knob measured:
        config.pop("timing_repeats", None)  # the same run id, and those runs still resume
    if config["engine"].get("seconds") == "measured":  # torch_ref's clock, as before the knob existed: same id
        config["engine"].pop("seconds")
    if not config.get("interleave", False):  # likewise: a run timed one method after another keeps its id
        config.pop("interleave", None)
        config.pop("interleave_turn", None)
    run_id = cfg.run_id or run_id_for(config)
    root = Path(hydra.utils.to_absolute_path(cfg.results_root))
    run_dir = root / run_id
    check_parts(run_dir)  # a corrupt part of a run being resumed: say so before reopening it
    writer = RunWriter(run_dir, config, {"trace_dir": str(trace.root), "engine": cfg.engine.name},
                       not_identity=NOT_IDENTITY)
    print(f"run {run_id}: {len(steps)} steps x {len(cfg.method)} methods on {cfg.engine.name}; "
          f"results in {run_dir}", file=sys.stderr)
    replay(trace, engine, method_specs(cfg), SamplingConfig(**sampling), writer, steps,
           labels={"run_id": writer.run_id, "trace": trace.name, "engine": cfg.engine.name},
           progress=bool(cfg.progress), timing_repeats=int(cfg.get("timing_repeats", 1)),
           interleave=bool(cfg.get("interleave", False)), interleave_turn=int(cfg.get("interleave_turn", 4)))
    engine.close()
    sources = [run_dir] if "baseline" in cfg.method else [root]
    col = collect(sources, progress=False)
    print(report(col))
    predicted = _predictions(cfg, run_dir)
    if cfg.plots:
        from bench.report.plots import make_figures
        fig_dir = Path(hydra.utils.to_absolute_path(cfg.figures_root)) / run_id
        paths = make_figures(col, fig_dir, progress=False)
        if predicted is not None:
            from bench.report.prediction import prediction_figure
            paths.append(prediction_figure(predicted, fig_dir / "predicted_speedup.png"))
        print(f"{len(paths)} figure files in {fig_dir}", file=sys.stderr)
    return run_dir


def _predictions(cfg: DictConfig, run_dir: Path):
    """Print the 'predicted speedups' section for ``cfg.predict`` targets (runs with a baseline and
    an iteration log only); returns the summary for the figure, or None."""
    targets = cfg.get("predict")
    targets = OmegaConf.to_container(targets, resolve=True) if targets else []
    if not targets or "baseline" not in cfg.method:
        return None
    from bench.report.prediction import prediction_report
    from bench.report.results import load_iterations
    iterations = load_iterations(run_dir)
    if iterations.empty:  # engines that log no forward passes (SGLang)
        print("(no iteration log from this engine: no predicted speedups)", file=sys.stderr)
        return None
    if iterations["draft_tokens"].isna().any():  # vLLM logs its steps but not their draft lengths
        print(f"(engine {cfg.engine.name} does not report each forward pass's draft tokens: no predicted "
              f"speedups; the iteration log still gives tail shares)", file=sys.stderr)
        return None
    text, summary = prediction_report(run_dir, targets)
    print(text)
    return summary


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench")
def _hydra_main(cfg: DictConfig) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        run(cfg)
    except UserError as exc:  # one line and exit status 2 (SystemExit passes through Hydra)
        exit_on_user_error(exc)


def check_job(cfg: DictConfig) -> None:
    """What can be checked of one job's config without loading its trace or engine."""
    from bench.knobs.check import validate
    validate(cfg)
    _check_methods(cfg)


def hydra_entry(hydra_main, config_name: str = "bench", check=check_job) -> None:
    """Run a ``@hydra.main`` function as an entry point: ``--methods`` / ``--knobs`` print the
    schemas; unknown config-group options are refused in one line first, and a sweep (``-m``) has
    every job's config ``check``-ed before the first job starts; user errors print as one line
    (``SPECROLLOUT_DEBUG=1``: tracebacks)."""
    if debug_enabled():
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        if print_listing(sys.argv[1:]):
            return
        check_overrides(sys.argv[1:])
        if not any(a.startswith(OTHER_CONFIGS) for a in sys.argv[1:]):  # other configs: Hydra's checks alone
            from bench.knobs.check import check_override_keys
            check_override_keys(sys.argv[1:], top_level=config_name == "bench")
            if {"-m", "--multirun"} & set(sys.argv[1:]):
                from bench.knobs.sweep import validate_sweep
                validate_sweep(CONF_DIR, config_name, sys.argv[1:], check)
    except UserError as exc:
        exit_on_user_error(exc)
    hydra_main()


def main() -> None:
    """The entry point of ``python -m bench.harness.cli``."""
    hydra_entry(_hydra_main)


if __name__ == "__main__":
    main()
