"""Each method's knobs declared once: every drafter constructor's parameters, and what each method sets.

    python -m bench.harness.cli method=das --knobs      # one method's table, from DRAFTERS and METHODS below

``DRAFTERS`` maps a drafter class (the ``_target_`` of conf/method/*.yaml) to its knobs, in the
constructor's order and with its defaults; ``METHODS`` lists each method config: the class, what it
drafts, its verify rule and the knobs it sets differently. tests/test_knobs.py checks both against
the constructors' signatures and the YAML files. Where each paper default comes from: docs/papers.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from methods.suffix.tree import BACKENDS
from methods.tree_cache import MATCH_RULES

from bench.knobs import Knob

SRT = "SRT (arXiv 2601.09083)"
SFX = "SuffixDecoding as released in ArcticInference / vLLM method: suffix"
DAS = "DAS (arXiv 2511.13841); community re-implementation kfswain/py-rl-scheduler"
RHYME = "RhymeRL HistoSpec (arXiv 2508.18588)"
SEER = "Seer (arXiv 2511.14617; code not public)"
SPEC_RL = "SPEC-RL (arXiv 2509.23232; ShopeeLLM/Spec-RL)"


def _tree(max_depth=64, max_spec_tokens=24, factor=1.0, min_prob=0.1, match="longest", source="paper",
          ref=SRT) -> dict[str, Knob]:
    """The suffix-tree drafting knobs SRT, DAS, Seer and SuffixDecoding share, with one family's defaults."""
    knobs = [
        Knob("max_depth", "int", max_depth, "deepest suffix kept in a trie (tokens)", source, ref, lo=1),
        Knob("max_spec_tokens", "int", max_spec_tokens, "most tokens one draft may hold", source, ref, lo=1),
        Knob("factor", "float", factor, "draft budget per matched token: min(max_spec_tokens, factor x match "
             "length + offset)", source, ref, lo=0),
        Knob("offset", "float", 0.0, "draft budget added to factor x match length (may be negative)",
             "released code", SFX),
        Knob("min_prob", "float", min_prob, "a draft stops where its path probability falls below this",
             source, ref, lo=0, hi=1),
        Knob("tree", "bool", False, "best-first token trees instead of one chain", source, ref),
        Knob("in_flight", "bool", True, "running siblings' tokens enter the trie as they are generated",
             source, ref),
        Knob("history", "bool", True, "earlier steps' rollouts stay in the trie", source, ref),
        Knob("run_ahead", "bool", False, "recorded with the run (the harness schedules run-ahead from the "
             "method's run_ahead)", source, ref),
        Knob("match", "str", match, "longest: the longest suffix match drafts; best: the best score over "
             "match lengths (SuffixDecoding)", source, ref, choices=MATCH_RULES),
        Knob("backend", "str", "auto", "suffix tree: auto (compiled where built, else native where installed "
             "and exact, else python), compiled (the automaton in C), python, native (arctic-inference), trie "
             "(reference)", "suite", choices=BACKENDS),
    ]
    return {k.name: k for k in knobs}


def _pick(knobs: dict[str, Knob], *names: str) -> tuple[Knob, ...]:
    return tuple(knobs[n] for n in names)


_LEARNED = {k.name: k for k in (  # the training schedule and guard both learned drafters share
    Knob("draft_vocab", "int", 0, "draft vocabulary: the warm-up data's this many most frequent tokens (0: "
         "every token it holds); others are never drafted", "suite", lo=0),
    Knob("lr", "float", 3e-3, "AdamW learning rate of the warm-up and the updates", "suite", lo=0,
         open_lo=True),
    Knob("batch_windows", "int", 32, "windows in one optimizer step", "suite", lo=1),
    Knob("warmup_steps", "int", 300, "optimizer steps of the warm-up, before the first step drafted "
         "(TLT's warm-up drafter)", "suite", lo=0),
    Knob("update_every", "int", 1, "steps between updates (0: frozen after the warm-up)", "suite", lo=0),
    Knob("update_steps", "int", 20, "optimizer steps of one update", "suite", lo=0),
    Knob("history_steps", "int", 4, "training reads the rollouts of this many recent steps", "suite", lo=1),
    Knob("lag", "int", 0, "steps held back from training (0: the drafter has every finished step)", "suite",
         lo=0),
    Knob("guard_steps", "int", 4, "stale-drafter guard: a step's acceptance is judged against the median "
         "of this many earlier steps", "suite", lo=1),
    Knob("collapse_ratio", "float", 0.5, "stale-drafter guard: flagged below this share of that median",
         "suite", lo=0, hi=1),
)}


