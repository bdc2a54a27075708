"""The record of a run's kernel choices (docs/design.md §5b): what ``--attention-backend auto`` chose for each
layer shape, kept in the run's checkpoints (``checkpoint.json``'s ``kernel_choices``) and run again on resume.

A building block below the models and the trainer: the trainer's fast path (``fast_path.py``) opens a
`KernelBook` with what the checkpoint ``--load`` names recorded and makes it active (`kernel_book`); the models'
attention set-up (``models/fusion.py``) chooses through the active book, which notes every choice; the fast
path leaves ``book.record()`` on the model for the checkpoint manager. No torch here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = ["KernelBook", "kernel_book", "active_book"]


@dataclass
class KernelBook:
    """The attention kernels a run chose (``chosen``: shape key -> {"kernel", "why"}; `record` is what a checkpoint
    keeps) and those a checkpoint recorded (``recorded``, {"attention": {key: {"kernel", "why"}}}; None: nothing
    to reuse — a fresh run or --finetune; {}: a checkpoint from before the record). ``--attention-backend auto``
    runs the recorded kernel of its key instead of measuring, unless ``rechoose`` (--attention-backend-rechoose:
    measured again, the line names what the record held) or ``deterministic`` (--deterministic-mode: its fixed
    kernel). ``source`` names the checkpoint in the start-up line."""

    recorded: dict[str, Any] | None = None
    source: str = "the checkpoint"
    rechoose: bool = False
    deterministic: bool = False
    chosen: dict[str, dict[str, str]] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The JSON a checkpoint records: {"attention": {key: {"kernel": ..., "why": ...}}}."""
        return {"attention": {k: dict(v) for k, v in sorted(self.chosen.items())}}

    def recorded_entry(self, key: str) -> dict[str, str] | None:
        """The recorded {"kernel", "why"} of ``key``, or None."""
        entries = (self.recorded or {}).get("attention")
        entry = entries.get(key) if isinstance(entries, dict) else None
        return entry if isinstance(entry, dict) and isinstance(entry.get("kernel"), str) else None


_ACTIVE: KernelBook | None = None


def active_book() -> KernelBook | None:
    """The book `kernel_book` made active, or None."""
    return _ACTIVE


@contextlib.contextmanager
def kernel_book(book: KernelBook) -> Iterator[KernelBook]:
    """The models' attention set-up chooses through ``book`` (records and reuses) inside this block."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, book
    try:
        yield book
    finally:
        _ACTIVE = before
