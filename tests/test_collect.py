"""Collection across runs: speedups only against the matching baseline, merging, duplicates; metrics."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from bench.report.collect import collect, main, report
from bench.report.results import RunFolderError, load_run
from bench.report.stats import accepted_lengths, summarize
from results_fixtures import write_fake_run


def _row(col, engine, method, temperature=1):
    t = col.table
    row = t[(t.engine == engine) & (t.method == method) & t.sampling.str.contains(
        f"temperature={temperature:g} ")]
    assert len(row) == 1, row
    return row.iloc[0]


def _wall(run_dir, method):
    steps = load_run(run_dir)[3]
    return steps[steps.method == method].set_index("step")["wall_s"]


def test_speedup_uses_only_the_baseline_of_the_same_engine_and_sampling(tmp_path):
    ref = write_fake_run(tmp_path, "ref", engine="torch_ref", methods=("baseline", "tree_cache"))
    # a much faster baseline on another engine, and one at another temperature: both must be ignored
    write_fake_run(tmp_path, "vllm_base", engine="vllm", methods=("baseline",))
    write_fake_run(tmp_path, "ref_t06_base", engine="torch_ref", methods=("baseline",),
                   temperature=0.6, wall_scale=0.1)
    write_fake_run(tmp_path, "vllm_t06_tree", engine="vllm", methods=("tree_cache",), temperature=0.6)
    col = collect([tmp_path], progress=False)

    base, tree = _wall(ref, "baseline"), _wall(ref, "tree_cache")
    assert _row(col, "torch_ref", "tree_cache").speedup == pytest.approx(base.mean() / tree.mean())
    assert _row(col, "torch_ref", "baseline").speedup == pytest.approx(1.0)
    assert _row(col, "torch_ref", "tree_cache").reward_delta == 0.0  # exact method, same tokens
    assert math.isnan(_row(col, "vllm", "tree_cache", temperature=0.6).speedup)
    assert any("no 'baseline' run" in n and "vllm" in n and "temperature=0.6" in n
               for n in col.notes)
    per = col.per_step[(col.per_step.engine == "torch_ref") & (col.per_step.method == "tree_cache")
                       & col.per_step.sampling.str.contains("temperature=1 ")]
    assert np.allclose(per.set_index("step")["speedup"], base / tree)


def test_merges_runs_from_two_folders_with_clashing_ids(tmp_path):
    write_fake_run(tmp_path / "machine_a", "run0", engine="torch_ref")
    write_fake_run(tmp_path / "machine_b" / "sweep", "run0", engine="vllm")
    col = collect([tmp_path / "machine_a", tmp_path / "machine_b"], progress=False)
    assert sorted(col.table.engine.unique()) == ["torch_ref", "vllm"]
    assert col.runs.run_id.is_unique and len(col.runs) == 2
    assert col.table.speedup.notna().all()


def test_duplicate_runs_say_which_is_used(tmp_path):
    write_fake_run(tmp_path, "first", steps=2, finish=False)
    write_fake_run(tmp_path, "resumed", steps=3)
    col = collect([tmp_path], progress=False)
    assert set(col.table.run_id) == {"resumed"}
    assert any("using resumed" in n and "not first" in n for n in col.notes)
    assert (col.steps.run_id == "resumed").all()


def test_knob_sweeps_are_variants_not_duplicates(tmp_path):
    for k in (4, 8):
        run = write_fake_run(tmp_path, f"k{k}", methods=("baseline", "tree_cache"))
        cfg = (run / "config.yaml").read_text()
        (run / "config.yaml").write_text(cfg + f"method:\n  max_spec_tokens: {k}\n")
    col = collect([tmp_path], progress=False)
    assert set(col.table.method) == {"baseline", "tree_cache [max_spec_tokens=4]",
                                     "tree_cache [max_spec_tokens=8]"}


def test_no_runs_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunFolderError, match="no run folders under .*empty"):
        collect([tmp_path / "empty"], progress=False)


def test_cli_writes_csv_and_markdown(tmp_path, capsys):
    write_fake_run(tmp_path / "runs", "r", methods=("baseline", "tree_cache", "prefix_reuse"))
    main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "engine torch_ref" in printed and "tree_cache" in printed
    table = pd.read_csv(tmp_path / "out" / "results.csv")
    assert set(table.method) == {"baseline", "tree_cache", "prefix_reuse"}
    assert "| method | tokens_per_step" in (tmp_path / "out" / "results.md").read_text()


def test_metrics_follow_the_definitions_and_zero_denominators_are_nan(tmp_path):
    run_dir = write_fake_run(tmp_path, "r", methods=("baseline", "tree_cache"))
    _, _, rollouts, steps = load_run(run_dir)
    s = summarize(rollouts, steps, by=("method",)).set_index("method")
    assert s.at["baseline", "tokens_per_step"] == 1.0
    assert math.isnan(s.at["baseline", "acceptance_rate"])
    assert math.isnan(s.at["baseline", "mean_acceptance_length"])
    t = rollouts[rollouts.method == "tree_cache"]
    assert s.at["tree_cache", "mean_acceptance_length"] == pytest.approx(
        1 + t.num_accepted_tokens.sum() / t.num_drafts.sum())
    assert s.at["tree_cache", "tokens_per_step"] == pytest.approx(
        t.output_len.sum() / t.num_forward_passes.sum())
    per_step = summarize(rollouts, steps, by=("method",), per_step=True)
    assert math.isnan(per_step.query("method == 'tree_cache' and step == 0").acceptance_rate.iloc[0])


def test_accepted_lengths_from_per_position_counts():
    # 5 drafts; 4 accepted their first token, 2 their second, none a third
    assert accepted_lengths([4, 2, 0], 5).tolist() == [1, 2, 2, 0]
    assert accepted_lengths([], 0).tolist() == [0]


def test_runs_without_finished_units_are_a_clear_error(tmp_path):
    from bench.report.results import RunWriter
    from results_fixtures import run_config
    RunWriter(tmp_path / "started", run_config(), {})
    with pytest.raises(RunFolderError, match="no finished"):
        collect([tmp_path], progress=False)


HW = {"cpu": "Xeon 8480", "cores": 16, "platform": "Linux-6.1-x86_64"}


def test_refuses_to_pair_runs_whose_engine_settings_or_hardware_differ(tmp_path):
    one = {"device": "cpu", "dtype": "float32", "threads": 1}
    write_fake_run(tmp_path, "base", methods=("baseline",), engine_settings=one, hardware=HW)
    # the same machine after a kernel update: the platform string is not part of the hardware
    same = write_fake_run(tmp_path, "tree_same", methods=("tree_cache",), engine_settings=one,
                          hardware={**HW, "platform": "Linux-6.8-x86_64"})
    write_fake_run(tmp_path, "tree_threads4", methods=("tree_cache",),
                   engine_settings={**one, "threads": 4}, hardware=HW)
    write_fake_run(tmp_path, "tree_gpu_box", methods=("tree_cache",), engine_settings=one,
                   hardware={**HW, "gpu": "H100", "gpu_count": 1})
    col = collect([tmp_path], progress=False)
    t = col.table.set_index("run_id")
    assert len(t) == 4  # one row per setup, none dropped as a duplicate of another
    base_wall = _wall(tmp_path / "base", "baseline")
    assert t.at["tree_same", "speedup"] == pytest.approx(base_wall.mean() / _wall(same, "tree_cache").mean())
    assert t.at["tree_same", "baseline_run"] == "base"
    for rid in ("tree_threads4", "tree_gpu_box"):
        assert math.isnan(t.at[rid, "speedup"]) and math.isnan(t.at[rid, "reward_delta"])
        assert pd.isna(t.at[rid, "baseline_run"])
        assert any(n.startswith("no 'baseline' run with the same setup") and rid in n
                   and "base ran with other engine settings or hardware" in n for n in col.notes)
    assert "threads=4" in t.at["tree_threads4", "engine_config"]
    assert "gpu=H100" in t.at["tree_gpu_box", "hardware"]
    assert "platform" not in t.at["tree_same", "hardware"]
    assert report(col).count("engine settings: ") == 3  # threads=1 x 2 machines, threads=4


def test_several_matching_baselines_are_not_picked_from(tmp_path):
    write_fake_run(tmp_path, "base_a", methods=("baseline",), hardware=HW)
    write_fake_run(tmp_path, "base_b", methods=("baseline",), hardware=HW, wall_scale=0.5)
    write_fake_run(tmp_path, "tree", methods=("tree_cache",), hardware=HW)
    both = write_fake_run(tmp_path, "both", methods=("baseline", "history_spec"), hardware=HW)
    col = collect([tmp_path], progress=False)
    t = col.table.set_index("method")
    assert math.isnan(t.at["tree_cache", "speedup"])
    assert any("run tree: 3 'baseline' runs have its setup" in n and "base_a, base_b, both" in n
               for n in col.notes)
    # a method whose own run has the baseline is compared with that one
    assert t.at["history_spec", "baseline_run"] == "both"
    assert t.at["history_spec", "speedup"] == pytest.approx(
        _wall(both, "baseline").mean() / _wall(both, "history_spec").mean())


def test_identity_columns_for_exact_methods_on_a_coupled_engine(tmp_path):
    from bench.report.results import RunWriter
    from results_fixtures import run_config, unit_rows
    methods = ("baseline", "tree_cache", "history_spec", "prefix_reuse")
    rules = {"baseline": "exact", "tree_cache": "exact", "history_spec": "exact", "prefix_reuse": "ratio"}
    writer = RunWriter(tmp_path / "ref", run_config(methods=methods, engine_settings={"dtype": "float32"},
                                                   rules=rules), {})
    for step in range(2):
        for m in methods:
            rows, srow = unit_rows(step, m)
            for r in rows:
                r["margins"] = [0.2] * len(r["output_tokens"])
            if step == 1:  # slot (1, p0, 0): token 3 is a near-tie in the baseline
                slot = rows[0]
                slot["margins"][3] = 1e-7
                if m in ("tree_cache", "history_spec"):  # both emit another token there
                    slot["output_tokens"] = slot["output_tokens"][:3] + [99] + slot["output_tokens"][4:]
                if m == "tree_cache":  # ... but tree_cache's is far from its CDF boundary: a rule bug
                    slot["margins"][3] = 0.2
            writer.write_unit(step, m, rows, srow)
    writer.finish()
    write_fake_run(tmp_path, "vllm_run", engine="vllm", methods=("baseline", "tree_cache"), rules=rules)
    col = collect([tmp_path], progress=False)
    t = col.table.set_index(["engine", "method"])
    slots = 2 * 8
    for m in ("tree_cache", "history_spec"):
        assert t.at[("torch_ref", m), "identity_rate"] == pytest.approx((slots - 1) / slots)
    assert t.at[("torch_ref", "tree_cache"), "rule_divergences"] == 1
    assert t.at[("torch_ref", "history_spec"), "rule_divergences"] == 0  # a near-tie of float32
    for blank in [("torch_ref", "baseline"), ("torch_ref", "prefix_reuse"), ("vllm", "tree_cache")]:
        assert math.isnan(t.at[blank, "identity_rate"]) and math.isnan(t.at[blank, "rule_divergences"])
    assert "| identity_rate | rule_divergences |" in report(col)
