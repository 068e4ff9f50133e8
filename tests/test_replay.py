"""The harness end to end on the tiny recorded trace: exactness of every method, the oracle,
resume after a real kill, configs, sweeps and collection."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bench.cli import CONF_DIR, run
from bench.collect import collect
from bench.engines.torch_ref import TorchRefEngine
from bench.replay import MethodSpec, replay
from bench.results import RunWriter, load_run
from bench.trace import Trace
from bench.verify import VerifyConfig
from methods.base import RolloutKey
from methods.baseline import Baseline
from methods.oracle import OracleDrafter

EXACT = ["baseline", "prefix_reuse_exact", "tree_cache", "tree_cache_tree", "tree_cache_runahead",
         "history_spec", "suffix_global", "hybrid"]
ROOT = Path(__file__).resolve().parent.parent


def cfg_for(*overrides):
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("bench", overrides=["trace=countdown_tiny", "progress=false", "plots=false", *overrides])


def outputs(run_dir, method):
    _, _, rows, _ = load_run(run_dir)
    rows = rows[rows["method"] == method].sort_values(["step", "prompt_id", "sample_idx"])
    return {(s, p, i): list(t) for s, p, i, t in zip(rows["step"], rows["prompt_id"], rows["sample_idx"],
                                                       rows["output_tokens"])}


@pytest.mark.parametrize("sampling", ["trace", "top_p", "greedy"])
def test_every_exact_method_is_token_identical_to_baseline(tmp_path, sampling):
    methods = "[" + ",".join(EXACT + ["prefix_reuse"]) + "]"
    run_dir = run(cfg_for(f"method={methods}", f"sampling={sampling}", "engine.dtype=float64", "max_steps=4",
                          f"results_root={tmp_path}"))
    base = outputs(run_dir, "baseline")
    assert len(base) > 0
    for m in EXACT:
        assert outputs(run_dir, m) == base, f"{m} is not token-identical to the baseline ({sampling})"
    if sampling == "greedy":  # against a one-hot target the ratio rule accepts exactly the argmax
        assert outputs(run_dir, "prefix_reuse") == base
    else:  # the lenient ratio rule is lossy: it must change some rollouts
        assert outputs(run_dir, "prefix_reuse") != base
    _, _, rows, steps = load_run(run_dir)
    # speculation really happened, and the baseline did none
    assert steps.groupby("method")["num_accepted_tokens"].sum().drop("baseline").min() > 0
    assert steps.loc[steps["method"] == "baseline", "num_drafts"].sum() == 0
    if sampling == "trace":  # recorded with coupled sampling: the replay reproduces the recording
        assert steps.loc[steps["method"] == "baseline", "recorded_match_rate"].min() == 1.0


def test_oracle_replay_accepts_the_recorded_future(tmp_path):
    from bench.record import ensure_trace
    trace = Trace.load(ensure_trace("countdown-tiny", tiny=True))
    steps = trace.step_numbers[:2]
    futures = {RolloutKey(p, int(i)): [int(t) for t in toks]
               for s in steps for p, i, toks in trace.rollouts(s)[["prompt_id", "sample_idx", "token_ids"]].values}
    engine = TorchRefEngine(dtype="float64")
    writer = RunWriter(tmp_path / "run", {"trace": {"name": trace.name}, "engine": {"name": "torch_ref"}})
    specs = [MethodSpec("baseline", Baseline, VerifyConfig()),
             MethodSpec("oracle", lambda: OracleDrafter(futures, 16), VerifyConfig())]
    replay(trace, engine, specs, trace.sampling.to_config(), writer, steps, progress=False,
           labels={"trace": trace.name, "engine": "torch_ref"})
    _, _, rows, _ = load_run(tmp_path / "run")
    orc, base = rows[rows.method == "oracle"], rows[rows.method == "baseline"]
    assert list(map(list, orc.output_tokens)) == list(map(list, base.output_tokens))
    # every rollout longer than one token was drafted entirely: one pass per 16 tokens + the bonus
    assert (orc.num_forward_passes <= (orc.output_len + 15) // 16 + 1).all()
    assert orc.num_forward_passes.sum() < base.num_forward_passes.sum()


def _cli(*args):
    """The CLI as a user types it (Hydra's -m flag goes before the overrides)."""
    flags = [a for a in args if a == "-m"]
    return [sys.executable, "-m", "bench.cli", *flags, "trace=countdown_tiny", "plots=false", "progress=false",
            *[a for a in args if a != "-m"]]


def test_resume_after_kill_loses_nothing_and_counts_nothing_twice(tmp_path):
    from bench.record import ensure_trace
    ensure_trace("countdown-tiny", tiny=True)  # recorded before the clock starts
    common = ["method=[baseline,tree_cache,history_spec]", "engine.dtype=float64", "max_steps=5",
              f"results_root={tmp_path}"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(*common, "run_id=killed"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(list((killed / "steps.parquet").glob("step_*"))) < 4:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    parts = len(list((killed / "steps.parquet").glob("step_*")))
    assert 4 <= parts < 15, "the kill must land mid-run"
    subprocess.run(_cli(*common, "run_id=killed"), cwd=ROOT, check=True, capture_output=True)
    subprocess.run(_cli(*common, "run_id=whole"), cwd=ROOT, check=True, capture_output=True)
    _, summary, rows, steps = load_run(killed)
    assert summary["status"] == "complete" and summary.get("resumed_at")
    assert len(steps) == 15 and not steps.duplicated(["step", "method"]).any()
    assert not rows.duplicated(["step", "method", "prompt_id", "sample_idx"]).any()
    _, _, whole, _ = load_run(tmp_path / "whole")
    cols = ["step", "method", "prompt_id", "sample_idx"]
    a, b = rows.sort_values(cols).reset_index(drop=True), whole.sort_values(cols).reset_index(drop=True)
    assert list(map(list, a.output_tokens)) == list(map(list, b.output_tokens))
    # drafter caches rebuilt from the results give the same drafts as an uninterrupted run
    assert a.num_accepted_tokens.tolist() == b.num_accepted_tokens.tolist()


@pytest.mark.parametrize("group,options", [
    ("trace", ["countdown", "countdown_tiny"]), ("engine", ["torch_ref"]),
    ("sampling", ["trace", "greedy", "top_p"]), ("experiment", ["main", "smoke", "lenience"]),
    ("sweep", ["methods", "spec_tokens"])])
def test_every_config_composes(group, options):
    for opt in options:
        cfg = cfg_for(f"{group}={opt}")
        OmegaConf.to_container(cfg.method, resolve=True)
        assert cfg.method, f"{group}={opt} selects no method"


def test_every_method_config_is_in_the_main_job():
    names = sorted(p.stem for p in (Path(CONF_DIR) / "method").glob("*.yaml"))
    assert sorted(cfg_for().method) == names


def test_missing_engine_names_what_to_do(tmp_path):
    with pytest.raises(NotImplementedError, match="engine=torch_ref"):
        run(cfg_for("engine=vllm", "method=baseline", "max_steps=1", f"results_root={tmp_path}"))


@pytest.mark.parametrize("launcher", ["basic", "local_parallel", "slurm_local"])
def test_multirun_sweep_of_two_methods_gives_two_runs_collect_merges(tmp_path, launcher):
    args = ["-m", "method=baseline,tree_cache", "max_steps=2", f"results_root={tmp_path / 'runs'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    if launcher != "basic":
        args.append(f"hydra/launcher={launcher}")
    res = subprocess.run(_cli(*args), cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 2 and any("baseline" in r for r in runs) and any("tree_cache" in r for r in runs)
    col = collect([tmp_path / "runs"], progress=False)
    table = col.table.set_index("method")
    assert set(table.index) == {"baseline", "tree_cache"}
    assert table.loc["tree_cache", "speedup"] > 0  # computed against the other run's baseline
