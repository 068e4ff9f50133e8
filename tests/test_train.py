"""The closed loop (bench.train): exact methods train the baseline's very weights, a lossy rule
does not, a killed run resumes to the same weights, the report's numbers come from the runs, and
bad input is refused in one line before anything is written."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from bench.core.errors import DEBUG_ENV, UserError
from bench.report.stats import mean_ci95, t95
from bench.train import cli
from bench.train.loop import StopAfter, TrainConfig, run_training
from bench.train.report import load_runs, report_text, summarize, write_report
from bench.train.warmstart import mean_kl

ROOT = Path(__file__).resolve().parent.parent
TINY = ["task=countdown-tiny", "progress=false", "report=false"]
EXACT = ("tree_cache", "tree_cache_runahead", "prefix_reuse_exact")


def _cfg(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=cli.CONF_DIR, version_base="1.3"):
        return compose("train", overrides=[*TINY, f"results_root={tmp_path}", f"figures_root={tmp_path / 'figs'}",
                                           *overrides])


def _train(tmp_path: Path, *overrides: str) -> pd.DataFrame:
    run_dir = cli.run(_cfg(tmp_path, *overrides))
    rows = [pd.read_parquet(p) for p in sorted((run_dir / "steps").glob("step_*.parquet"))]
    return pd.concat(rows, ignore_index=True)


@pytest.fixture(scope="module")
def float64_runs(tmp_path_factory):
    """The tiny task in float64 (6 GRPO steps, 4 prompts x 4 samples a step) with the baseline, three
    exact methods (a tree drafter with in-flight siblings, the same with SRT's run-ahead, SPEC-RL's
    draft verified exactly) and SPEC-RL's lossy ratio rule."""
    root = tmp_path_factory.mktemp("train64")
    runs = {m: _train(root, f"method={m}", "dtype=float64")
            for m in ("baseline", *EXACT, "prefix_reuse")}
    return root, runs


def test_exact_methods_train_bit_identical_weights_in_float64(float64_runs):
    _, runs = float64_runs
    base = runs["baseline"]
    assert len(base) == 6 and base["weights_sha1"].nunique() > 2  # the policy moves
    assert runs["tree_cache_runahead"]["run_ahead_rollouts"].sum() > 0  # run-ahead ran, and trained nothing
    for method in EXACT:
        run = runs[method]
        assert run["num_accepted_tokens"].sum() > 0, f"{method} accepted no draft token: nothing was tested"
        assert list(run["weights_sha1"]) == list(base["weights_sha1"]), method
        assert list(run["reward_mean"]) == list(base["reward_mean"])


def test_the_ratio_rule_changes_what_is_learnt(float64_runs):
    """The comparison above can fail: SPEC-RL's lenient rule accepts tokens plain sampling would
    not have drawn, and the weights leave the baseline's at the first step it drafts."""
    _, runs = float64_runs
    lossy, base = runs["prefix_reuse"], runs["baseline"]
    assert lossy["num_accepted_tokens"].sum() > 0
    differs = [a != b for a, b in zip(lossy["weights_sha1"], base["weights_sha1"])]
    assert any(differs)
    first = differs.index(True)
    assert lossy["num_draft_tokens"].iloc[:first + 1].sum() > 0  # it differs once it has drafted


def test_report_pairs_runs_with_their_baseline(float64_runs, tmp_path):
    root, _ = float64_runs
    df = load_runs(root)
    exact = df[df["method"].isin(["baseline", *EXACT])]
    assert (exact["kl_from_baseline"] == 0).all() and exact["weights_identical"].all()
    lossy = df[df["method"] == "prefix_reuse"]
    assert (lossy["kl_from_baseline"] >= 0).all() and lossy["kl_from_baseline"].iloc[-1] > 0
    summary, steps = write_report(root, tmp_path / "figs", last=2)
    row = summary.set_index("setting").loc["tree_cache"]
    assert row["weights_identical"] and row["reward_diff_vs_baseline"] == 0
    assert row["tokens_per_pass"] > 1
    assert summary.set_index("setting").loc["baseline", "tokens_per_pass"] == 1
    last2 = df[(df["method"] == "prefix_reuse") & (df["step"] >= 4)]["reward_mean"].mean()
    assert summary.set_index("setting").filter(like="prefix_reuse@", axis=0)["final_reward"].iat[0] == \
        pytest.approx(last2)
    assert len(steps) == 5 * 6
    assert list((tmp_path / "figs").glob("closed_loop_*.png"))
    assert "prefix_reuse@l=1.649" in report_text(summary)


