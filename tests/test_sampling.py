"""Coupled uniforms and processed distributions."""
import torch

from bench.core.sampling import (SamplingConfig, processed_probs, rollout_seed, sample_inverse_cdf,
                            stable_hash, uniform_reference, uniforms)


def test_stable_hash_is_fixed_across_processes():
    # a literal value: Python's salted hash() would differ between runs, this must not
    assert stable_hash("prompt-17") == stable_hash("prompt-17")
    assert stable_hash("a") != stable_hash("b")
    assert stable_hash("prompt-17") == int.from_bytes(
        __import__("hashlib").blake2b(b"prompt-17", digest_size=8).digest(), "little")


def test_vectorised_uniforms_equal_python_reference():
    keys = [rollout_seed(s, st, p, i) for s, st, p, i in
            [(0, 0, "p0", 0), (7, 3, "p1", 5), (2**40, 99, "x" * 30, 7), (-1 & 0xFFFF, 1, "", 0)]]
    pos = torch.tensor([[0, 1, 2, 3, 10**6]] * len(keys))
    big = torch.arange(100).expand(len(keys), 100)  # past SMALL_BATCH: the tensor path
    for stream in (0, 1):
        u_big = uniforms(torch.tensor(keys), big, stream)
        assert [[uniform_reference(k, t, stream) for t in range(100)] for k in keys] == u_big.tolist()
        u = uniforms(torch.tensor(keys), pos, stream)
        for b, k in enumerate(keys):
            for j, t in enumerate(pos[b].tolist()):
                assert u[b, j].item() == uniform_reference(k, t, stream)
    assert ((u > 0) & (u < 1)).all()


def test_uniforms_look_uniform_and_streams_are_independent():
    keys = torch.tensor([rollout_seed(0, 1, f"p{i}", i % 8) for i in range(4000)])
    pos = torch.arange(16).expand(4000, 16)
    u0, u1 = uniforms(keys, pos, 0), uniforms(keys, pos, 1)
    assert abs(u0.mean().item() - 0.5) < 0.01
    hist = torch.histc(u0.float(), bins=10, min=0, max=1) / u0.numel()
    assert (hist - 0.1).abs().max() < 0.01
    assert abs(torch.corrcoef(torch.stack([u0.flatten(), u1.flatten()]))[0, 1].item()) < 0.02
    # different steps give different randomness for the same slot (SPEC-RL's fixed matrix must not recur)
    assert rollout_seed(0, 1, "p", 0) != rollout_seed(0, 2, "p", 0)


def test_processed_probs_rules():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]], dtype=torch.float64))
    p = processed_probs(logits, SamplingConfig(top_p=0.6))
    # 0.5 alone is below 0.6, so the nucleus needs one of the 0.2s: the stable sort keeps token 1
    assert torch.allclose(p, torch.tensor([[5 / 7, 2 / 7, 0, 0]], dtype=torch.float64))
    p = processed_probs(logits, SamplingConfig(top_k=2))
    # top-k keeps every token tied with the k-th largest: 0.5, 0.2, 0.2
    assert torch.allclose(p, torch.tensor([[5 / 9, 2 / 9, 2 / 9, 0]], dtype=torch.float64))
    p = processed_probs(logits, SamplingConfig(temperature=0))
    assert p.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    p = processed_probs(logits, SamplingConfig(temperature=2.0))
    q = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64) ** 0.5
    assert torch.allclose(p, (q / q.sum())[None])


def test_inverse_cdf_sampling_intervals():
    probs = torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    u = torch.tensor([0.1, 0.2499, 0.26, 0.74, 0.76, 0.999])
    # cdf = [.25, .25, .75, 1]: token 1 has no mass and is never drawn
    assert sample_inverse_cdf(probs.expand(6, 4), u).tolist() == [0, 0, 2, 2, 3, 3]


def test_bad_sampling_values_are_named():
    import pytest
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)


def _full_sort_nucleus(probs, top_p):
    """The reference top-p cut: a stable descending sort of the whole vocabulary."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    gap = (before - top_p).abs().masked_fill(sorted_p == 0, float("inf")).amin(-1)
    return torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p), gap


def test_top_p_prefilter_cuts_exactly_as_a_full_sort(monkeypatch):
    import bench.core.sampling as sampling_mod
    from bench.core.sampling import nucleus_drop
    monkeypatch.setattr(sampling_mod, "TOP_P_CANDIDATES", (16, 256))  # small vocabularies exercise every branch
    g = torch.Generator().manual_seed(0)
    used = 0
    for trial in range(40):
        dtype = (torch.float32, torch.float64)[trial % 2]
        x = torch.randn(24, 4096, generator=g, dtype=torch.float64) * (1, 3, 6, 12)[trial % 4]
        if trial % 3 == 0:
            x = x.round()  # many exact ties, also at the candidates' edge
        probs = torch.softmax(x.to(dtype), -1)
        for top_p in (0.3, 0.9, 0.99):
            want_drop, want_gap = _full_sort_nucleus(probs, top_p)
            drop, gap = nucleus_drop(probs, top_p)
            assert torch.equal(drop, want_drop) and torch.equal(gap, want_gap)
            used += int(((~want_drop).sum(-1) < 256).sum())
    assert used > 1000  # most rows have a nucleus the candidates can hold (the prefilter path runs)
