"""Run folders: atomic units, resume after a kill, no double counting, config mismatch, bad folders."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from bench.report.results import (ROLLOUT_SCHEMA, STEP_SCHEMA, ConfigMismatchError, RunFolderError,
                           RunWriter, load_run, rollout_row)
from results_fixtures import fake_rollouts, run_config, unit_rows, write_fake_run


def test_rollout_row_copies_a_rollout():
    r = fake_rollouts(2, "tree_cache")[0]
    row = rollout_row(r, method="tree_cache", reward=1.0)
    assert row["output_tokens"] == r.token_ids and row["output_len"] == len(r.token_ids)
    assert row["prompt_id"] == r.key.prompt_id and row["sample_idx"] == r.key.sample_idx
    assert row["num_accepted_tokens_per_pos"] == r.num_accepted_tokens_per_pos
    assert row["reward"] == 1.0 and row["matches_recorded"] is None
    # the counter identity the fixtures are built on: every pass emits 1 token plus accepted ones
    assert row["output_len"] == row["num_forward_passes"] + row["num_accepted_tokens"]


def test_write_and_load_round_trip(tmp_path):
    run_dir = write_fake_run(tmp_path, "r1", methods=("baseline", "tree_cache"), steps=2)
    config, summary, rollouts, steps = load_run(run_dir)
    assert config == run_config(methods=("baseline", "tree_cache"))
    assert summary["status"] == "complete" and summary["end_time"]
    assert summary["versions"]["python"] and summary["hardware"]["cores"]
    assert set(ROLLOUT_SCHEMA) <= set(rollouts.columns)
    assert set(STEP_SCHEMA) | {"drafter_tree_nodes"} <= set(steps.columns)
    assert len(steps) == 4 and len(rollouts) == 4 * 8
    assert (rollouts["run_id"] == "r1").all() and (rollouts["engine"] == "torch_ref").all()
    # plain pandas reads the part directories too
    assert len(pd.read_parquet(run_dir / "rollouts.parquet")) == len(rollouts)
    assert len(pd.read_parquet(run_dir / "steps.parquet")) == len(steps)


def test_resume_skips_done_units_and_rewrite_does_not_duplicate(tmp_path):
    run_dir, config = tmp_path / "r", run_config()
    w = RunWriter(run_dir, config, {})
    for step in (0, 1):
        w.write_unit(step, "baseline", *unit_rows(step, "baseline"))
    w2 = RunWriter(run_dir, config, {})  # reopened, as a restarted job would
    assert w2.done_units() == {(0, "baseline"), (1, "baseline")}
    w2.write_unit(1, "baseline", *unit_rows(1, "baseline"))  # rewrite a done unit
    w2.write_unit(1, "tree_cache", *unit_rows(1, "tree_cache"))
    w2.finish()
    _, summary, rollouts, steps = load_run(run_dir)
    assert len(steps) == 3
    assert not rollouts.duplicated(["step", "method", "prompt_id", "sample_idx"]).any()
    assert summary["status"] == "complete" and len(summary["resumed_at"]) == 1


def test_method_names_with_odd_characters_survive(tmp_path):
    w = RunWriter(tmp_path / "r", run_config(), {})
    rows, srow = unit_rows(1, "tree_cache")
    name = "tree_cache/max_spec_tokens=8"
    w.write_unit(1, name, [{**r, "method": name} for r in rows], {**srow, "method": name})
    assert w.done_units() == {(1, name)}


def test_unit_rows_must_match_the_unit(tmp_path):
    w = RunWriter(tmp_path / "r", run_config(), {})
    rows, srow = unit_rows(1, "tree_cache")
    with pytest.raises(ValueError, match="one step of one method"):
        w.write_unit(2, "tree_cache", rows, srow)


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[2])
    import bench.report.results as R
    from results_fixtures import run_config, unit_rows
    w = R.RunWriter(sys.argv[1], run_config(), {})
    for step in range(3):
        w.write_unit(step, "baseline", *unit_rows(step, "baseline"))
    real = R._atomic_write_bytes
    def stall(path, write):  # die between the rollouts part and the steps part (the commit)
        if path.parent.name == "steps.parquet":
            (path.parent / f".tmp-{os.getpid()}-{path.name}").write_bytes(b"PAR1 half written")
            print("stalled", flush=True)
            time.sleep(120)
        real(path, write)
    R._atomic_write_bytes = stall
    w.write_unit(3, "baseline", *unit_rows(3, "baseline"))
""")


def test_writer_killed_mid_unit_leaves_readable_results_and_resumes(tmp_path):
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(run_dir),
                             str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stalled"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # the half-written unit 3 is invisible: its rollouts part is not committed, the temp is hidden
    assert (run_dir / "rollouts.parquet" / "step_00003__baseline.parquet").exists()
    _, summary, rollouts, steps = load_run(run_dir)
    assert summary["status"] == "running"
    assert sorted(steps["step"]) == [0, 1, 2] and sorted(rollouts["step"].unique()) == [0, 1, 2]
    assert len(pd.read_parquet(run_dir / "steps.parquet")) == 3

    w = RunWriter(run_dir, run_config(), {})
    assert w.done_units() == {(s, "baseline") for s in range(3)}
    assert not list((run_dir / "steps.parquet").glob(".tmp-*"))
    for step in range(5):
        if (step, "baseline") not in w.done_units():
            w.write_unit(step, "baseline", *unit_rows(step, "baseline"))
    w.finish()
    _, summary, rollouts, steps = load_run(run_dir)
    assert sorted(steps["step"]) == [0, 1, 2, 3, 4] and summary["status"] == "complete"
    assert len(rollouts) == 5 * 8
    assert not rollouts.duplicated(["step", "method", "prompt_id", "sample_idx"]).any()


def test_reopening_with_another_config_names_the_keys(tmp_path):
    RunWriter(tmp_path / "r", run_config(), {})
    with pytest.raises(ConfigMismatchError) as err:
        RunWriter(tmp_path / "r", run_config(temperature=0.6), {})
    assert "sampling.temperature" in str(err.value) and "new run id" in str(err.value)
    assert "max_new_tokens" not in str(err.value)


def test_incomplete_run_folder_is_a_clear_error(tmp_path):
    run_dir = write_fake_run(tmp_path, "r", steps=1)
    (run_dir / "summary.json").unlink()
    with pytest.raises(RunFolderError, match=r"summary\.json is missing"):
        load_run(run_dir)


def test_summary_is_valid_json_while_running(tmp_path):
    w = RunWriter(tmp_path / "r", run_config(), {"trace": "tiny", "note": "smoke"})
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "running" and summary["engine"] == "torch_ref"
    assert summary["note"] == "smoke" and w.run_id == "r"
