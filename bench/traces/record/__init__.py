"""The bundled RL trace recorder: a tiny verifiable task, a char tokenizer, a tiny policy, SFT, GRPO.

    python -m bench.traces.record --out DIR [--tiny]
    python -c "from bench.traces.record.cache import ensure_trace; print(ensure_trace('countdown-tiny', tiny=True))"

The package imports nothing itself: its modules import each other as ``bench.traces.record.X``,
and a package ``__init__`` that imported them back would close a cycle.
"""
