"""Checkpoints written from full tensors and read back as full tensors, in one process: what the conversions
(``checkpoint_util.py`` import, import-hf, import-megatron, export-hf, export-megatron; ``hf_io.py``) share."""
from __future__ import annotations

import dataclasses
import os
import warnings

from ..models.config import ModelConfig
from .detect import check_destination
from .errors import CheckpointError
from .format import FORMAT_VERSION, Piece, read_full_model, read_info, resolve_checkpoint_dir, write_checkpoint
from .lock import busy_message, try_lock_dir

__all__ = ["writable_destination", "write_imported", "model_config_from_dict", "model_tensors"]


def writable_destination(dest: str, force: bool) -> None:
    """The guard every writing command calls first: ``dest`` must be new or an empty directory, unless ``force``;
    otherwise one ``CheckpointError`` line saying what is there (nothing written)."""
    check_destination(dest, force=force)


def write_imported(model: dict, optim: dict | None, common: dict, model_cfg: dict | None, it: int, source: str,
                    out_dir: str, tokenizer: dict | None = None) -> str:
    """A checkpoint directory from full tensors (and optionally optimizer state), recording where they came from
    (and ``tokenizer``, a ``tokenizer_record``, when known: what generate.py and export-hf use)."""
    pieces = {f"model.{k}": Piece(v.contiguous(), tuple(v.shape), (0,) * v.dim()) for k, v in model.items()}
    for name, kinds in (optim or {}).items():
        for kind, v in kinds.items():
            pieces[f"optim.{kind}.{name}"] = Piece(v.contiguous(), tuple(v.shape), (0,) * v.dim())
    common.setdefault("iteration", it)
    common.update({"format_version": FORMAT_VERSION, "model_config": model_cfg,
                   "layout": {"imported_from": os.path.abspath(source)}})
    if optim is None:
        common["loss_scaler"] = None
    info = {"layout": {"imported_from": os.path.abspath(source), "rank_coords": []}, "model_config": model_cfg,
            "args": common.get("args"), "has_optimizer": bool(optim), "has_rng": False,
            "consumed_samples": common.get("consumed_samples"), "wandb_run_id": common.get("wandb_run_id")}
    if tokenizer:
        info["tokenizer"] = tokenizer
    lock, holder = try_lock_dir(out_dir)          # a running job's --save is refused, --force or not
    if holder is not None:
        raise CheckpointError(busy_message(out_dir, holder, training=False))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return write_checkpoint(out_dir, it, pieces, {"common": common}, info)
    finally:
        lock.release()


def model_config_from_dict(d: dict) -> ModelConfig:
    """A saved ``model_config`` dict as a ModelConfig (older checkpoints name norm_epsilon layernorm_epsilon)."""
    d = dict(d)
    if "layernorm_epsilon" in d:
        d.setdefault("norm_epsilon", d.pop("layernorm_epsilon"))
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


def model_tensors(path: str) -> tuple[str, dict, ModelConfig, dict]:
    """(checkpoint dir, its checkpoint.json, its ModelConfig, its model weights as full tensors)."""
    ckpt = resolve_checkpoint_dir(path)
    info = read_info(ckpt)
    if not info.get("model_config"):
        raise CheckpointError(f"{ckpt} records no model configuration: the architecture cannot be told")
    cfg = model_config_from_dict(info["model_config"])
    return ckpt, info, cfg, read_full_model(ckpt, info)
