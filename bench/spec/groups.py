"""Which rows of an iteration share a forward pass: one block, or two where padding would waste more
than a second pass costs. A scheduling decision, so every backend makes the same one.

    pytest tests/test_torch_ref.py -k forward_groups
"""
from __future__ import annotations

SPLIT_SAVING = 0.1  # two forward passes instead of one only where the latency table says they cost 10% less


def forward_groups(sizes: list[int], min_saving: float = 0.3, min_tokens: int = 64,
                    seconds=None) -> list[list[int]]:
    """Rows of one iteration split into one or two forward passes.

    A block is padded to its longest row, so a few long drafts make every row pay for them. With
    ``seconds(rows, width)`` (the latency table of this engine and model, as the speculation
    policy has it) two passes are run when they cost at least ``SPLIT_SAVING`` less than one by
    that table: on a CPU running a small model a pass costs about as much for 1 as for 3 tokens a
    row, so two passes cost twice one (measured: a 32-row iteration split 25 + 7 took 3.3 ms
    against 1.5 ms unsplit, results/LOG.md). Without a table, by tokens: when splitting the rows by
    block size at the best cut saves at least ``min_saving`` of the padded tokens (and the block is
    big enough for a second call to pay off). Example, by tokens: sizes [1, 1, 1, 25] ->
    [[0, 1, 2], [3]] (28 tokens instead of 100).
    """
    n, longest = len(sizes), max(sizes)
    if n < 2 or (seconds is None and n * longest < min_tokens) or min(sizes) == longest:  # nothing to cut
        return [list(range(n))]
    order = sorted(range(n), key=sizes.__getitem__)
    ranked = [sizes[i] for i in order]
    cuts = [c for c in range(1, n) if ranked[c] != ranked[c - 1]]
    if not cuts:
        return [list(range(n))]
    if seconds is None:
        whole = n * longest
        best, cut = min((c * ranked[c - 1] + (n - c) * longest, c) for c in cuts)
        limit = (1 - min_saving) * whole
    else:
        whole = seconds(n, longest)
        best, cut = min((seconds(c, ranked[c - 1]) + seconds(n - c, longest), c) for c in cuts)
        limit = (1 - SPLIT_SAVING) * whole
    if best > limit:
        return [list(range(n))]
    return [sorted(order[:cut]), sorted(order[cut:])]
