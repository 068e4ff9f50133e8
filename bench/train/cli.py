"""The closed loop's command line (conf/train.yaml): one run per Hydra job, the report at the end.

    python -m bench.train                          the baseline, seed 0
    python -m bench.train -m                       the default sweep: method x lenience x seed
    python -m bench.train -m method=baseline,hybrid seed=0,1,2

Each run's folder is named by its config, so rerunning a command resumes every unfinished run
from its last committed step and skips the finished ones. The whole config is checked before
anything is written; a bad value ends with one line naming it (exit status 2).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from bench.harness.cli import CONF_DIR, hydra_entry, method_specs
from bench.harness.config_checks import check_methods
from bench.core.errors import UserError, exit_on_user_error
from bench.core.verify import VerifyConfig

RUN_KEYS = ("task", "steps", "seed", "init_seed", "dtype", "heldout_prompts", "heldout_samples")


def setting_of(cfg: DictConfig):
    """The one selected method as the loop runs it, with ``lenience`` applied to a ratio rule;
    returns (MethodSpec, label, effective lenience or None)."""
    check_methods(cfg)
    if len(cfg.method) != 1:
        raise UserError(f"the closed loop trains with one method per run, got {list(cfg.method)}; "
                        f"sweep methods with -m method=A,B")
    spec = method_specs(cfg)[0]
    lenience = cfg.get("lenience")
    if spec.verify.rule != "ratio":
        if lenience is not None and (isinstance(lenience, bool) or not isinstance(lenience, (int, float))
                                     or not lenience >= 1):
            raise UserError(f"lenience={lenience!r} must be a number >= 1 (or null)")
        return spec, spec.name, None
    try:  # a float always, so lenience 2 and 2.0 are one run
        spec.verify = VerifyConfig(rule="ratio", lenience=float(spec.verify.lenience if lenience is None else lenience))
    except (TypeError, ValueError) as exc:
        raise UserError(f"lenience={lenience!r}: {exc}") from exc
    return spec, f"{spec.name}@l={spec.verify.lenience:.4g}", spec.verify.lenience


def identity_of(cfg: DictConfig, spec, lenience) -> dict:
    """What makes a run: the training config, the method's drafter and rule (lenience applied)."""
    name = spec.name
    method = OmegaConf.to_container(cfg.method[name], resolve=True)
    method["verify"] = {"rule": spec.verify.rule, "lenience": spec.verify.lenience}
    from bench.train.loop import TrainConfig
    train_cfg = TrainConfig(**{k: cfg.get(k) for k in RUN_KEYS})
    return {**{k: cfg.get(k) for k in RUN_KEYS}, "steps": train_cfg.num_steps,
            "warm_start": train_cfg.warm_start_key(), "method": name, "method_config": method,
            "lenience": lenience}


def study_of(identity: dict) -> str:
    """Runs comparable to each other (same task, steps, dtype, warm start): a short digest."""
    keys = {k: identity[k] for k in (*RUN_KEYS, "warm_start") if k != "seed"}
    return hashlib.sha1(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:8]


def run(cfg: DictConfig) -> Path:
    from bench.train.loop import TrainConfig, run_training
    spec, label, lenience = setting_of(cfg)
    train_cfg = TrainConfig(**{k: cfg.get(k) for k in RUN_KEYS})
    identity = identity_of(cfg, spec, lenience)
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    run_id = cfg.run_id or f"{cfg.task}-{label.replace('@l=', '-l')}-seed{cfg.seed}-{digest}"
    root = Path(hydra.utils.to_absolute_path(cfg.results_root))
    labels = {"run_id": run_id, "setting": label, "seed": int(cfg.seed), "study": study_of(identity)}
    print(f"closed loop {run_id}: {label}, seed {cfg.seed}, {train_cfg.num_steps} steps; results in "
          f"{root / run_id}", file=sys.stderr)
    run_dir = run_training(root / run_id, spec, train_cfg, identity, labels=labels, progress=bool(cfg.progress))
    return run_dir


def report(cfg: DictConfig) -> None:
    from bench.train.report import report_text, write_report
    root = Path(hydra.utils.to_absolute_path(cfg.results_root))
    summary, per_step = write_report(root, Path(hydra.utils.to_absolute_path(cfg.figures_root)))
    print(report_text(summary))


class ReportAtSweepEnd(Callback):
    """After the last job of a sweep: the table and the figures of every run (``report: true``)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if config.get("report", True):
            try:
                report(config)
            except UserError as exc:
                exit_on_user_error(exc)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        run(cfg)
        from hydra.core.hydra_config import HydraConfig
        single = HydraConfig.get().mode.name == "RUN"
        if single and cfg.report:
            report(cfg)
    except UserError as exc:
        exit_on_user_error(exc)


def main() -> None:
    """The entry point of ``python -m bench.train``."""
    hydra_entry(_hydra_main, "train", check_methods)
