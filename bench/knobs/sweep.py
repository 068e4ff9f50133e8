"""Every job of a Hydra sweep checked before the first one starts.

    python -m bench.harness.cli -m method=tree_cache method.tree_cache.drafter.max_spec_tokens=8,-5

Hydra composes and launches one job at a time, so a bad value in the third job of a sweep would
surface after two jobs have run and written results. :func:`validate_sweep` expands the sweep as
Hydra's basic sweeper does (the config's ``hydra.sweeper.params`` first, then the command line),
composes each job's config and hands it to the caller's check, which raises a UserError naming
the job.
"""
from __future__ import annotations

from typing import Callable

from bench.core.errors import UserError

FLAGS = ("-m", "--multirun")


def job_overrides(conf_dir: str, config_name: str, args: list[str]) -> list[list[str]]:
    """The overrides of every job the sweep would launch, in Hydra's order."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.global_hydra import GlobalHydra
    overrides = [a for a in args if a not in FLAGS and not a.startswith("-")]
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().hydra.config_loader)
        fixed = [a for a, o in zip(overrides, parser.parse_overrides(overrides)) if not o.is_sweep_override()]
        base = compose(config_name, overrides=fixed, return_hydra_config=True)
        params = base.hydra.sweeper.get("params") or {}
        swept = [f"{k}={v}" for k, v in params.items()] + overrides
        batches = BasicSweeper.split_arguments(parser.parse_overrides(swept), None)
    return [list(job) for job in batches[0]] if batches else [overrides]


def validate_sweep(conf_dir: str, config_name: str, args: list[str], check: Callable) -> int:
    """Compose and ``check`` every job of the sweep ``args`` describe; returns how many there are (0:
    a sweep Hydra cannot compose, left for Hydra to report in its own words)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    hydras = (HydraException, OmegaConfBaseException)
    try:
        jobs = job_overrides(conf_dir, config_name, args)
    except hydras:
        return 0  # a sweep Hydra cannot expand: Hydra says why when it runs
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        for number, job in enumerate(jobs):
            try:
                cfg = compose(config_name, overrides=[o for o in job if not o.startswith(("hydra.", "hydra/"))])
            except hydras:
                return 0
            try:
                check(cfg)
            except UserError as exc:
                raise UserError(f"sweep job {number} of {len(jobs)} ({' '.join(job)}): {exc}; no job was "
                                f"started") from exc
    return len(jobs)


__all__ = ["job_overrides", "validate_sweep"]
