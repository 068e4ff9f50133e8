"""The GPU check's dry run on CPU: the same steps as on a GPU machine, a small model, one step."""
import pandas as pd

from bench.benchmarks.gpu_check import main
from bench.spec.latency import LatencyTable


def test_gpu_check_dry_run_writes_the_summary_and_latency_tables(tmp_path, capsys):
    main(["--device", "cpu", "--small", "--max-steps", "1", "--out", str(tmp_path)])
    (out,) = tmp_path.iterdir()
    summary = (out / "summary.md").read_text()
    assert "engine torch_ref: ok" in summary and "verify cost" in summary
    (csv,) = out.glob("latency_*.csv")
    table = LatencyTable.read(csv)  # the format bench.benchmarks latency predict reads
    assert set(table.frame["rows"]) == {1, 4, 16} and (table.frame["seconds"] > 0).all()
    assert (pd.read_csv(out / "engines.csv")["method"] == "baseline").any()