_SRT = _tree()
_DAS = _tree(max_depth=24, factor=2.0, match="best", source="released code", ref=DAS)
_SFX = _tree(max_depth=24, source="released code", ref=SFX)
_PREFIX = Knob("max_spec_tokens", "int", None, "most tokens of the previous response drafted (null: all of "
               "it; the engine budget still caps it)", "released code", SPEC_RL, lo=1, nullable=True)

DRAFTERS: dict[str, tuple[Knob, ...]] = {
    "methods.baseline.Baseline": (),
    "methods.prefix_reuse.PrefixReuseDrafter": (_PREFIX,),
    "methods.tree_cache.TreeCacheDrafter": tuple(_SRT.values()),
    "methods.history_spec.HistorySpecDrafter": (
        Knob("window", "int", 7, "pattern: the last this many tokens of the context", "paper", RHYME, lo=1),
        Knob("min_match", "int", 4, "shortest suffix match that may draft", "paper", RHYME, lo=1),
        Knob("min_prob", "float", 0.1, "follow the top child while the path probability is at least this",
             "paper", RHYME, lo=0, hi=1),
        Knob("min_spec_tokens", "int", 2, "AIMD draft length: start and floor (halved on a rejection)",
             "paper", RHYME, lo=1),
        Knob("max_spec_tokens", "int", 16, "AIMD draft length: ceiling (doubled when all are accepted)",
             "paper", RHYME, lo=1),
        Knob("max_depth", "int", 24, "deepest suffix kept (>= window + max_spec_tokens)", "suite", lo=1),
        _SRT["backend"],
    ),
    "methods.suffix_global.SuffixGlobalDrafter": (
        _SFX["max_depth"],
        Knob("max_cached_responses", "int", 10000, "responses kept in the global trie, oldest evicted first",
             "released code", SFX, lo=1),
        _SFX["max_spec_tokens"].with_default(24, "suite", "SRT's budget, so the tree methods compare at one"),
        *_pick(_SFX, "factor", "offset", "min_prob", "tree"),
        _SFX["in_flight"].with_default(True, ref=SFX + " (add_active_response)"),
        _SFX["backend"],
    ),
    "methods.hybrid.HybridDrafter": (
        Knob("prefix_max_spec_tokens", "int", None, "the first draft: most tokens of the slot's previous "
            "response (null: all of it)", "suite", lo=1, nullable=True),
        *_pick(_SRT, "max_depth", "max_spec_tokens", "factor", "offset", "min_prob", "tree", "run_ahead",
               "match", "backend"),
    ),
    "methods.das.DASDrafter": (
        *_pick(_DAS, "max_depth", "max_spec_tokens", "factor", "offset", "min_prob", "tree", "match"),
        Knob("window_steps", "int", 16, "rollouts older than this many steps leave the trie (window_iterations)",
             "released code", DAS, lo=1),
        Knob("recent_steps", "int", 2, "rollouts of the last this many steps count recent_weight times "
             "(fresh_iterations)", "released code", DAS, lo=0),
        Knob("recent_weight", "int", 2, "how many times a recent rollout counts", "released code", DAS, lo=1),
        Knob("long_budget", "int", 24, "draft budget of a long request (= num_speculative_tokens)",
             "released code", DAS, lo=0),
        Knob("medium_budget", "int", 8, "draft budget of a medium request", "suite", lo=0),
        Knob("short_budget", "int", 0, "draft budget of a short request (the paper: short ones skip drafting)",
             "paper", DAS, lo=0),
        Knob("short_max", "float", 0.0625, "short below this length (fraction of the cap, or tokens)", "suite",
             lo=0),
        Knob("long_min", "float", 0.25, "long from this length (fraction of the cap, or tokens; >= short_max)",
             "suite", lo=0),
        Knob("length_unit", "str", "cap", "cap: lengths as fractions of max_new_tokens; tokens: absolute",
             "suite", choices=("cap", "tokens")),
        Knob("ema_alpha", "float", 0.2, "weight of the newest rollout in each prompt's moving-average length",
             "suite", lo=0, hi=1, open_lo=True),
        _DAS["backend"],
    ),
    "methods.seer.SeerDrafter": (
        *(k.with_default(k.default, ref=SRT + ": Seer's own values are not public") for k in
          _pick(_SRT, "max_depth", "max_spec_tokens", "factor", "offset", "min_prob", "tree", "match")),
        Knob("history", "bool", False, "false: the group's trie holds this step's siblings only; true: earlier "
             "visits too", "paper", SEER),
        Knob("max_batch_draft_tokens", "int", 128, "draft tokens per engine iteration, longest-running rows "
             "first (null: no pool)", "suite", lo=0, nullable=True),
        _SRT["backend"],
    ),
    "bench.drafters.learned.DraftLMDrafter": (
        Knob("max_spec_tokens", "int", 6, "tokens of the greedy chain the draft model drafts", "suite", lo=1),
        Knob("window", "int", 32, "context the draft model reads: the last this many tokens", "suite", lo=1),
        Knob("layers", "int", 2, "draft model decoder layers", "suite", lo=1),
        Knob("hidden", "int", 128, "draft model hidden size (a multiple of heads)", "suite", lo=1),
        Knob("heads", "int", 4, "draft model attention heads", "suite", lo=1),
        *_pick(_LEARNED, "draft_vocab", "lr", "batch_windows", "warmup_steps", "update_every", "update_steps",
               "history_steps", "lag", "guard_steps", "collapse_ratio"),
        Knob("seed", "int", 0, "draft model initialisation and training windows", "suite", lo=0),
    ),
    "bench.drafters.eagle.EagleDrafter": (
        Knob("max_spec_tokens", "int", 6, "tokens of the greedy chain the head drafts", "suite", lo=1),
        Knob("window", "int", 32, "(feature, token) pairs the head reads: the row's last this many", "suite", lo=1),
        *_pick(_LEARNED, "draft_vocab", "lr", "batch_windows", "warmup_steps", "update_every", "update_steps",
               "history_steps", "lag"),
        Knob("feature_rollouts", "int", 64, "rollouts a step whose features are kept while they generate; also "
             "how many shown-only rollouts the policy computes features for in a training round", "suite", lo=1),
        *_pick(_LEARNED, "guard_steps", "collapse_ratio"),
        Knob("seed", "int", 0, "head initialisation and training windows", "suite", lo=0),
    ),
    "bench.drafters.learned_tree.LearnedTreeDrafter": (
        Knob("order", "str", "tree_first", "tree_first: the tree where its draft is long, else the draft model; "
             "learned_first: the draft model where it is confident, else the tree", "suite",
             choices=("tree_first", "learned_first")),
        Knob("tree_min_tokens", "int", 4, "tree_first: the tree drafts when its draft holds at least this many "
             "tokens", "suite", lo=1),
        Knob("learned_min_prob", "float", 0.3, "learned_first: the draft model's chain is cut where its path "
             "probability falls below this", "suite", lo=0, hi=1),
        _SRT["max_spec_tokens"],
        Knob("learned_max_spec_tokens", "int", 6, "tokens of the draft model's chain", "suite", lo=1),
        *(k for k in (Knob("warmup_steps", "int", 300, "draft model: optimizer steps of the warm-up", "suite", lo=0),
                      Knob("update_every", "int", 1, "draft model: steps between updates (0: frozen)", "suite",
                           lo=0),
                      Knob("update_steps", "int", 20, "draft model: optimizer steps of one update", "suite", lo=0),
                      Knob("history_steps", "int", 4, "draft model: training reads this many recent steps",
                           "suite", lo=1),
                      Knob("seed", "int", 0, "draft model initialisation and training windows", "suite", lo=0))),
    ),
}


