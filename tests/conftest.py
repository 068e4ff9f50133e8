"""Shared fixtures: the tiny recorded trace (recorded once into the trace cache, then reused)."""
import pytest


@pytest.fixture(scope="session")
def tiny_trace():
    """Path of the tiny countdown trace (6 steps x 4 prompts x 4 samples, max 16 new tokens).

    Recorded on first use (about half a minute on one core) into ``$SPECROLLOUT_CACHE``.
    """
    from bench.traces.record.cache import ensure_trace
    return ensure_trace("countdown-tiny", tiny=True, progress=False)


def pytest_configure(config):
    """Tiny models run fastest, and deterministically, on one CPU thread."""
    import torch
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """gpu-marked tests are skipped where no CUDA device is visible (CI has none)."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run: python -m bench.benchmarks.gpu_check on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
