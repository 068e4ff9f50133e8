"""Suffix structures the copying drafters share: the per-prompt suffix tree and its suffix index, with
their match results. Pure Python (an optional native backend is chosen at run time)."""
