"""The main job's composed config checked whole, cheapest first, before any run folder is touched.

The command line (``bench.harness.cli``) calls :func:`prepare` before it writes anything; the
closed loop's command line (``bench.train.cli``) reuses :func:`check_methods`, also as the check of
every job of its sweeps. Every bad value raises one :class:`~bench.core.errors.UserError` naming it
and the fix. Kept apart from the command line so the checks read as one list, not between its
Hydra plumbing.

    python -m bench.harness.cli trace=countdown_tiny max_steps=0      # refused here: one line, exit 2
    python -m pytest -q tests/test_cli_errors.py tests/test_knobs.py  # the checks' tests
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from bench.core import verify as _verify
from bench.core.errors import UserError, one_line
from bench.core.verify import VerifyConfig


def load_trace(cfg: DictConfig):
    """The trace of the config: a directory, or the bundled one (recorded on first use)."""
    from bench.traces.format import Trace
    if cfg.trace.get("path"):
        return Trace.load(hydra.utils.to_absolute_path(str(cfg.trace.path)))
    from bench.traces.record.cache import ensure_trace
    return Trace.load(ensure_trace(cfg.trace.name, tiny=bool(cfg.trace.get("tiny", False)),
                                   progress=bool(cfg.progress)))


def resolve_sampling(cfg: DictConfig, trace) -> dict:
    """The trace's recorded sampling with the config's non-null fields on top."""
    from dataclasses import asdict
    values = {k: v for k, v in asdict(trace.sampling).items() if k != "n"}
    values.update({k: v for k, v in OmegaConf.to_container(cfg.sampling).items() if v is not None})
    return values


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


def check_methods(cfg: DictConfig) -> list[tuple[str, VerifyConfig]]:
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
    verifies = check_methods(cfg)
    trace = load_trace(cfg)
    values = resolve_sampling(cfg, trace)
    _check_sampling(values, verifies)
    steps = _check_steps(cfg, trace)
    settings = OmegaConf.to_container(cfg.engine, resolve=True)
    engine = _make_engine(settings.pop("name", None), settings)
    check_interleave(cfg, engine)
    check_policy_readers(cfg, engine)
    return trace, values, steps, engine


def check_policy_readers(cfg: DictConfig, engine) -> None:
    """A drafter that reads the policy's own model and hidden states (``attach_policy``: the
    EAGLE-style head) needs an engine that hands them over (``policy_module``: torch_ref)."""
    if hasattr(engine, "policy_module"):
        return
    for name, mcfg in cfg.method.items():
        cls = hydra.utils.get_class(mcfg.drafter._target_)
        if hasattr(cls, "attach_policy"):
            raise UserError(f"method {name} drafts from the policy's hidden states, which engine {cfg.engine.name} "
                            f"does not hand to drafters: run it with engine=torch_ref, or leave it out")


def check_interleave(cfg: DictConfig, engine) -> None:
    """``interleave`` and ``interleave_turn``, and an engine that can run a call in turns."""
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
