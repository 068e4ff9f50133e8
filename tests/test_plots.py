"""Figures: every kind written as non-empty PNG and PDF; the engine comparison only with >= 2 engines."""
from __future__ import annotations

from bench.plots import main, make_figures
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
