"""The closed loop's shared start: one SFT warm start and one held-out set, cached per task and seed.

Every setting and seed of a closed-loop sweep starts GRPO from the same SFT policy (what differs
between runs is the rollout method and the RL seed, not the initial policy), so the warm start is
trained once and cached like the bundled traces (``$SPECROLLOUT_CACHE/train/<key>``, recorded into
a temp dir and renamed into place). The held-out set is what the KL between two runs' policies is
measured on: prompts disjoint from the training prompts, each with a few responses sampled from
the warm start (teacher-forced, the same sequences for every run), so two policies are compared
position by position on identical inputs.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bench.core.errors import UserError
from bench.traces.record import task as countdown
from bench.core.paths import cache_root
from bench.traces.record.grpo import RecordConfig, response_ids
from bench.core.publish import publish_dir

WARMSTART_VERSION = 1
HELDOUT_FILE = "heldout.json"


@dataclass
class HeldOut:
    """Fixed prompt + response sequences; ``positions`` of a sequence are those that predict a
    response token (the last prompt token's through the one before EOS)."""

    prompts: list[list[int]]
    responses: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompts)

    def num_positions(self) -> int:
        return sum(len(r) for r in self.responses)


def problems_for(cfg: RecordConfig, heldout_prompts: int) -> tuple[list, list]:
    """The training problems (as the recorder makes them) and ``heldout_prompts`` other ones."""
    train = countdown.make_problems(cfg.num_prompts, seed=cfg.seed + 17)
    seen = set(train)
    heldout = [p for p in countdown.make_problems(cfg.num_prompts + 4 * heldout_prompts, seed=cfg.seed + 29)
               if p not in seen][:heldout_prompts]
    if len(heldout) < heldout_prompts:
        raise UserError(f"heldout_prompts={heldout_prompts}: only {len(heldout)} problems of task {cfg.name!r} "
                        f"are not training prompts; ask for fewer")
    return train, heldout


def warm_start_key(cfg: RecordConfig, heldout_prompts: int, heldout_samples: int) -> str:
    """The cache name of a warm start: task, seed and a digest of everything that shapes it."""
    blob = json.dumps({"v": WARMSTART_VERSION, "record": asdict(cfg), "heldout": [heldout_prompts, heldout_samples]},
                      sort_keys=True, default=str)
    return f"{cfg.name}-seed{cfg.seed}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def ensure_warm_start(cfg: RecordConfig, heldout_prompts: int = 16, heldout_samples: int = 2,
                      progress: bool = True) -> Path:
    """The cached warm-start folder (an HF checkpoint plus ``heldout.json``), trained if absent."""
    target = cache_root() / "train" / warm_start_key(cfg, heldout_prompts, heldout_samples)
    if (target / HELDOUT_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _train_warm_start(tmp, cfg, heldout_prompts, heldout_samples, progress)
        try:
            publish_dir(tmp, target)
        except OSError:  # another process published the same warm start first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _train_warm_start(out: Path, cfg: RecordConfig, heldout_prompts: int, heldout_samples: int,
                      progress: bool) -> None:
    from methods.base import RolloutKey
    from methods.baseline import Baseline

    from bench.core.engine_protocol import Request
    from bench.engines.torch.engine import TorchRefEngine
    from bench.traces.record.model import build_model, save_checkpoint
    from bench.traces.record.sft import sft
    from bench.core.verify import VerifyConfig

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and the fastest for a tiny model on a shared machine
    try:
        tok = cfg.build_tokenizer()
        model = build_model(tok, cfg.model_config(), seed=cfg.seed)
        sft(model, tok, cfg.sft_config(), progress=progress, make_batch=cfg.sft_batches(tok))
        save_checkpoint(model, tok, out)
        _, heldout = problems_for(cfg, heldout_prompts)
        engine = TorchRefEngine(device="cpu", dtype="float32")
        engine.load(out)
        prompts = [tok(p.prompt)["input_ids"] for p in heldout]
        requests = [Request(RolloutKey(f"h{i:03d}", j), ids, step=0)
                    for i, ids in enumerate(prompts) for j in range(heldout_samples)]
        sampling = sampling_for(cfg, seed=cfg.seed + 7_777)
        rollouts = engine.rollout(requests, sampling, Baseline(), VerifyConfig())
        engine.close()
    finally:
        torch.set_num_threads(previous)
    # the EOS stays in the response: its probability is part of the policy
    data = {"prompts": [r.prompt_token_ids for r in rollouts],
            "responses": [list(r.token_ids) for r in rollouts],
            "texts": [tok.decode(response_ids(r.token_ids, tok.eos_token_id)) for r in rollouts]}
    (out / HELDOUT_FILE).write_text(json.dumps(data))


def sampling_for(cfg: RecordConfig, seed: int):
    """The task's sampling (temperature, top-p/k, max new tokens) under coupled-sampling seed ``seed``."""
    from bench.core.sampling import SamplingConfig
    return SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=cfg.max_new_tokens, seed=seed)


def load_heldout(folder: Path) -> HeldOut:
    data = json.loads((Path(folder) / HELDOUT_FILE).read_text())
    return HeldOut(data["prompts"], data["responses"])


def padded_batch(pairs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of right-padded prompt + response rows."""
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.zeros((len(pairs), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, r) in enumerate(pairs):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = 1
    return ids, attn


@torch.no_grad()
def heldout_logprobs(model, heldout: HeldOut, temperature: float) -> np.ndarray:
    """log softmax(logits / T) of ``model`` at every held-out position: float32 [positions, vocab]
    in sequence order. Two runs' arrays at a step give their policies' KL on identical inputs."""
    ids, attn = padded_batch(list(zip(heldout.prompts, heldout.responses)))
    was_training = model.training
    model.eval()
    logits = model(input_ids=ids, attention_mask=attn).logits
    model.train(was_training)
    logp = torch.log_softmax(logits.double() / max(temperature, 1e-6), -1)
    rows = [logp[i, len(p) - 1:len(p) + len(r) - 1] for i, (p, r) in
            enumerate(zip(heldout.prompts, heldout.responses))]
    return torch.cat(rows).float().numpy()


def mean_kl(logp: np.ndarray, ref_logp: np.ndarray) -> float:
    """Mean over positions of KL(p || ref) = sum_x p(x) (log p(x) - log ref(x)), in nats."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"held-out arrays differ in shape: {logp.shape} vs {ref_logp.shape}")
    lp, lr = logp.astype(np.float64), ref_logp.astype(np.float64)
    return float((np.exp(lp) * (lp - lr)).sum(-1).mean())
