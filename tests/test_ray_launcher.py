"""A two-job sweep through Hydra's Ray launcher on a local Ray cluster (the ``ray`` extra).

    pip install -e '.[ray]' && pytest tests/test_ray_launcher.py

Skipped where hydra-ray-launcher is not installed. ``conf/hydra/launcher/ray_cluster.yaml`` joins a
running cluster (``address: auto``); here ``address=null`` makes ``ray.init`` start a local one with
two CPUs, one per job.
"""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_two_job_sweep_on_a_local_ray_cluster(tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    from bench.report.collect import collect
    from bench.traces.record.cache import ensure_trace
    ensure_trace("countdown-tiny", tiny=True, progress=False)  # recorded before the jobs start
    args = [sys.executable, "-m", "bench.harness.cli", "-m", "trace=countdown_tiny", "plots=false", "progress=false",
            "method=baseline,tree_cache", "max_steps=2", f"results_root={tmp_path / 'runs'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra/launcher=ray_cluster",
            "hydra.launcher.ray.init.address=null", "+hydra.launcher.ray.init.num_cpus=2",
            "hydra.launcher.ray.remote.num_cpus=1"]
    res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 2 and any("baseline" in r for r in runs) and any("tree_cache" in r for r in runs)
    table = collect([tmp_path / "runs"], progress=False).table.set_index("method")
    assert set(table.index) == {"baseline", "tree_cache"} and table.loc["tree_cache", "speedup"] > 0
