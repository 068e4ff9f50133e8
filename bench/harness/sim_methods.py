"""Which methods the simulator can run, and their drafters: method configs (with knob overrides),
the refusals, and the future oracle over the recorded rollouts.

    python -m bench.harness.simulate TRACE_DIR --method all                      # every method allowed here
    python -m bench.harness.simulate TRACE_DIR --method copying                  # those that run no model
    python -m bench.harness.simulate TRACE_DIR --method tree_cache:match=best    # a knob variant (method_config)
    python -m bench.harness.simulate TRACE_DIR --method future_oracle            # the bound of any drafter

``future_oracle`` (``RecordedOracle``) knows the future: every iteration it drafts the rollout's
whole remaining recorded continuation, so each rollout takes one forward pass. It bounds what
any drafter could gain on that rollout, whatever its cache (not to be confused with the cache
oracle beside every method, ``bench.harness.sim_cache_oracle``).

Methods with the lenient ``ratio`` rule are refused (they need both policies' probabilities:
``python -m bench.benchmarks.bias`` measures them); run-ahead and the EAGLE-style head (it reads the
policy's hidden states) need the engine.
"""
from __future__ import annotations

from typing import Mapping

from methods.base import NullDrafter, RolloutKey
from methods.oracle import OracleDrafter

from bench.core.errors import UserError
from bench.core.paths import METHOD_CONF_DIR

METHOD_DIR = METHOD_CONF_DIR
FUTURE_ORACLE = "future_oracle"
FEATURE_DRAFTERS = ("bench.drafters.eagle.EagleDrafter",)  # read the policy's hidden states: engine only


class SimulationError(UserError, ValueError):
    """Input or method that cannot be simulated; the message names the file or method and the fix."""


class RecordedOracle(NullDrafter):
    """The future oracle over the recorded rollouts: each step's futures are that step's tokens.

    Selected with ``--method future_oracle``: every iteration drafts the whole remaining recorded
    continuation, so each rollout takes one forward pass (the upper bound of any drafter).
    """

    name = FUTURE_ORACLE

    def __init__(self, max_spec_tokens: int | None = None):
        self.max_spec_tokens = max_spec_tokens
        self._inner = OracleDrafter({}, max_spec_tokens)

    def set_futures(self, futures: Mapping[RolloutKey, list[int]]) -> None:
        self._inner = OracleDrafter(futures, self.max_spec_tokens)

    def start(self, key, prompt):
        self._inner.start(key, prompt)

    def propose(self, key, output, budget):
        return self._inner.propose(key, output, budget)

    def observe(self, key, new_tokens):
        self._inner.observe(key, new_tokens)

    def stats(self) -> dict:
        return {}


def method_config(name: str):
    """The method's config (``conf/method/<name>.yaml``); ``future_oracle`` is the built-in recorded oracle.

    ``NAME:knob=value,knob=value`` is that config with drafter knobs overridden (values read as
    YAML), e.g. ``tree_cache:match=best`` or ``seer:max_batch_draft_tokens=null``.
    """
    from omegaconf import OmegaConf
    if ":" in name:
        import yaml
        base, _, sets = name.partition(":")
        cfg = method_config(base)
        for item in filter(None, sets.split(",")):
            knob, eq, value = item.partition("=")
            if not eq or knob.strip() not in cfg.drafter:
                raise SimulationError(f"method {name!r}: {item!r} is not knob=value for a knob of "
                                      f"{base!r}; its knobs: {sorted(k for k in cfg.drafter if k != '_target_')}")
            cfg.drafter[knob.strip()] = yaml.safe_load(value)
        cfg.name = name
        return cfg
    if name == FUTURE_ORACLE:
        return OmegaConf.create({"name": FUTURE_ORACLE,
                                 "drafter": {"_target_": "bench.harness.sim_methods.RecordedOracle"},
                                 "verify": {"rule": "exact"}, "run_ahead": False})
    path = METHOD_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in METHOD_DIR.glob("*.yaml")) + [FUTURE_ORACLE]
        raise SimulationError(f"unknown method {name!r}: {path} does not exist; known methods: {known}")
    return OmegaConf.load(path)


def simulable_methods(copying_only: bool = False) -> list[str]:
    """Every configured method simulation can run (exact rules, no run-ahead), plus the future oracle.

    ``copying_only``: only the drafters that copy tokens (``methods/``, no model): the learned
    drafters run their draft model on every proposal, which on a CPU costs about a hundred times
    a copying drafter's proposal (results/LOG.md), so ``--method copying`` leaves them out."""
    out = []
    for p in sorted(METHOD_DIR.glob("*.yaml")):
        cfg = method_config(p.stem)
        try:
            check_simulable(p.stem, cfg)
        except SimulationError:
            continue
        if copying_only and runs_a_model(cfg):
            continue
        out.append(p.stem)
    return out + [FUTURE_ORACLE]


def expand_methods(names) -> list[str]:
    """``--method`` values as method names: ``all`` and ``copying`` become their lists (``simulable_methods``)."""
    return [n for m in names for n in (simulable_methods(copying_only=m == "copying") if m in ("all", "copying") else [m])]


def runs_a_model(cfg) -> bool:
    """Whether a method's drafter runs a model of its own (a learned drafter, ``bench.drafters``);
    the copying drafters are pure Python in ``methods/``."""
    return str((cfg.get("drafter") or {}).get("_target_", "")).startswith("bench.drafters.")


def check_simulable(name: str, cfg) -> None:
    verify = cfg.get("verify") or {}
    rule = verify.get("rule", "exact")
    if rule == "ratio":
        raise SimulationError(
            f"method {name!r} uses verify.rule=ratio (SPEC-RL's lenient test), which accepts by the "
            f"ratio of the new and old policies' probabilities: recorded tokens cannot tell what it "
            f"would accept, simulation needs exact verification. Simulate prefix_reuse_exact (the same "
            f"cache, exact rule), or measure the ratio rule's bias with `python -m bench.benchmarks.bias TRACE_DIR`")
    target = str((cfg.get("drafter") or {}).get("_target_", ""))
    if target in FEATURE_DRAFTERS:
        raise SimulationError(f"method {name!r} drafts from the policy's hidden states ({target}), which "
                              f"recorded tokens do not hold: replay it on torch_ref (python -m bench "
                              f"method={name}), or simulate draft_lm, the learned drafter over tokens")
    if cfg.get("run_ahead"):
        raise SimulationError(f"method {name!r} has run_ahead: true; run-ahead rollouts are generated by "
                              f"the engine and are not in the recorded rollouts, so simulation cannot "
                              f"replay them: simulate the method without run-ahead (e.g. tree_cache)")


def build_drafter(name: str, cfg):
    """A drafter from a method config (mapping with ``drafter``/``verify``) or a drafter instance."""
    if hasattr(cfg, "propose"):
        return cfg
    check_simulable(name, cfg)
    from hydra.utils import instantiate
    return instantiate(cfg["drafter"])