@dataclass
class Method:
    """One conf/method/NAME.yaml: its drafter class, what it drafts, its verify rule, its knob changes."""

    name: str
    target: str
    drafts: str
    verify: str  # the rule in words, for the listing
    rule: str = "exact"
    lenience: float = 1.0
    run_ahead: bool = False
    changes: dict[str, tuple] = field(default_factory=dict)  # knob -> (default, source, ref)

    def knobs(self) -> tuple[Knob, ...]:
        """The drafter's knobs with this method's defaults."""
        return tuple(k.with_default(*self.changes[k.name]) if k.name in self.changes else k
                     for k in DRAFTERS[self.target])

    def entry_knobs(self) -> tuple[Knob, ...]:
        """The method entry's own settings beside ``drafter``: run_ahead and the verify rule."""
        from bench.knobs.engines import VERIFY
        rule, lenience = VERIFY
        lossy = self.rule == "ratio"
        return (Knob("run_ahead", "bool", self.run_ahead, "admit next-step prompts when the batch shrinks "
                     "(their tokens feed the drafter only)", "paper" if self.run_ahead else "suite",
                     SRT if self.run_ahead else ""),
                rule.with_default(self.rule, "released code" if lossy else "suite", SPEC_RL if lossy else ""),
                lenience.with_default(self.lenience, "paper" if lossy else "suite",
                                      SPEC_RL + ": GRPO e^0.5" if lossy else ""))


