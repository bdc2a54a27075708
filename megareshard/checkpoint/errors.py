"""The one error every checkpoint reader raises (at the bottom of ``checkpoint/``: it imports nothing of ours)."""
from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit the model; the message names the path and the reason.

    An ``Exception`` (unlike DCP's ``CheckpointException``, a BaseException, which the loader
    converts into this)."""
