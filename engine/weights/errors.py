"""The one error a checkpoint problem raises: it names the file and tensor and says what to do."""
from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is on disk.

    `file` and `tensor` (either may be None) point at the culprit; the message already contains
    both, plus the action that fixes it.
    """

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None):
        super().__init__(message)
        self.file = Path(file) if file is not None else None
        self.tensor = tensor


def redownload_hint(model_id: str | None) -> str:
    return f"Re-download it with `localchat pull {model_id or '<model>'}`."
