"""The figures notebook runs top to bottom against a results folder made here, from parquet alone."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from results_fixtures import write_fake_run

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "figures.ipynb"


@pytest.mark.slow
def test_figures_notebook_executes(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    write_fake_run(runs, "ref", engine="torch_ref", methods=("baseline", "tree_cache", "prefix_reuse"))
    write_fake_run(runs, "vllm", engine="vllm", methods=("baseline", "tree_cache", "prefix_reuse"))
    monkeypatch.setenv("SPECROLLOUT_RESULTS", str(runs))
    monkeypatch.setenv("SPECROLLOUT_FIGURES", str(tmp_path / "figures"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    pngs = sorted(p.name.split("__")[0] for p in (tmp_path / "figures").glob("*.png"))
    assert {"speedup", "step_curves", "rollout_time", "accepted_length", "engines"} <= set(pngs)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
