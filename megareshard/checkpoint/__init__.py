"""Checkpoints that move between layouts: torch.distributed.checkpoint with global names and boxes.

``CheckpointManager`` (manager.py) is what the trainer calls; ``format.py`` is the on-disk
format (atomic directories, ``latest``, the DCP planners); ``tools/checkpoint_util.py``
inspects, exports (one consolidated, unpadded state dict) and imports checkpoints.
"""
from .format import (CHECKPOINT_JSON, FORMAT_VERSION, KILL_ENV, LATEST_FILE, CheckpointError, Piece,
                     check_files, iteration_dirname, metadata_summary, read_info, read_metadata, read_pieces,
                     read_full_model, resolve_checkpoint_dir, write_checkpoint)
from .manager import ARCHITECTURE_FIELDS, CheckpointManager, LoadResult, describe_layout, model_key, optim_key

__all__ = ["CheckpointManager", "LoadResult", "CheckpointError", "Piece", "FORMAT_VERSION", "CHECKPOINT_JSON",
           "LATEST_FILE", "KILL_ENV", "ARCHITECTURE_FIELDS", "check_files", "iteration_dirname",
           "metadata_summary", "read_info", "read_metadata", "read_pieces", "read_full_model", "resolve_checkpoint_dir",
           "write_checkpoint", "describe_layout", "model_key", "optim_key"]