_TREE = "methods.tree_cache.TreeCacheDrafter"
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("baseline", "methods.baseline.Baseline", "nothing", "-"),
    Method("baseline_again", "methods.baseline.Baseline",
           "nothing: the baseline a second time, an A/A control whose speedup is the run's noise floor", "-"),
    Method("prefix_reuse", "methods.prefix_reuse.PrefixReuseDrafter",
           "SPEC-RL: the slot's previous rollout as one long draft", "ratio, lenience e^0.5 (lossy, as released)",
           rule="ratio", lenience=1.6487212707001282),
    Method("prefix_reuse_exact", "methods.prefix_reuse.PrefixReuseDrafter", "the same draft as prefix_reuse",
           "exact (lossless)"),
    Method("tree_cache", _TREE, "SRT: per-prompt suffix trie of earlier rollouts + in-flight sibling tokens, "
           "longest match", "exact"),
    Method("tree_cache_tree", _TREE, "tree_cache with best-first token trees", "exact",
           changes={"tree": (True, "suite", "an ablation: SRT's structure supports trees, the paper uses chains")}),
    Method("tree_cache_runahead", _TREE, "tree_cache with run-ahead of next-step prompts", "exact",
           run_ahead=True, changes={"run_ahead": (True, "paper", SRT)}),
    Method("history_spec", "methods.history_spec.HistorySpecDrafter",
           "RhymeRL HistoSpec: trie of the last visit only, first hit, AIMD length", "exact"),
    Method("suffix_global", "methods.suffix_global.SuffixGlobalDrafter",
           "SuffixDecoding as released: one global trie (running responses included) + the request's own",
           "exact"),
    Method("hybrid", "methods.hybrid.HybridDrafter",
           "ours: prefix reuse first, then the tree cache after the first rejection", "exact"),
    Method("das", "methods.das.DASDrafter", "DAS: per-prompt trie over the last 16 steps, draft budget by "
           "length class (long 24, medium 8, short 0)", "exact"),
    Method("draft_lm", "bench.drafters.learned.DraftLMDrafter", "a learned drafter: a 2-layer draft LM trained "
           "on the run's earlier rollouts, updated every step", "exact"),
    Method("eagle", "bench.drafters.eagle.EagleDrafter", "a learned drafter, EAGLE-style: one layer over the "
           "policy's hidden states, its embedding and output layer reused (torch_ref only)", "exact"),
    Method("learned_tree", "bench.drafters.learned_tree.LearnedTreeDrafter", "ours, learned: SRT's tree where "
           "its match is long, the draft LM elsewhere", "exact"),
    Method("seer", "methods.seer.SeerDrafter", "Seer's grouped speculation: in-flight trie of the step's GRPO "
           "group, draft tokens to the longest-running rows first", "exact"),
)}
