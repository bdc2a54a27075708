"""A rank's model and optimizer state as checkpoint pieces, and the record of the layout it was saved in.

Shared by the save side (``manager.py``), the load side (``loading.py``), the Megatron-LM loader
(``megatron_load.py``) and live weight transfer (``transfer.py``): the checkpoint keys of weights and
optimizer state (``model_key``, ``optim_key``), the canonical name of a tied copy, the global box of a
rank's tp slice or ZeRO-3 shard and the piece of it inside the real vocabulary, the optimizer's entries,
and the layout a checkpoint records (``describe_layout``, ``stage_layouts_of``, ``dp_changed``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .format import CheckpointError, Piece

__all__ = ["model_key", "optim_key", "stage_layouts_of", "describe_layout", "dp_changed"]



def model_key(name: str) -> str:
    return "model." + name


def optim_key(kind: str, name: str) -> str:
    """``kind``: ``master`` or an optimizer state name (``exp_avg``, ``exp_avg_sq``, ``step``)."""
    return f"optim.{kind}.{name}"


def _canonical(name: str, param: torch.Tensor) -> str:
    """The tied output-layer copy on a last pipeline stage (marked ``shared_embedding_duplicate``) is the
    word embedding: the model names it in ``checkpoint_name``; an untied output layer is its own tensor."""
    if getattr(param, "shared_embedding_duplicate", False):
        canonical = getattr(param, "checkpoint_name", None)
        if canonical is None:
            raise CheckpointError(f"parameter {name} is marked shared_embedding_duplicate but names no "
                                  "checkpoint_name (the name of the weight it duplicates)")
        return canonical
    return name


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_gather_object(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _tp_box(param: torch.Tensor, tp: int, tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global (padded) shape and offset of this rank's tp slice of ``param`` (an MoE expert weight: its box in the
    full ``[experts, ...]`` tensor, ``expert_box``, whatever ep and etp split it)."""
    box = getattr(param, "expert_box", None)
    if box is not None:
        return tuple(box[0]), tuple(box[1])
    shape, off = list(param.shape), [0] * param.dim()
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        d = param.partition_dim
        off[d] = tp_rank * shape[d]
        shape[d] *= tp
    return tuple(shape), tuple(off)


def _cut(tensor: torch.Tensor, gshape, goff, unpadded_rows: int | None) -> Piece | None:
    """The piece of ``tensor`` (at ``goff`` in ``gshape``) inside the real vocabulary (rows < unpadded_rows);
    None when it holds nothing stored (only padding, or empty)."""
    gshape, goff = tuple(gshape), tuple(goff)
    if unpadded_rows is not None and tensor.dim() >= 1:
        keep = max(0, min(tensor.shape[0], unpadded_rows - goff[0]))
        tensor = tensor.narrow(0, 0, keep)
        gshape = (unpadded_rows, *gshape[1:])
    if tensor.numel() == 0 and tensor.dim() > 0:
        return None
    return Piece(tensor, gshape, goff)


@dataclass
class _OptEntry:
    name: str           # canonical (checkpoint) name
    own_name: str
    param: torch.nn.Parameter
    master: torch.Tensor  # the tensor the inner optimizer steps (fp32 master shard or the param)
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    inner: torch.optim.Optimizer
    duplicate: bool


def _optimizer_entries(optimizer, model: torch.nn.Module, tp: int, tp_rank: int) -> list[_OptEntry]:
    if optimizer is None:
        return []
    if hasattr(optimizer, "entries") and hasattr(optimizer, "inner"):        # ZeroOptimizer
        return [_OptEntry(_canonical(e.name, e.param), e.name, e.param, e.master, tuple(e.info.global_shape),
                          tuple(e.info.global_offset), optimizer.inner, _canonical(e.name, e.param) != e.name)
                for e in optimizer.entries]
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in optimizer.param_groups:                                         # a plain torch optimizer
        for p in g["params"]:
            n = names[id(p)]
            gs, go = _tp_box(p, tp, tp_rank)
            out.append(_OptEntry(_canonical(n, p), n, p, p, gs, go, optimizer, _canonical(n, p) != n))
    return out


