"""The harness end to end on the tiny recorded trace: exactness of every method, the oracle,
resume after a real kill, configs, sweeps and collection."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bench.harness.cli import CONF_DIR, run
from bench.report.collect import collect
from bench.engines.torch.engine import TorchRefEngine
from bench.harness.replay import MethodSpec, replay
from bench.report.results import RunWriter, load_run
from bench.traces.format import Trace
from bench.core.verify import VerifyConfig
from methods.base import RolloutKey
from methods.baseline import Baseline
from methods.oracle import OracleDrafter

EXACT = ["baseline", "prefix_reuse_exact", "tree_cache", "tree_cache_tree", "tree_cache_runahead",
         "history_spec", "suffix_global", "hybrid", "das", "seer", "draft_lm",
         "learned_tree", "eagle"]
ROOT = Path(__file__).resolve().parent.parent


def cfg_for(*overrides):
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("bench", overrides=["trace=countdown_tiny", "progress=false", "plots=false", *overrides])


def outputs(run_dir, method):
    _, _, rows, _ = load_run(run_dir)
    if "run_ahead" in rows:  # run-ahead rollouts only feed caches: not the slots being compared
        rows = rows[~rows["run_ahead"].fillna(False).astype(bool)]
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
    accepted = steps.groupby("method")["num_accepted_tokens"].sum().drop("baseline")
    if sampling == "greedy":  # identical siblings in lockstep: seer's tree of this step's group never runs ahead
        accepted = accepted.drop("seer")
    assert accepted.min() > 0
    assert steps.loc[steps["method"] == "baseline", "num_drafts"].sum() == 0
    if sampling == "trace":  # recorded with coupled sampling: the replay reproduces the recording
        assert steps.loc[steps["method"] == "baseline", "recorded_match_rate"].min() == 1.0


def test_oracle_replay_accepts_the_recorded_future(tmp_path):
    from bench.traces.record.cache import ensure_trace
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
    return [sys.executable, "-m", "bench.harness.cli", *flags, "trace=countdown_tiny", "plots=false", "progress=false",
            *[a for a in args if a != "-m"]]


RESUME_METHODS = ["baseline", "tree_cache_runahead", "hybrid", "suffix_global", "tree_cache_tree",
                  "history_spec", "draft_lm", "eagle"]
TIMES = {"run_id", "wall_s", "tokens_per_s", "first_token_s", "last_token_s",
         "drafter_train_s", "drafter_feature_s"}  # measured, not counted


def _counted(frame):
    """Every column but the measured times, sorted into one canonical order, as plain values."""
    cols = ["step", "method"] + [c for c in ("run_ahead", "prompt_id", "sample_idx") if c in frame]
    frame = frame.sort_values(cols).reset_index(drop=True)
    plain = lambda v: (list(v) if hasattr(v, "__len__") and not isinstance(v, str)
                       else None if pd.isna(v) else v)
    return {c: [plain(v) for v in frame[c]] for c in sorted(set(frame.columns) - TIMES)}


def _assert_same_run(a_dir, b_dir, ignore=()):
    _, _, a_rows, a_steps = load_run(a_dir)
    _, _, b_rows, b_steps = load_run(b_dir)
    a_steps, b_steps = (s.drop(columns=[c for c in ignore if c in s]) for s in (a_steps, b_steps))
    assert not a_steps.duplicated(["step", "method"]).any()
    assert not a_rows.duplicated(["step", "method", "prompt_id", "sample_idx"]).any()
    ra, rb = _counted(a_rows), _counted(b_rows)
    assert ra.keys() == rb.keys()
    for col in ra:  # tokens, logprobs, every per-rollout counter, run-ahead rollouts included
        assert ra[col] == rb[col], f"rollouts column {col} differs from the uninterrupted run"
    sa, sb = _counted(a_steps), _counted(b_steps)
    for col in sa.keys() | sb.keys():  # per-step counters and every drafter statistic
        assert sa.get(col) == sb.get(col), f"steps column {col} differs from the uninterrupted run"


def test_resume_at_every_unit_boundary_equals_the_uninterrupted_run(tmp_path):
    """5 steps x 6 methods, the run killed after every single unit and resumed each time."""
    from bench.harness.cli import method_specs
    from bench.traces.record.cache import ensure_trace
    from bench.harness.replay import ReplayInterrupted
    trace = Trace.load(ensure_trace("countdown-tiny", tiny=True))
    cfg = cfg_for("method=[" + ",".join(RESUME_METHODS) + "]", "engine.dtype=float64")
    config = {"trace": {"name": trace.name}, "engine": {"name": "torch_ref"}, "methods": RESUME_METHODS}
    steps, sampling = trace.step_numbers[:5], trace.sampling.to_config()
    labels = {"trace": trace.name, "engine": "torch_ref"}
    engine = TorchRefEngine(dtype="float64")
    replay(trace, engine, method_specs(cfg), sampling, RunWriter(tmp_path / "whole", config), steps,
           progress=False, labels=labels)
    restarts = 0
    while True:  # each pass: a new writer and new drafters, as a new process would have
        try:
            replay(trace, TorchRefEngine(dtype="float64"), method_specs(cfg), sampling,
                   RunWriter(tmp_path / "killed", config), steps, progress=False, labels=labels,
                   stop_after_units=1)
            break
        except ReplayInterrupted:
            restarts += 1
    assert restarts == len(steps) * len(RESUME_METHODS)
    _, summary, _, _ = load_run(tmp_path / "killed")
    assert summary["status"] == "complete" and len(summary["resumed_at"]) == restarts
    # only the latest drafter snapshot per method is kept
    assert len(list((tmp_path / "killed" / "drafters").glob("*.pkl"))) == len(RESUME_METHODS)
    _assert_same_run(tmp_path / "killed", tmp_path / "whole")


def test_timing_repeats_keep_the_median_repeat_and_change_no_count(tmp_path):
    """Each unit timed three times, in rounds of every method, every repeat from the step's starting
    drafter state: every token and counter, and every later draft, equals the once-timed run's
    (the fixed policy reads no clock), and the kept seconds are the median of the three."""
    from bench.harness.cli import method_specs
    from bench.traces.record.cache import ensure_trace
    trace = Trace.load(ensure_trace("countdown-tiny", tiny=True))
    cfg = cfg_for("method=[" + ",".join(RESUME_METHODS) + "]", "engine.dtype=float64")
    config = {"trace": {"name": trace.name}, "engine": {"name": "torch_ref"}, "methods": RESUME_METHODS}
    steps, labels = trace.step_numbers[:3], {"trace": trace.name, "engine": "torch_ref"}
    for name, repeats in (("once", 1), ("thrice", 3)):
        replay(trace, TorchRefEngine(dtype="float64"), method_specs(cfg), trace.sampling.to_config(),
               RunWriter(tmp_path / name, config), steps, progress=False, labels=labels, timing_repeats=repeats)
    _, _, _, thrice = load_run(tmp_path / "thrice")
    assert len(thrice) == len(steps) * len(RESUME_METHODS) and (thrice["timing_repeats"] == 3).all()
    assert ((thrice["wall_s_min"] <= thrice["wall_s"]) & (thrice["wall_s"] <= thrice["wall_s_max"])).all()
    assert (thrice["wall_s_min"] < thrice["wall_s_max"]).all()  # three timings, not one kept thrice
    assert "timing_repeats" not in load_run(tmp_path / "once")[3]
    _assert_same_run(tmp_path / "thrice", tmp_path / "once", ignore=("timing_repeats", "wall_s_min", "wall_s_max"))


def test_interleaved_timing_changes_no_token_or_count_and_resumes(tmp_path, monkeypatch):
    """interleave=true runs a step's methods together, a few iterations of each in turn, each on its
    own engine: every token, counter and later draft equals the one-after-the-other run's (the
    fixed policy reads no clock), in turns of 1 iteration with timing repeats and in turns of 3
    when killed after every unit and resumed; and the iterations really alternate between the
    methods' engines."""
    from bench.harness.cli import method_specs
    from bench.traces.record.cache import ensure_trace
    from bench.harness.replay import ReplayInterrupted
    trace = Trace.load(ensure_trace("countdown-tiny", tiny=True))
    cfg = cfg_for("method=[" + ",".join(RESUME_METHODS) + "]", "engine.dtype=float64")
    config = {"trace": {"name": trace.name}, "engine": {"name": "torch_ref"}, "methods": RESUME_METHODS}
    steps, sampling = trace.step_numbers[:3], trace.sampling.to_config()
    labels = {"trace": trace.name, "engine": "torch_ref"}
    replay(trace, TorchRefEngine(dtype="float64"), method_specs(cfg), sampling, RunWriter(tmp_path / "one", config),
           steps, progress=False, labels=labels)
    order = []
    from bench.spec.scheduler import Scheduler
    log_iteration = Scheduler._log

    def spy(self, *args):
        order.append(id(self.backend.engine))  # which method's engine ran this iteration
        return log_iteration(self, *args)

    monkeypatch.setattr(Scheduler, "_log", spy)
    replay(trace, TorchRefEngine(dtype="float64"), method_specs(cfg), sampling,
           RunWriter(tmp_path / "together", config), steps, progress=False, labels=labels, timing_repeats=2,
           interleave=True, interleave_turn=1)
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert len(set(order)) == len(RESUME_METHODS) + 1  # one engine per method, and the replay's (its untimed first call)
    assert switches > len(order) / 2
    _, _, _, together = load_run(tmp_path / "together")
    assert (together["wall_s"] > 0).all() and (together["timing_repeats"] == 2).all()
    assert (together["interleaved"] == len(RESUME_METHODS)).all()
    _assert_same_run(tmp_path / "together", tmp_path / "one",
                     ignore=("timing_repeats", "wall_s_min", "wall_s_max", "interleaved"))
    restarts = 0
    while True:  # a unit commits when its step's interleaved calls end: a kill loses the step's others
        try:
            replay(trace, TorchRefEngine(dtype="float64"), method_specs(cfg), sampling,
                   RunWriter(tmp_path / "killed", config), steps, progress=False, labels=labels,
                   stop_after_units=1, interleave=True, interleave_turn=3)
            break
        except ReplayInterrupted:
            restarts += 1
    assert restarts == len(steps) * len(RESUME_METHODS)
    _assert_same_run(tmp_path / "killed", tmp_path / "one", ignore=("interleaved",))


