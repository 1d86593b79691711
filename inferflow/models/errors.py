"""The one error type for checkpoints we cannot load."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint is missing, unsupported or broken. The message names the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem
