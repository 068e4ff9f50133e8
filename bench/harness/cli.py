"""The command line: replay a trace with methods on an engine, then print the table and draw the figures.

    python -m bench.harness.cli                                  # the main job (conf/bench.yaml)
    python -m bench.harness.cli trace=countdown_tiny method=tree_cache engine.dtype=float64
    python -m bench.harness.cli -m 'method=glob(*)'              # one run per method (Hydra multirun)

The whole config is checked before anything is written (``bench.harness.config_checks.prepare``):
a bad value ends the command with one line naming it and the fix (exit status 2;
``SPECROLLOUT_DEBUG=1`` shows the traceback), and no run folder is created or changed. The
arguments Hydra has not composed yet (``--methods``, ``--knobs``, unknown options) are read in
``bench.harness.cli_overrides``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from bench.core.errors import UserError, debug_enabled, exit_on_user_error
from bench.core.paths import CONF_DIR as _CONF_PATH
from bench.core.verify import VerifyConfig
from bench.harness.cli_overrides import OTHER_CONFIGS, check_overrides, print_listing
from bench.harness.config_checks import check_methods, prepare
from bench.harness.replay import MethodSpec, replay

CONF_DIR = str(_CONF_PATH)
# keys that change where or how verbosely a run is written, not what it measures
NOT_IDENTITY = ("run_id", "results_root", "figures_root", "progress", "plots", "predict")


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


def _run_config(cfg: DictConfig, trace, sampling: dict) -> dict:
    """The config a run folder records (and its id digests): the resolved config with the trace's
    name and path and the resolved sampling, less the knobs at their defaults from before they
    existed (so those runs keep their ids and still resume)."""
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
    return config


def run(cfg: DictConfig) -> Path:
    """Replay per the config; returns the run folder."""
    from bench.report.results import RunWriter, check_parts
    from bench.core.sampling import SamplingConfig

    trace, sampling, steps, engine = prepare(cfg)  # every check, before any run folder is touched
    config = _run_config(cfg, trace, sampling)
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
    _report(cfg, root, run_dir, run_id)
    return run_dir


def _report(cfg: DictConfig, root: Path, run_dir: Path, run_id: str) -> None:
    """After the replay: the table (of this run, or of every run under ``root`` when this one has
    no baseline), the predicted speedups, and the figures."""
    from bench.report.collect import collect, report
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
    if iterations.empty or "baseline" not in set(iterations["method"]):  # SGLang's own loop logs no passes
        print(f"(engine {cfg.engine.name} logs no forward passes of the baseline (its own loop): no predicted "
              f"speedups)", file=sys.stderr)
        return None
    if iterations["draft_tokens"].isna().any():  # vLLM's own loop logs its steps but not their draft lengths
        print(f"(engine {cfg.engine.name}'s own loop does not report each forward pass's draft tokens: no "
              f"predicted speedups; the iteration log still gives tail shares)", file=sys.stderr)
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
    check_methods(cfg)


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
