"""Drafters: pure-Python proposers of draft tokens for speculative rollouts (no torch, no engine)."""
