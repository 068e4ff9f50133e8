"""The suite's core, below everything else: coupled sampling, the one verifier, the drafter protocol's
driving rules, the engine protocol, precision classes, errors and the repository's paths. It imports
nothing of the suite but ``methods.base``."""
