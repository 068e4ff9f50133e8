"""The command line: replay a trace with methods on an engine, then print the table and draw the figures.

    python -m bench.cli                                  # the main job (conf/bench.yaml)
    python -m bench.cli trace=countdown_tiny method=tree_cache engine.dtype=float64
    python -m bench.cli -m 'method=glob(*)'              # one run per method (Hydra multirun)
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .replay import MethodSpec, replay
from .verify import VerifyConfig

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
# keys that change where or how verbosely a run is written, not what it measures
NOT_IDENTITY = ("run_id", "results_root", "figures_root", "progress", "plots")


def load_trace(cfg: DictConfig):
    """The trace of the config: a directory, or the bundled one (recorded on first use)."""
    from .trace import Trace
    if cfg.trace.get("path"):
        return Trace.load(hydra.utils.to_absolute_path(str(cfg.trace.path)))
    from .record import ensure_trace
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


def run(cfg: DictConfig) -> Path:
    """Replay per the config; returns the run folder."""
    from .collect import collect, report
    from .engines import make_engine
    from .results import RunWriter, load_run
    from .sampling import SamplingConfig

    trace = load_trace(cfg)
    sampling = resolve_sampling(cfg, trace)
    config = OmegaConf.to_container(cfg, resolve=True)
    config["sampling"] = sampling
    config["trace"]["name"] = trace.name
    config["trace"]["path"] = str(trace.root)
    run_id = cfg.run_id or run_id_for(config)
    root = Path(hydra.utils.to_absolute_path(cfg.results_root))
    run_dir = root / run_id
    engine_kw = {k: v for k, v in config["engine"].items() if k != "name"}
    engine = make_engine(cfg.engine.name, **engine_kw)
    steps = list(cfg.steps) if cfg.steps is not None else trace.step_numbers
    if cfg.max_steps is not None:
        steps = steps[:int(cfg.max_steps)]
    writer = RunWriter(run_dir, config, {"trace_dir": str(trace.root), "engine": cfg.engine.name})
    print(f"run {run_id}: {len(steps)} steps x {len(cfg.method)} methods on {cfg.engine.name}; "
          f"results in {run_dir}", file=sys.stderr)
    finished = None
    if writer.done_units():
        _, _, done_rows, _ = load_run(run_dir)
        finished = lambda step, method: done_rows[(done_rows["step"] == step) & (done_rows["method"] == method)]
    replay(trace, engine, method_specs(cfg), SamplingConfig(**sampling), writer, steps,
           labels={"run_id": writer.run_id, "trace": trace.name, "engine": cfg.engine.name},
           progress=bool(cfg.progress), finished_rows=finished)
    engine.close()
    sources = [run_dir] if "baseline" in cfg.method else [root]
    col = collect(sources, progress=False)
    print(report(col))
    if cfg.plots:
        from .plots import make_figures
        fig_dir = Path(hydra.utils.to_absolute_path(cfg.figures_root)) / run_id
        paths = make_figures(col, fig_dir, progress=False)
        print(f"{len(paths)} figure files in {fig_dir}", file=sys.stderr)
    return run_dir


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench")
def _hydra_main(cfg: DictConfig) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    run(cfg)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
