"""Every knob is declared once (bench/knobs/) and the declarations cannot drift from the code: the
schemas equal the constructors' signatures and conf/'s YAML, every numeric knob of every method,
engine and sampling preset refuses a value outside its range in one line before anything is
written, unknown names are refused with the closest known one, the defaults validate, a sweep is
checked whole before its first job, and docs/methods.md is what the schemas generate."""
from __future__ import annotations

import inspect
import re
import sys
from dataclasses import fields
from pathlib import Path

import hydra
import pytest
import yaml

from bench.harness import cli
from bench.core.errors import DEBUG_ENV, UserError
from bench.knobs import Knob
from bench.knobs.check import validate
from bench.knobs.engines import ENGINES, SAMPLING, VERIFY
from bench.knobs.listing import docs_text
from bench.knobs.methods import DRAFTERS, METHODS
from bench.knobs.run import EXPERIMENT, TRACE

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
ENGINE_CLASSES = {"torch_ref": "bench.engines.torch.engine.TorchRefEngine", "vllm": "bench.engines.vllm.adapter.VLLMEngine",
                  "sglang": "bench.engines.sglang.adapter.SGLangEngine"}


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _params(obj) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(obj).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


# --- the schemas equal the code and the YAML -------------------------------------------------------

@pytest.mark.parametrize("target", sorted(DRAFTERS))
def test_drafter_schema_is_the_constructor_signature(target):
    params = _params(hydra.utils.get_object(target))
    assert [p.name for p in params] == [k.name for k in DRAFTERS[target]], target
    for p, knob in zip(params, DRAFTERS[target]):
        assert p.default == knob.default, f"{target}.{p.name}: constructor {p.default!r}, schema {knob.default!r}"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_schema_is_its_yaml(name):
    conf = _yaml(CONF / "method" / f"{name}.yaml")
    method = METHODS[name]
    drafter = dict(conf["drafter"])
    assert drafter.pop("_target_") == method.target
    knobs = {k.name: k.default for k in method.knobs()}
    drafter = {k: v for k, v in drafter.items() if not str(v).startswith("${")}  # interpolations resolve later
    assert drafter == {k: knobs[k] for k in drafter}, name
    assert conf.get("run_ahead", False) == method.run_ahead
    verify = conf.get("verify") or {}
    assert verify.get("rule", "exact") == method.rule and verify.get("lenience", 1.0) == method.lenience


def test_every_method_yaml_has_a_schema():
    assert {p.stem for p in (CONF / "method").glob("*.yaml")} == set(METHODS)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_engine_schema_is_the_constructor_and_its_yaml(name):
    module, cls = ENGINE_CLASSES[name].rsplit(".", 1)
    engine = getattr(pytest.importorskip(module), cls)  # the adapters import their engine lazily
    params = _params(engine)
    assert [p.name for p in params] == [k.name for k in ENGINES[name]]
    for p, knob in zip(params, ENGINES[name]):
        default = list(p.default) if isinstance(p.default, tuple) else p.default  # YAML has no tuples
        if default is None and knob.type in ("dict", "list") and not knob.nullable:
            default = type(knob.default)()  # the mutable-default idiom: None means empty
        assert default == knob.default, f"{name}.{p.name}: constructor {p.default!r}, schema {knob.default!r}"
    conf = _yaml(CONF / "engine" / f"{name}.yaml")
    assert conf.pop("name") == name
    assert set(conf) == {k.name for k in ENGINES[name]}, "every setting in the YAML, none unknown"


def test_sampling_schema_is_the_sampling_config():
    from bench.core.sampling import SamplingConfig
    assert [k.name for k in SAMPLING] == [f.name for f in fields(SamplingConfig) if f.name != "n"]
    for path in (CONF / "sampling").glob("*.yaml"):
        assert set(_yaml(path)) <= {k.name for k in SAMPLING}, path.name


def test_verify_schema_is_the_verify_config():
    from bench.core.verify import VerifyConfig
    assert [k.name for k in VERIFY] == [f.name for f in fields(VerifyConfig)]
    assert [k.default for k in VERIFY] == [f.default for f in fields(VerifyConfig)]


def test_trace_and_run_schemas_are_the_yaml():
    for path in (CONF / "trace").glob("*.yaml"):
        assert list(_yaml(path)) == [k.name for k in TRACE], path.name
    top = {k: v for k, v in _yaml(CONF / "bench.yaml").items() if k not in ("defaults", "hydra")}
    assert list(top) == [k.name for k in EXPERIMENT]
    assert top == {k.name: k.default for k in EXPERIMENT}


# --- every knob walked through the real entry point -------------------------------------------------

