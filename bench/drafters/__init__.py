"""Drafters that run a model: they need torch, so they live here, engine-side; ``methods/`` stays
torch-free. The scheduler drives them as any drafter (``methods.base.Drafter``), under every
engine and the simulator, and the exact rule keeps every engine's tokens the baseline's."""
