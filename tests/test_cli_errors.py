"""Bad input ends the command before anything is written: one line on stderr naming the value and
the fix, exit status 2, no run folder created or changed. A resume that differs only in where or
how verbosely results are written proceeds."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import cli
from bench.core.errors import DEBUG_ENV, UserError, run_main
from bench.report.results import ConfigMismatchError, RunWriter, load_run
from results_fixtures import run_config, write_fake_run

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)


def _snapshot(root: Path) -> dict[str, str] | None:
    """Every file under root with a digest of its bytes (None: root does not exist)."""
    if not root.exists():
        return None
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _args(tmp_path, *overrides):
    return ["trace=countdown_tiny", "plots=false", "progress=false", f"results_root={tmp_path / 'runs'}",
            f"figures_root={tmp_path / 'figs'}", *overrides]


def _refused(monkeypatch, capsys, tmp_path, *overrides) -> str:
    """Run the CLI's entry point in this process; the one error line it printed."""
    before = _snapshot(tmp_path / "runs")
    monkeypatch.setattr(sys, "argv", ["bench.harness.cli", *_args(tmp_path, *overrides)])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert _snapshot(tmp_path / "runs") == before, "the run folder was created or changed"
    assert not (tmp_path / "figs").exists()
    return lines[0]


def _cli(tmp_path, *overrides):
    return subprocess.run([sys.executable, "-m", "bench.harness.cli", *_args(tmp_path, *overrides)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, DEBUG_ENV: ""})


@pytest.mark.parametrize("overrides,says", [
    (["trace=custom", "trace.path=no/such/trace"], r"no/such/trace/trace.yaml not found"),
    (["trace=custom"], r"trace.path must be set"),
    (["steps=[0,99]"], r"steps=\[0, 99\]: trace 'countdown-tiny' has steps \[0, 1, 2, 3, 4, 5\]"),
    (["max_steps=0"], r"max_steps must be null or an int >= 1, got 0"),
    (["timing_repeats=0"], r"timing_repeats must be an int >= 1, got 0"),
    (["engine.name=tensorrt"], r"engine.name='tensorrt' is not an engine; choose one of"),
    (["engine.dtype=float8"], r"engine.dtype must be one of .* got 'float8'"),
    (["sampling.top_p=1.5"], r"sampling.top_p must be null or a float in \(0, 1\], got 1.5"),
    (["+sampling.temprature=0.5"], r"sampling has no key temprature"),
    (["method=tree_cache", "+method.tree_cache.drafter.max_spek_tokens=8"],
     r"method.tree_cache.drafter cannot be built: .*max_spek_tokens.*conf/method/tree_cache.yaml"),
    (["method=tree_cache", "method.tree_cache.drafter.max_spec_tokens=many"],
     r"method.tree_cache.drafter.max_spec_tokens='many' must be int"),
    (["method=baseline", "method.baseline.verify.rule=exactly"], r"method.baseline.verify.rule must be one of"),
    (["method=[baseline,tree_cache]", "method.tree_cache.verify.rule=greedy", "sampling.temperature=0.7"],
     r"method tree_cache: verify.rule=greedy .* sampling.temperature=0.7"),
], ids=["trace_path", "trace_path_unset", "step", "max_steps", "timing_repeats", "engine", "engine_knob", "sampling_value",
        "sampling_key", "knob", "knob_type", "verify_rule", "greedy_rule_at_positive_temperature"])
def test_bad_input_is_one_line_before_anything_is_written(monkeypatch, capsys, tmp_path, overrides, says):
    line = _refused(monkeypatch, capsys, tmp_path, *overrides)
    assert re.search(says, line), line


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_not_installed_names_the_install(monkeypatch, capsys, tmp_path):
    line = _refused(monkeypatch, capsys, tmp_path, "engine=vllm", "method=baseline")
    assert "pip install" in line and "engine=torch_ref" in line


