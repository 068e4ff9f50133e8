"""An analytic roofline of one forward pass on a named accelerator, for models of HF shapes.

    python -m bench.benchmarks latency predict RUN --hardware h200 --model llama-3.1-8b

Hardware comes from datasheets (conf/hardware/*.yaml), model shapes from HF config.json fields
(conf/model_shape/*.yaml, or any config.json). A pass costs max(bytes / bandwidth, FLOPs / peak),
each at an efficiency factor. It ignores kernel-launch and scheduler overheads (a fixed
``overhead_s`` per pass is a knob, 0 by default), attention-kernel efficiency beyond that one
factor, tensor or pipeline parallelism, padding, and sampling/verification on the device.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from bench.core.errors import UserError
from bench.core.paths import CONF_DIR



@dataclass
class Hardware:
    """An accelerator from its datasheet (conf/hardware/*.yaml)."""

    name: str
    memory_bandwidth_gbs: float  # GB/s
    peak_tflops: float  # dense bf16/fp16 tensor TFLOP/s
    memory_gb: float
    bandwidth_efficiency: float = 0.8  # share of the datasheet bandwidth a decode step reaches
    flops_efficiency: float = 0.6  # share of the datasheet peak a large matmul reaches
    overhead_s: float = 0.0  # fixed seconds per forward pass (launches, scheduling): ignored by default
    source: str = ""

    @classmethod
    def named(cls, name: str) -> "Hardware":
        return cls(**_load_yaml("hardware", name))


@dataclass
class ModelShape:
    """What a forward pass costs depends on: from an HF config.json (conf/model_shape/*.yaml)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, config: dict, name: str = "model", dtype_bytes: int = 2) -> "ModelShape":
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(name=name, hidden=hidden, intermediate=int(config["intermediate_size"]),
                       layers=int(config["num_hidden_layers"]), heads=heads,
                       kv_heads=int(config.get("num_key_value_heads") or heads),
                       head_dim=int(config.get("head_dim") or hidden // heads),
                       vocab=int(config["vocab_size"]), tied=bool(config.get("tie_word_embeddings", False)),
                       dtype_bytes=dtype_bytes)
        except KeyError as exc:
            raise UserError(f"model {name}: config has no {exc.args[0]!r}; pass an HF config.json of a "
                            f"decoder-only model or one of {', '.join(_names('model_shape'))}") from exc

    @classmethod
    def named(cls, name_or_path: str) -> "ModelShape":
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if path.suffix == ".json" and path.exists():
            return cls.from_config(json.loads(path.read_text()), path.parent.name)
        return cls.from_config(_load_yaml("model_shape", name_or_path), name_or_path)

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return self.layers * (attn + 3 * self.hidden * self.intermediate)

    @property
    def params(self) -> int:
        return self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2)

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def roofline_seconds(hw: Hardware, model: ModelShape, query_tokens, context_sum, rows) -> np.ndarray:
    """Seconds of forward passes: max(bytes / bandwidth, flops / peak), each at its efficiency
    (``pass_bytes_flops`` counts them)."""
    return bytes_flops_seconds(hw, *pass_bytes_flops(model, query_tokens, context_sum, rows))


def pass_bytes_flops(model: ModelShape, query_tokens, context_sum, rows, extra_weights: int = 0):
    """(bytes, FLOPs) of forward passes, whatever the accelerator.

    Bytes: every weight once (the embedding table is a gather) plus the KV cache each row reads.
    FLOPs: 2 x weights x tokens for the matmuls (the LM head on every query token, as engines
    verifying drafts compute it) plus 4 x layers x heads x head_dim x sum(query x context) for
    attention, with each row's query tokens seeing about its mean context. ``extra_weights``: matmul
    weights outside the decoder layers and the LM head (an EAGLE head's input projection).
    """
    q = np.asarray(query_tokens, dtype=float)
    ctx = np.asarray(context_sum, dtype=float)
    b = np.maximum(np.asarray(rows, dtype=float), 1.0)
    matmul_weights = model.layer_params + model.vocab * model.hidden + extra_weights
    bytes_ = matmul_weights * model.dtype_bytes + ctx * model.kv_bytes_per_token()
    flops = 2.0 * matmul_weights * q + 4.0 * model.layers * model.heads * model.head_dim * q * (ctx / b)
    return bytes_, flops


def bytes_flops_seconds(hw: Hardware, bytes_, flops, passes=1) -> np.ndarray:
    """Seconds on ``hw`` of ``passes`` forward passes that move ``bytes_`` and compute ``flops`` in all
    (exact for one pass, or for passes in the same regime: all memory- or all compute-bound)."""
    t_mem = np.asarray(bytes_, dtype=float) / (hw.memory_bandwidth_gbs * 1e9 * hw.bandwidth_efficiency)
    t_flops = np.asarray(flops, dtype=float) / (hw.peak_tflops * 1e12 * hw.flops_efficiency)
    return np.maximum(t_mem, t_flops) + hw.overhead_s * np.asarray(passes, dtype=float)


class RooflineTable:
    """A roofline read as a latency table (``query_seconds``, ``seconds``), so the speculation policy
    can decide by a named GPU without a measured table: a pass of ``rows`` rows padded to a query
    width costs ``roofline_seconds`` of rows x width query tokens at the rows' mean context (the
    policy thinks in widths). ``price``, what ``bench.spec.prices.TablePrices`` charges a pass, counts
    its real query tokens instead, as the predictions do."""

    def __init__(self, hardware: Hardware, model: ModelShape):
        self.hardware, self.model = hardware, model
        self.label = f"roofline {hardware.name} x {model.name}"

    def seconds(self, rows, query, context) -> np.ndarray:
        rows, query, context = (np.asarray(v, dtype=float) for v in (rows, query, context))
        return roofline_seconds(self.hardware, self.model, rows * query, rows * context, rows)

    def query_seconds(self, rows: float, queries, context: float) -> list[float]:
        n = len(queries)
        return self.seconds([rows] * n, list(queries), [context] * n).tolist()

    def price(self, rows: int, width: int, context: float, query_tokens: int) -> float:
        """One pass as ``bench.spec.latency.pass_seconds`` prices it: its real query tokens (a GPU engine
        packs ragged rows), not ``rows`` x ``width``."""
        return float(roofline_seconds(self.hardware, self.model, [query_tokens], [rows * context], [rows])[0])


def _names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _load_yaml(group: str, name: str) -> dict:
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        raise UserError(f"no {group} named {name!r}; choose one of {', '.join(_names(group))} "
                        f"(conf/{group}/) or add a file there")
    data = yaml.safe_load(path.read_text()) or {}
    data.setdefault("name", name)
    return data