def test_interleave_needs_an_engine_that_runs_one_iteration_at_a_time():
    from bench.core.errors import UserError
    from bench.harness.config_checks import check_interleave
    from bench.engines.vllm.adapter import VLLMEngine
    with pytest.raises(UserError, match="interleave=false"):
        check_interleave(cfg_for("engine=vllm", "interleave=true"), VLLMEngine)
    with pytest.raises(UserError, match="true or false"):
        check_interleave(cfg_for("interleave=3"), TorchRefEngine)
    with pytest.raises(UserError, match="interleave_turn=0"):
        check_interleave(cfg_for("interleave=true", "interleave_turn=0"), TorchRefEngine)


def test_resume_after_a_real_kill_mid_unit_equals_the_uninterrupted_run(tmp_path):
    from bench.traces.record.cache import ensure_trace
    ensure_trace("countdown-tiny", tiny=True)  # recorded before the clock starts
    common = ["method=[baseline,tree_cache,hybrid,tree_cache_runahead]", "engine.dtype=float64",
              "max_steps=5", f"results_root={tmp_path}"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(*common, "run_id=killed"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    parts = lambda: list((killed / "steps.parquet").glob("step_*"))
    while time.time() < deadline and len(parts()) < 6:
        time.sleep(0.01)
    time.sleep(0.05)  # into the next unit
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 6 <= len(parts()) < 20, "the kill must land mid-run"
    subprocess.run(_cli(*common, "run_id=killed"), cwd=ROOT, check=True, capture_output=True)
    subprocess.run(_cli(*common, "run_id=whole"), cwd=ROOT, check=True, capture_output=True)
    _, summary, _, steps = load_run(killed)
    assert summary["status"] == "complete" and summary.get("resumed_at") and len(steps) == 20
    _assert_same_run(killed, tmp_path / "whole")


def test_run_ahead_rollouts_are_stored_apart_and_do_not_copy_the_future(tmp_path):
    """Run-ahead samples of step s+1's prompts must be as (in)dependent of step s+1's rollouts as
    any other sample of the same policy: before they had their own key space, most were copies."""
    run_dir = run(cfg_for("method=[baseline,tree_cache_runahead]", "engine.dtype=float64", "max_steps=6",
                          f"results_root={tmp_path}"))
    _, _, rows, steps = load_run(run_dir)
    ahead = rows[rows["run_ahead"].astype(bool)]
    trained = rows[~rows["run_ahead"].astype(bool)]
    assert len(ahead) > 0 and (ahead["method"] == "tree_cache_runahead").all()
    assert (ahead["anticipates_step"] > ahead["step"]).all()
    n = trained["sample_idx"].max() + 1
    assert (ahead["sample_idx"] >= n).all()  # slots of their own, never a live trained rollout's
    # kept out of every metric: the steps row counts trained rollouts only
    per_step = steps.set_index(["method", "step"])["num_rollouts"].sort_index()
    assert per_step.to_dict() == trained.groupby(["method", "step"]).size().to_dict()

    # Audit: is a run-ahead sample (finished, or its partial output when aborted) the start of
    # one of the next step's rollouts of its prompt more often than an independent sample is?
    # The independent sample: the same request drawn by the same checkpoint under another seed.
    from dataclasses import replace
    from bench.core.engine_protocol import Request
    trace = Trace.load(str(load_run(run_dir)[0]["trace"]["path"]))
    base = trained[trained["method"] == "baseline"]
    future: dict = {}
    for s, p, toks in zip(base["step"], base["prompt_id"], base["output_tokens"]):
        future.setdefault((s, p), []).append(list(toks))
    starts_future = lambda toks, s, p: any(f[:len(toks)] == toks for f in future[(s, p)])
    engine, sampling = TorchRefEngine(dtype="float64"), replace(trace.sampling.to_config(), seed=12345)
    ra_hits = ref_hits = compared = 0
    for s, grp in ahead[ahead["output_len"] > 0].groupby("step"):
        engine.load(trace.checkpoint(int(s)))
        reqs = [Request(RolloutKey(p, int(i)), trace.prompts[p], int(s)) for p, i in zip(grp["prompt_id"], grp["sample_idx"])]
        independent = engine.rollout(reqs, sampling, Baseline(), VerifyConfig())
        for a, p, toks, other in zip(grp["anticipates_step"], grp["prompt_id"], grp["output_tokens"], independent):
            toks = list(toks)
            compared += 1
            ra_hits += starts_future(toks, int(a), p)
            ref_hits += starts_future(other.token_ids[:len(toks)], int(a), p)
    assert compared >= 30
    print(f"run-ahead samples that start a next-step rollout: {ra_hits}/{compared}; "
          f"independent samples of the same length: {ref_hits}/{compared}")
    assert ra_hits <= ref_hits + 0.1 * compared, (ra_hits, ref_hits, compared)


@pytest.mark.parametrize("group,options", [
    ("trace", ["countdown", "countdown_tiny"]), ("engine", ["torch_ref"]),
    ("sampling", ["trace", "greedy", "top_p"]), ("experiment", ["main", "smoke", "lenience", "smollm2"]),
    ("sweep", ["methods", "spec_tokens"])])
def test_every_config_composes(group, options):
    for opt in options:
        cfg = cfg_for(f"{group}={opt}")
        OmegaConf.to_container(cfg.method, resolve=True)
        assert cfg.method, f"{group}={opt} selects no method"


def test_an_experiment_overrides_the_root_settings():
    """The root config's own settings come first in its defaults list, so an experiment's win (they
    were silently dropped before: experiment=smollm2 ran without interleaving, smoke with every step)."""
    smollm2, smoke = cfg_for("experiment=smollm2"), cfg_for("experiment=smoke")
    assert smollm2.interleave is True and smollm2.engine.threads == 2
    assert smoke.max_steps == 3
    assert cfg_for("experiment=smoke", "max_steps=1").max_steps == 1  # the command line still wins


CONTROLS = {"baseline_again"}  # the A/A control: in experiment=smollm2, not in the default main job


def test_every_method_config_is_in_the_main_job():
    names = sorted(p.stem for p in (Path(CONF_DIR) / "method").glob("*.yaml") if p.stem not in CONTROLS)
    assert sorted(cfg_for().method) == names
    assert set(cfg_for("experiment=smollm2").method) == set(names) | CONTROLS
    copying = cfg_for("experiment=smollm2_copying")  # every method whose drafter is one of methods/'
    assert set(copying.method) == {m for m, c in cfg_for("experiment=smollm2").method.items()
                                   if c.drafter._target_.startswith("methods.")}
    assert copying.interleave is True and copying.steps == [19] and "baseline_again" in copying.method
    assert copying.trace == cfg_for("experiment=smollm2").trace and copying.engine.threads == 2


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


def test_each_timed_unit_starts_after_an_untimed_warm_up(tmp_path, monkeypatch):
    # torch_ref's warm_up (a one-token prefill of the step's requests) runs right before every
    # timed unit, after the drafter's feed: its pass is not on any method's clock, and it emits
    # nothing into the results
    calls = []
    original = TorchRefEngine.warm_up

    def spy(self, requests, sampling):
        calls.append(len(requests))
        return original(self, requests, sampling)

    monkeypatch.setattr(TorchRefEngine, "warm_up", spy)
    run_dir = run(cfg_for("method=[baseline,tree_cache]", "max_steps=3", f"results_root={tmp_path}"))
    _, _, rows, steps = load_run(run_dir)
    assert len(calls) == len(steps) == 6  # 3 steps x 2 methods
    per_unit = rows.groupby(["step", "method"]).size()  # the warm-up's rollouts are not among them
    assert sorted(calls) == sorted(per_unit)
    assert (rows["output_tokens"].map(len) > 1).any()  # the timed units kept their own max_new_tokens


def test_timing_repeats_start_every_repeat_from_the_same_policy_evidence(tmp_path):
    """Under throughput_optimal the policy carries each drafter's fits into its next call; each
    timing repeat of a unit must start from the evidence carried into the step, not from the
    repeat before it, and the kept repeat's evidence is what the next step starts from."""
    from bench.harness.cli import method_specs
    from bench.traces.record.cache import ensure_trace
    from test_latency import grid_table
    trace = Trace.load(ensure_trace("countdown-tiny", tiny=True))
    cfg = cfg_for("method=[baseline,tree_cache]", "engine.dtype=float64")
    table = tmp_path / "table.csv"
    grid_table(lambda r, q, c: 1e-4 * (1 + r * q / 8)).frame.to_csv(table, index=False)
    engine = TorchRefEngine(dtype="float64", spec_policy="throughput_optimal", latency_table=str(table))
    seen, after = [], []
    rollout = engine.rollout

    def recording(requests, sampling, drafter, verify, run_ahead=None):
        if drafter.name == "tree_cache" and len(requests) > 1:  # not the warm-up's single rows
            seen.append(engine.policy_state(drafter))
            out = rollout(requests, sampling, drafter, verify, run_ahead=run_ahead)
            after.append(engine.policy_state(drafter))
            return out
        return rollout(requests, sampling, drafter, verify, run_ahead=run_ahead)

    engine.rollout = recording
    config = {"trace": {"name": trace.name}, "engine": {"name": "torch_ref"}, "methods": ["baseline", "tree_cache"]}
    replay(trace, engine, method_specs(cfg), trace.sampling.to_config(), RunWriter(tmp_path / "r", config),
           trace.step_numbers[:2], progress=False, labels={"trace": trace.name, "engine": "torch_ref"},
           timing_repeats=3)
    assert len(seen) == 6
    assert seen[0] == seen[1] == seen[2] == (None, None)  # the first step: no evidence yet, in every repeat
    assert seen[3] == seen[4] == seen[5] and seen[3][0] is not None
    assert seen[3] in after[:3]  # the second step starts from one of the first step's repeats