def test_unknown_method_real_cli(tmp_path):
    res = _cli(tmp_path, "method=[baseline,tree_cahce]")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "no method named 'tree_cahce'; choose from" in lines[0] and "tree_cache" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_negative_temperature_real_cli_twice_creates_nothing(tmp_path):
    """The new user's session: the bad value is refused, and so is the rerun (for the same reason,
    not for a config mismatch with a half-made run folder)."""
    for progress in ("true", "false"):
        res = _cli(tmp_path, "method=baseline", "sampling.temperature=-1", f"progress={progress}")
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines() == [
            "error: sampling.temperature must be null or a float >= 0, got -1; fix it on the command line or in "
            "conf/sampling/"]
        assert not (tmp_path / "runs").exists()


def test_debug_switch_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv(DEBUG_ENV, "1")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored afterwards (debug mode sets it if unset)
    monkeypatch.setattr(sys, "argv", ["bench.harness.cli", *_args(tmp_path, "method=nope")])
    with pytest.raises(UserError, match="no method named 'nope'"):
        cli.main()


@pytest.mark.parametrize("part", ["steps.parquet", "rollouts.parquet"])
def test_corrupt_part_is_named_before_resume_and_in_collect(monkeypatch, capsys, tmp_path, part):
    from bench.report.collect import main as collect_main
    run_dir = write_fake_run(tmp_path / "runs", "half", methods=("baseline",), steps=2, finish=False)
    bad = run_dir / part / "step_00001__baseline.parquet"
    bad.write_bytes(bad.read_bytes()[:40])  # a truncated copy
    line = _refused(monkeypatch, capsys, tmp_path, "method=baseline", "run_id=half")
    assert f"{bad} is not a readable parquet file" in line
    assert f"Delete {run_dir / 'steps.parquet' / bad.name} and {run_dir / 'rollouts.parquet' / bad.name}" in line
    with pytest.raises(SystemExit) as exc:
        run_main(lambda: collect_main([str(tmp_path / "runs")]))
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{bad} is not a readable parquet file" in lines[0]


def test_reopen_compares_identity_keys_only(tmp_path):
    config = {**run_config(), "run_id": None, "results_root": "results/runs", "figures_root": "results/figures",
              "progress": True, "plots": True}
    RunWriter(tmp_path / "r", config, {})
    moved = {**config, "run_id": "r", "results_root": str(tmp_path), "figures_root": "figs", "progress": False,
             "plots": False}
    RunWriter(tmp_path / "r", moved, {}, not_identity=cli.NOT_IDENTITY)  # proceeds
    with pytest.raises(ConfigMismatchError, match="progress"):  # without the list, every key counts
        RunWriter(tmp_path / "r", moved, {})
    changed = {**moved, "sampling": {**config["sampling"], "temperature": 0.5}}
    with pytest.raises(ConfigMismatchError, match=r"sampling.temperature \(1.0 -> 0.5\)"):
        RunWriter(tmp_path / "r", changed, {}, not_identity=cli.NOT_IDENTITY)
    assert "progress: true" in (tmp_path / "r" / "config.yaml").read_text()  # saved as first written


def test_resume_differing_only_in_output_options_proceeds(tmp_path):
    from hydra import compose, initialize_config_dir

    def cfg(*overrides):
        with initialize_config_dir(cli.CONF_DIR, version_base="1.3"):
            return compose("bench", overrides=["trace=countdown_tiny", "method=baseline", "max_steps=1",
                                               "engine.dtype=float64", *overrides])

    runs = tmp_path / "runs"
    first = cli.run(cfg(f"results_root={runs}", "progress=false", "plots=false"))
    # the same folder spelled another way, the run id given instead of derived, other output options
    again = cli.run(cfg(f"results_root={tmp_path}/./runs", f"figures_root={tmp_path / 'elsewhere'}", "progress=true",
                        f"run_id={first.name}", "plots=false"))
    assert again == first
    _, summary, _, steps = load_run(first)
    assert summary["status"] == "complete" and len(summary["resumed_at"]) == 1
    assert len(steps) == 1  # the finished unit was kept, not recomputed
