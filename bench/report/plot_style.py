"""The look every figure shares: one style, one colour per method, the groups a figure is drawn
per (one engine setup, trace, sampling), its title and file name, and saving as PNG and PDF.
Its own module so each figure module (plots, live rows, the simulator's) imports it and not each other."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from bench.report.collect import GROUP  # noqa: E402

STYLE = {"figure.dpi": 110, "savefig.dpi": 200, "font.size": 10, "axes.titlesize": 10,
         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
         "grid.alpha": 0.3, "grid.linewidth": 0.6, "legend.frameon": False,
         "savefig.bbox": "tight"}
BASELINE = "baseline"


def method_colors(methods: Iterable[str]) -> dict[str, str]:
    others = sorted(m for m in set(methods) if m != BASELINE)
    palette = plt.get_cmap("tab10").colors
    return {BASELINE: "0.45", **{m: palette[i % 10] for i, m in enumerate(others)}}


def _short(sampling: str) -> str:
    """'temperature=1 top_p=0.9 ...' -> 'T=1, top-p=0.9, top-k=-1, max 48 tok, seed 0'."""
    s = dict(kv.split("=", 1) for kv in sampling.split())
    return (f"T={s.get('temperature')}, top-p={s.get('top_p')}, top-k={s.get('top_k')}, "
            f"max {s.get('max_new_tokens')} tok, seed {s.get('seed')}")


def _slug(*parts: str) -> str:
    short = [re.sub(r"[^A-Za-z0-9._+-]+", "-", str(p)).strip("-") for p in parts]
    return "__".join(p for p in short if p)


def _sampling_slug(sampling: str) -> str:
    s = dict(kv.split("=", 1) for kv in sampling.split())
    return "T{temperature}_p{top_p}_k{top_k}_n{max_new_tokens}_s{seed}".format_map(
        {k: s.get(k, "?") for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")})


def save_figure(fig, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in ("png", "pdf")]
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return paths


def figure_groups(df: pd.DataFrame, keys=GROUP):
    for key, grp in df.groupby(list(keys), sort=True):
        yield dict(zip(keys, key)), grp


def setup_id(engine_config: str, hardware: str) -> str:
    """A short stable name of an engine setup: 's' + 6 hex digits of its settings and hardware."""
    return "s" + hashlib.sha1(f"{engine_config}\n{hardware}".encode()).hexdigest()[:6]


def _pairs(label: str) -> dict[str, str]:
    """'device=cpu, dtype=float32' -> {'device': 'cpu', 'dtype': 'float32'} (values may hold ', ')."""
    parts = re.split(r", (?=[\w.\-]+=)", label or "")
    return dict(p.split("=", 1) if "=" in p else (p, "") for p in parts if p)


def setup_label(table: pd.DataFrame, engine: str, engine_config: str, hardware: str) -> str:
    """The keys in which this setup differs from the engine's other setups in ``table``, e.g.
    'dtype=bfloat16, cores=16'; '' when the engine has one setup there."""
    rows = table[table["engine"] == engine][["engine_config", "hardware"]].drop_duplicates()
    setups = [{**_pairs(c), **_pairs(h)} for c, h in zip(rows["engine_config"], rows["hardware"])]
    if len(setups) < 2:
        return ""
    mine = {**_pairs(engine_config), **_pairs(hardware)}
    keys = sorted({k for d in setups for k in d if len({d.get(k) for d in setups}) > 1})
    return ", ".join(f"{k}={mine.get(k, 'unset')}" for k in keys)


def figure_title(what: str, g: dict, table: pd.DataFrame | None = None) -> str:
    where = f"trace {g['trace']}" + (f" · engine {g['engine']}" if "engine" in g else "")
    if table is not None and "engine_config" in g:
        label = setup_label(table, g["engine"], g["engine_config"], g["hardware"])
        if label:
            return (f"{what}\n{where} · {_short(g['sampling'])}\n"
                    f"setup {setup_id(g['engine_config'], g['hardware'])}: {label}")
    return f"{what}\n{where} · {_short(g['sampling'])}"


def figure_name(what: str, g: dict) -> str:
    setup = setup_id(g["engine_config"], g["hardware"]) if "engine_config" in g else ""
    return _slug(what, g["trace"], g.get("engine", ""), setup, _sampling_slug(g["sampling"]))


