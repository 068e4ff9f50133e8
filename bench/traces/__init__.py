"""Recorded RL runs: the trace format, importing a run from other frameworks, recording the bundled
traces on the torch engine, and converting the packaged real model into a checkpoint."""
