"""What can be wrong with a checkpoint step, as the exceptions and the warning the store raises."""

from __future__ import annotations

from pathlib import Path

from spmdkit.errors import SpmdkitError, SpmdkitWarning


class CheckpointWarning(SpmdkitWarning):
    """A damaged checkpoint step was skipped."""


class DamagedStep(SpmdkitError):
    """A step that cannot be restored as saved: unreadable, incomplete, wrong checksums, or NaN/Inf."""

    def __init__(self, step: int, directory: Path, problem: str):
        self.step, self.problem = step, problem
        super().__init__(
            f"checkpoint step {step} in {directory} is damaged ({problem}): see 'spmdkit ckpt verify {directory}'"
        )


class Damage(Exception):
    """What is wrong with a step (internal to the store: `restore` raises it as DamagedStep, `verify` reports it)."""


class NonFiniteState(SpmdkitError):
    """A state holding NaN or Inf values, refused by `save`."""


class LayoutMismatch(SpmdkitError):
    """The newest step every process holds was saved by another process layout or mesh (not damage)."""