def _refused(monkeypatch, capsys, tmp_path, *overrides) -> str:
    """bench.harness.cli's entry point on ``overrides``: exit status 2, one line, nothing written."""
    args = ["trace=countdown_tiny", "plots=false", "progress=false", f"results_root={tmp_path / 'runs'}",
            f"figures_root={tmp_path / 'figs'}", *overrides]
    monkeypatch.setattr(sys, "argv", ["bench.harness.cli", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2, overrides
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not (tmp_path / "runs").exists() and not (tmp_path / "figs").exists()
    return lines[0]


def _yaml_value(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value) \
        if isinstance(value, str) else str(value)


def _bad_values() -> list[tuple[str, list[str], str]]:
    """(id, overrides, key the error must name) for every numeric or choice knob out of range."""
    cases = []
    for name, method in METHODS.items():
        for knob in method.knobs():
            for bad in knob.out_of_range():
                key = f"method.{name}.drafter.{knob.name}"
                cases.append((f"{key}={bad}", [f"method={name}", f"{key}={_yaml_value(bad)}"], key))
        for knob in method.entry_knobs()[1:]:
            for bad in knob.out_of_range():
                key = f"method.{name}.verify.{knob.name}"
                cases.append((f"{key}={bad}", [f"method={name}", f"{key}={_yaml_value(bad)}"], key))
    for engine, knobs in ENGINES.items():
        for knob in knobs:
            for bad in knob.out_of_range():
                cases.append((f"{engine}.{knob.name}={bad}", [f"engine={engine}", f"engine.{knob.name}="
                                                              f"{_yaml_value(bad)}"], f"engine.{knob.name}"))
    for preset in (p.stem for p in (CONF / "sampling").glob("*.yaml")):
        for knob in SAMPLING:
            for bad in knob.out_of_range():
                cases.append((f"{preset}.{knob.name}={bad}", [f"sampling={preset}", f"sampling.{knob.name}="
                                                              f"{_yaml_value(bad)}"], f"sampling.{knob.name}"))
    for knob in EXPERIMENT:
        for bad in knob.out_of_range():
            cases.append((f"{knob.name}={bad}", [f"{knob.name}={_yaml_value(bad)}"], knob.name))
    return cases


BAD = _bad_values()


UNBOUNDED = {"offset": "a draft budget offset may be negative", "seed": "any integer seeds the sampler"}


def test_the_walk_covers_every_numeric_knob():
    """Every int or float knob has a range (but the two that may take any value), so the walk tries it."""
    everything = [k for m in METHODS.values() for k in m.knobs()] + [k for e in ENGINES.values() for k in e]
    everything += [*SAMPLING, *EXPERIMENT, *VERIFY]
    numeric = [k for k in everything if k.type in ("int", "float")]
    assert len(numeric) > 50
    assert all(k.bounded for k in numeric if k.name not in UNBOUNDED), [k.name for k in numeric if not k.bounded]
    drafter = [(m, k.name) for m, method in METHODS.items() for k in method.knobs() if k.bounded]
    assert all(any(case.startswith(f"method.{m}.drafter.{k}=") for case, _, _ in BAD) for m, k in drafter)


def test_every_out_of_range_value_is_refused_before_anything_is_written(monkeypatch, capsys, tmp_path):
    """One entry-point call per case (about 300 of them, in-process: a second or two each would be
    minutes as subprocesses; the subprocess path is the next test)."""
    for case, overrides, key in BAD:
        line = _refused(monkeypatch, capsys, tmp_path, *overrides)
        assert f"{key} must be" in line, (case, line)


def test_the_issues_three_values_are_refused_by_the_real_command(tmp_path):
    import subprocess
    for overrides, says in [
        (["method=tree_cache", "method.tree_cache.drafter.max_spec_tokens=-5"],
         "method.tree_cache.drafter.max_spec_tokens must be an int >= 1, got -5"),
        (["method=das", "method.das.drafter.factor=-1"], "method.das.drafter.factor must be a float >= 0, got -1"),
        (["method=suffix_global", "method.suffix_global.drafter.min_prob=2"],
         "method.suffix_global.drafter.min_prob must be a float in [0, 1], got 2"),
    ]:
        done = subprocess.run([sys.executable, "-m", "bench.harness.cli", "trace=countdown_tiny",
                               f"results_root={tmp_path / 'runs'}", *overrides], cwd=ROOT, capture_output=True,
                              text=True)
        assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
        assert says in done.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_unknown_drafter_knob_is_refused_with_the_close_match(monkeypatch, capsys, tmp_path, name):
    knobs = [k.name for k in METHODS[name].knobs()]
    typo = (knobs[0][:-1] + "x") if knobs else "max_spec_tokens"
    for prefix in ("", "+"):  # Hydra's own 'not in struct' for the first, the schema's check for the second
        line = _refused(monkeypatch, capsys, tmp_path, f"method={name}", f"{prefix}method.{name}.drafter.{typo}=3")
        assert f"method.{name}.drafter" in line and typo in line, line
        if knobs:
            assert f"did you mean {knobs[0]}?" in line, line


@pytest.mark.parametrize("override,says", [
    ("engine.max_num_seq=3", "did you mean max_num_seqs?"),
    ("+sampling.temprature=0.5", "did you mean temperature?"),
    ("max_step=3", "did you mean max_steps?"),
    ("trace.tiney=true", "did you mean tiny?"),
    ("method.tree_cache.verify.rul=exact", "did you mean rule?"),
])
def test_unknown_names_elsewhere_are_refused(monkeypatch, capsys, tmp_path, override, says):
    extra = ["engine=vllm"] if override.startswith("engine.") else ["method=tree_cache"]
    assert says in _refused(monkeypatch, capsys, tmp_path, *extra, override)


def test_the_defaults_validate():
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for engine in ENGINES:
            for preset in (p.stem for p in (CONF / "sampling").glob("*.yaml")):
                cfg = compose("bench", overrides=[f"engine={engine}", f"sampling={preset}",
                                                  f"method=[{','.join(METHODS)}]"])
                validate(cfg)
        for experiment in (p.stem for p in (CONF / "experiment").glob("*.yaml")):
            validate(compose("bench", overrides=[f"experiment={experiment}"]))


def test_a_schema_refuses_what_it_should():
    knob = Knob("x", "float", 0.5, "a share", lo=0, hi=1, open_lo=True)
    from bench.knobs import check_value
    for bad, says in [(0, r"x must be a float in \(0, 1\], got 0"), (1.5, "got 1.5"), ("a", "must be float"),
                      (True, "must be float"), (None, "x=null must be")]:
        with pytest.raises(UserError, match=says):
            check_value(knob, "x", bad, "here")
    check_value(knob, "x", 1, "here")  # an int is a float


# --- sweeps, listings, docs ---------------------------------------------------------------------------

def test_a_sweep_is_checked_whole_before_its_first_job(monkeypatch, capsys, tmp_path):
    line = _refused(monkeypatch, capsys, tmp_path, "-m", "method=tree_cache",
                    "method.tree_cache.drafter.max_spec_tokens=8,-5", f"hydra.sweep.dir={tmp_path / 'multirun'}")
    assert re.search(r"sweep job 1 of 2 .*max_spec_tokens=-5.*must be an int >= 1.*no job was started", line), line
    assert not (tmp_path / "multirun").exists()


def test_sweeps_from_other_config_files_are_left_to_hydra():
    from bench.knobs.sweep import validate_sweep
    assert validate_sweep(str(CONF), "bench", ["-m", "method=no_such_method,baseline"], cli.check_job) == 0


def test_the_bundled_sweeps_expand_and_validate():
    from bench.harness.config_checks import check_methods
    from bench.knobs.sweep import job_overrides, validate_sweep
    assert [j[0] for j in job_overrides(str(CONF), "bench", ["-m", "sweep=spec_tokens"])] == [
        f"method.tree_cache.drafter.max_spec_tokens={k}" for k in (8, 16, 24)]
    assert validate_sweep(str(CONF), "bench", ["-m", "sweep=methods"], cli.check_job) == len(METHODS)
    assert validate_sweep(str(CONF), "bench", ["-m", "experiment=lenience"], cli.check_job) == 5
    assert validate_sweep(str(CONF), "train", ["-m"], check_methods) == 45


def test_listings(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.harness.cli", "--methods"])
    cli.main()
    out = capsys.readouterr().out
    assert all(re.search(rf"^{name}\s", out, re.M) for name in METHODS)
    monkeypatch.setattr(sys, "argv", ["bench.harness.cli", "method=das", "engine=vllm", "--knobs"])
    cli.main()
    out = capsys.readouterr().out
    assert "`drafter.window_steps` | int | `16` | an int >= 1 | released code" in out
    assert "engine `vllm`" in out and "`num_speculative_tokens`" in out and "## `tree_cache`" not in out
    monkeypatch.setattr(sys, "argv", ["bench.harness.cli", "-m", "method=das,tree_cache", "--knobs"])
    cli.main()
    out = capsys.readouterr().out
    assert "## `das`" in out and "## `tree_cache`" in out
    monkeypatch.setattr(sys, "argv", ["bench.harness.cli", "method=nope", "--knobs"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2 and "method=nope: no method" in capsys.readouterr().err


def test_docs_page_is_generated_from_the_schemas():
    assert (ROOT / "docs" / "methods.md").read_text() == docs_text(), "python -m bench.knobs docs --write"
