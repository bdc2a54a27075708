"""Checkpoints that move between layouts: torch.distributed.checkpoint with global names and boxes.

``CheckpointManager`` (manager.py) is what the trainer calls; ``format.py`` is the on-disk
format (atomic directories, ``latest``, the DCP planners); ``tools/checkpoint_util.py``
inspects, exports (one consolidated, unpadded state dict) and imports checkpoints.

The names below load on first use (torch comes with them): ``checkpoint.detect``, which classifies a
``--load``/``--save`` path and reads a checkpoint's ``checkpoint.json``, imports no torch, so that
``pretrain_gpt.py --validate-only`` checks them in a fraction of a second.
"""
from __future__ import annotations

import importlib
from typing import Any

_FROM = {**dict.fromkeys(("CHECKPOINT_JSON", "FORMAT_VERSION", "KILL_ENV", "LATEST_FILE", "CheckpointError", "Piece",
                          "check_files", "iteration_dirname", "metadata_summary", "read_info", "read_metadata",
                          "read_pieces", "read_full_model", "resolve_checkpoint_dir", "write_checkpoint"), "format"),
         **dict.fromkeys(("ARCHITECTURE_FIELDS", "CheckpointManager", "LoadResult", "describe_layout", "model_key",
                          "optim_key"), "manager")}

__all__ = ["CheckpointManager", "LoadResult", "CheckpointError", "Piece", "FORMAT_VERSION", "CHECKPOINT_JSON",
           "LATEST_FILE", "KILL_ENV", "ARCHITECTURE_FIELDS", "check_files", "iteration_dirname",
           "metadata_summary", "read_info", "read_metadata", "read_pieces", "read_full_model", "resolve_checkpoint_dir",
           "write_checkpoint", "describe_layout", "model_key", "optim_key"]


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
