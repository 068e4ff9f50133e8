"""Figures: every kind written as non-empty PNG and PDF; the engine comparison only with >= 2 engines."""
from __future__ import annotations

from bench.report.plots import main, make_figures
from results_fixtures import write_fake_run

KINDS = ("speedup", "step_curves", "rollout_time", "accepted_length")


def _check(paths):
    assert paths and all(p.exists() and p.stat().st_size > 1000 for p in paths)
    for p in paths:
        head = p.read_bytes()[:8]
        assert head.startswith(b"\x89PNG") if p.suffix == ".png" else head.startswith(b"%PDF")


def test_one_engine_gets_every_figure_but_no_engine_comparison(tmp_path):
    write_fake_run(tmp_path / "runs", "r", methods=("baseline", "tree_cache", "prefix_reuse"))
    paths = make_figures([tmp_path / "runs"], tmp_path / "figs", progress=False)
    _check(paths)
    names = {p.name.split("__")[0] for p in paths}
    assert names == set(KINDS)
    assert {p.suffix for p in paths} == {".png", ".pdf"}


def test_two_engines_add_the_engine_comparison(tmp_path):
    write_fake_run(tmp_path / "runs", "ref", engine="torch_ref")
    write_fake_run(tmp_path / "runs", "vllm", engine="vllm")
    paths = main([str(tmp_path / "runs"), "--out", str(tmp_path / "figs")])
    _check(paths)
    engines = [p for p in paths if p.name.startswith("engines__")]
    assert len(engines) == 2  # one figure, PNG and PDF
    assert "torch_ref" in {p.name.split("__")[2] for p in paths if p.name.startswith("speedup")}


def test_group_without_baseline_skips_speedup_but_plots_the_rest(tmp_path):
    write_fake_run(tmp_path / "runs", "r", methods=("tree_cache",))
    paths = make_figures([tmp_path / "runs"], tmp_path / "figs", progress=False)
    _check(paths)
    assert not [p for p in paths if p.name.startswith("speedup")]


def test_several_setups_of_one_engine_beside_another_engine(tmp_path):
    """torch_ref from two machines and in two dtypes beside vLLM: every figure drawn, none
    overwritten (one file per setup), one engine comparison with a series per setup."""
    from bench.report.collect import collect
    from bench.report.plot_style import setup_id, setup_label
    small, big = {"cpu": "Xeon 2c", "cores": 2}, {"cpu": "EPYC, 16c", "cores": 16, "gpu": "H200", "gpu_count": 1}
    runs = tmp_path / "runs"
    write_fake_run(runs, "ref_small", engine="torch_ref", hardware=small, engine_settings={"dtype": "float32"})
    write_fake_run(runs, "ref_big", engine="torch_ref", hardware=big, engine_settings={"dtype": "float32"})
    write_fake_run(runs, "ref_big_bf16", engine="torch_ref", hardware=big, engine_settings={"dtype": "bfloat16"},
                   wall_scale=0.7)
    write_fake_run(runs, "vllm", engine="vllm", hardware=big, engine_settings={"dtype": "bfloat16"})
    col = collect([runs], progress=False)
    paths = make_figures(col, tmp_path / "figs")
    _check(paths)
    assert len(paths) == len(set(paths)), "a figure was written twice (overwritten)"
    setups = col.table[["engine", "engine_config", "hardware"]].drop_duplicates()
    assert len(setups) == 4
    ids = {setup_id(c, h) for c, h in zip(setups["engine_config"], setups["hardware"])}
    for kind in KINDS:  # one figure per setup and kind, named by its setup
        files = [p for p in paths if p.suffix == ".png" and p.name.startswith(kind + "__")]
        assert {p.name.split("__")[3] for p in files} == ids, kind
    assert len([p for p in paths if p.name.startswith("engines__")]) == 2  # PNG and PDF
    # titles and legends name what differs between the engine's setups, not the whole setup
    ref = setups[setups.engine == "torch_ref"]
    labels = {setup_label(col.table, "torch_ref", c, h) for c, h in zip(ref["engine_config"], ref["hardware"])}
    assert labels == {"cores=2, cpu=Xeon 2c, dtype=float32, gpu=unset, gpu_count=unset",
                      "cores=16, cpu=EPYC, 16c, dtype=float32, gpu=H200, gpu_count=1",
                      "cores=16, cpu=EPYC, 16c, dtype=bfloat16, gpu=H200, gpu_count=1"}
    v = setups[setups.engine == "vllm"].iloc[0]
    assert setup_label(col.table, "vllm", v.engine_config, v.hardware) == ""
