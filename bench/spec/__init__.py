"""Speculation as a schedule: the one loop that drives every drafter (``scheduler``) over a backend
that verifies (torch_ref's forward pass, or the simulator's recorded tokens)."""