def test_a_stopped_run_resumes_to_the_uninterrupted_weights(float64_runs, tmp_path):
    _, runs = float64_runs
    spec, train_cfg, identity, labels = _spec_and_identity(tmp_path, "method=tree_cache", "dtype=float64")
    for stop in (2, 1):  # killed after step 1, then after step 2, then run to the end
        with pytest.raises(StopAfter):
            run_training(tmp_path / "r", spec, train_cfg, identity, labels, progress=False, stop_after_steps=stop)
    run_training(tmp_path / "r", spec, train_cfg, identity, labels, progress=False)
    resumed = pd.concat([pd.read_parquet(p) for p in sorted((tmp_path / "r" / "steps").glob("*.parquet"))])
    assert list(resumed["weights_sha1"]) == list(runs["tree_cache"]["weights_sha1"])
    assert list(resumed["num_accepted_tokens"]) == list(runs["tree_cache"]["num_accepted_tokens"])
    assert len(list((tmp_path / "r" / "state").glob("*.pt"))) == 1  # only the latest state is kept


def _spec_and_identity(tmp_path, *overrides):
    cfg = _cfg(tmp_path, *overrides)
    spec, label, lenience = cli.setting_of(cfg)
    identity = cli.identity_of(cfg, spec, lenience)
    train_cfg = TrainConfig(**{k: cfg.get(k) for k in cli.RUN_KEYS})
    return spec, train_cfg, identity, {"run_id": "r", "setting": label, "seed": 0, "study": cli.study_of(identity)}


def test_a_step_in_flight_is_redone_and_a_lost_state_named(float64_runs, tmp_path):
    """A crash after a step's state and held-out array but before its row: the resume redoes that
    step (the ratio rule's drafter restored from its pickle) and ends with the uninterrupted
    weights. A committed step whose state is gone is refused in one line naming the file."""
    _, runs = float64_runs
    spec, train_cfg, identity, labels = _spec_and_identity(tmp_path, "method=prefix_reuse", "dtype=float64")
    run = tmp_path / "r"
    with pytest.raises(StopAfter):
        run_training(run, spec, train_cfg, identity, labels, progress=False, stop_after_steps=5)
    shutil.copy(run / "state" / "step_00004.pt", run / "state" / "step_00005.pt")  # step 5 in flight
    np.save(run / "eval" / "step_00005.npy", np.zeros(3, dtype=np.float32))
    run_training(run, spec, train_cfg, identity, labels, progress=False)
    resumed = pd.concat([pd.read_parquet(p) for p in sorted((run / "steps").glob("*.parquet"))])
    assert list(resumed["weights_sha1"]) == list(runs["prefix_reuse"]["weights_sha1"])
    assert np.load(run / "eval" / "step_00005.npy").ndim == 2

    spec, train_cfg, identity, labels = _spec_and_identity(tmp_path, "method=baseline", "dtype=float64")
    with pytest.raises(StopAfter):
        run_training(tmp_path / "b", spec, train_cfg, identity, labels, progress=False, stop_after_steps=3)
    (tmp_path / "b" / "state" / "step_00002.pt").unlink()
    with pytest.raises(UserError, match=r"step_00002\.pt is missing"):
        run_training(tmp_path / "b", spec, train_cfg, identity, labels, progress=False)