def _param_shards(optimizer) -> dict[int, Any]:
    """ZeRO-3 (``params_sharded``): parameter id -> its shard entry (``shard`` holds the parameter's rows, ``info``
    their box); the model's own parameters hold no data between uses. Empty otherwise."""
    if not getattr(optimizer, "params_sharded", False):
        return {}
    return {id(e.param): e for e in optimizer.entries}


def _model_box(p: torch.Tensor, shards: dict[int, Any], tp: int, tp_rank: int):
    """(tensor to save from / load into, its global shape, its global offset): the parameter's tp slice, or at
    ZeRO-3 its shard's box (the tp slice's rows this dp rank holds)."""
    e = shards.get(id(p))
    if e is not None:
        return e.shard, e.info.global_shape, e.info.global_offset
    gs, go = _tp_box(p, tp, tp_rank)
    return p, gs, go


def _zero_stage(optimizer) -> int | None:
    if optimizer is None:
        return None
    return int(getattr(optimizer, "stage", 0))


def _loss_scaler(optimizer):
    return getattr(optimizer, "loss_scaler", None)


def _layout(ctx, optimizer, model) -> dict[str, Any]:
    # "tp"/"dp": the layout's (uniform layouts) or the largest stage's (--stage-layouts);
    # "stage_layouts": every stage's [tp, dp], what layout comparisons use
    if ctx.per_stage_layouts:
        stages = [[int(t), int(d)] for t, d in ctx.topology.layouts]
        tp, dp = ctx.topology.tp, ctx.topology.dp
    else:
        stages = [[ctx.tp_size, ctx.dp_size] for _ in range(ctx.pp_size)]
        tp, dp = ctx.tp_size, ctx.dp_size
    return {"world_size": ctx.world_size, "tp": tp, "pp": ctx.pp_size, "dp": dp, "stage_layouts": stages,
            "zero_stage": _zero_stage(optimizer),
            "sequence_parallel": bool(getattr(model, "sequence_parallel", False)),
            "param_dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


def stage_layouts_of(lay: dict[str, Any]) -> list[list[int]] | None:
    """Every stage's [tp, dp] of a saved layout (older checkpoints: uniform from tp/pp/dp)."""
    if lay.get("stage_layouts"):
        return [[int(t), int(d)] for t, d in lay["stage_layouts"]]
    if lay.get("tp") is None:
        return None
    return [[int(lay["tp"]), int(lay["dp"])] for _ in range(int(lay["pp"]))]


def describe_layout(lay: dict[str, Any]) -> str:
    if lay.get("tp") is None:
        return f"no parallel layout (imported from {lay.get('imported_from', '?')})"
    z = lay.get("zero_stage")
    stages = stage_layouts_of(lay) or []
    if len({tuple(x) for x in stages}) > 1:
        shape = f"stage layouts {','.join(f'tp{t}dp{d}' for t, d in stages)} (pp {lay['pp']})"
    else:
        shape = f"tp {lay['tp']} · pp {lay['pp']} · dp {lay['dp']}"
    return (shape + (f" · zero {z}" if z is not None else "")
            + f" ({lay['world_size']} rank{'s' if lay['world_size'] != 1 else ''}, {lay.get('param_dtype', '?')})")


def _sizes(stages: list[list[int]] | None, axis: int) -> str:
    """tp (axis 0) or dp (axis 1) of a layout for messages: '2', or '1,2' per stage when they differ."""
    vals = [st[axis] for st in stages or []]
    return "?" if not vals else str(vals[0]) if len(set(vals)) == 1 else ",".join(map(str, vals))


def dp_changed(saved: list[list[int]] | None, cur: list[list[int]]) -> bool:
    """Whether the data-parallel sizes differ between two layouts ([tp, dp] per stage).

    A uniform dp is one number whatever the stage count (pp 2 -> 4 at dp 2 keeps dp 2);
    per-stage dps compare stage by stage. An unknown saved layout counts as changed.
    """
    return saved is None or _sizes(saved, 1) != _sizes(cur, 1)