def test_final_reward_counts_only_runs_with_the_whole_window():
    """Two identical curves, one seed of one setting stopped early: that seed is left out of the
    setting's final reward (not averaged over the steps it has), so the paired difference is 0."""
    rows = []
    for setting in ("baseline", "other"):
        for seed in range(3):
            for step in range(8):
                if setting == "other" and seed == 2 and step >= 6:
                    continue
                rows.append({"study": "s", "setting": setting, "method": setting, "rule": "exact",
                             "lenience": None, "seed": seed, "step": step, "run_id": f"{setting}{seed}",
                             "reward_mean": step / 8 + seed / 10, "rollout_s": 1.0, "train_s": 1.0,
                             "sync_s": 0.0, "step_s": 2.0, "output_tokens": 10, "rollout_passes": 10,
                             "num_accepted_tokens": 0, "num_draft_tokens": 0, "kl_from_baseline": 0.0,
                             "weights_identical": True})
    summary = summarize(pd.DataFrame(rows), last=4).set_index("setting")
    assert summary.loc["other", "seeds"] == 2 and summary.loc["baseline", "seeds"] == 3
    assert summary.loc["other", "reward_diff_vs_baseline"] == 0
    with pytest.raises(UserError, match="--last 0"):
        summarize(pd.DataFrame(rows), last=0)


def test_lenience_applies_to_the_ratio_rule_only(tmp_path):
    spec, label, lenience = cli.setting_of(_cfg(tmp_path, "method=prefix_reuse", "lenience=2.718281828459045"))
    assert spec.verify.rule == "ratio" and lenience == pytest.approx(np.e) and label == "prefix_reuse@l=2.718"
    a = cli.setting_of(_cfg(tmp_path, "method=baseline", "lenience=2.0"))
    b = cli.setting_of(_cfg(tmp_path, "method=baseline"))
    assert a[2] is None and a[1] == "baseline"
    ids = [cli.identity_of(_cfg(tmp_path, "method=baseline", f"lenience={x}"), *cli.setting_of(
        _cfg(tmp_path, "method=baseline", f"lenience={x}"))[::2]) for x in (1.0, 2.0)]
    assert ids[0] == ids[1] == cli.identity_of(_cfg(tmp_path, "method=baseline"), b[0], b[2])


@pytest.mark.parametrize("overrides, words", [
    (["method=[baseline,tree_cache]"], "one method per run"),
    (["task=nope"], "task='nope'"),
    (["dtype=bfloat16"], "dtype='bfloat16'"),
    (["method=prefix_reuse", "lenience=0.5"], "lenience=0.5"),
    (["steps=0"], "steps=0"),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, overrides, words):
    cfg = _cfg(tmp_path, *overrides)
    with pytest.raises(UserError, match=words.replace("[", r"\[").replace("(", r"\(")):
        cli.run(cfg)
    assert not any(tmp_path.iterdir())


def test_the_command_line_prints_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.train", *TINY, "task=nope", f"results_root={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, DEBUG_ENV: ""})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: task='nope'"), proc.stderr
    assert not any(tmp_path.iterdir())


def test_a_run_folder_of_another_config_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "method=baseline", "dtype=float64", "run_id=same")
    cli.run(_cfg(tmp_path, "method=baseline", "dtype=float64", "run_id=same", "steps=1"))
    with pytest.raises(UserError, match="another config"):
        cli.run(cfg)


def test_mean_kl_and_intervals():
    p = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    q = np.log(np.array([[0.5, 0.5], [0.5, 0.5]]))
    assert mean_kl(p, p) == 0
    assert mean_kl(p, q) == pytest.approx((0.9 * np.log(1.8) + 0.1 * np.log(0.2)) / 2)
    assert t95(4) == 2.776 and t95(11) == t95(10) and t95(500) == 1.96
    mean, half = mean_ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and half == pytest.approx(2.776 * np.sqrt(2.5) / np.sqrt(5))
    assert np.isnan(mean_ci95([1.0])[1])
