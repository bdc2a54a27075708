"""Tensor parallelism: layers, collectives with autograd, vocab-parallel cross-entropy, RNG streams.

Also the two model-wide helpers that rely on the parameter attributes set by the layers:

* ``sync_sequence_parallel_grads`` — all-reduce over tp the gradients of replicated
  parameters that only saw this rank's sequence chunk (LayerNorms, row-parallel biases).
* ``gather_full_state_dict`` — all-gather tp shards into full tensors under their global
  names (vocabulary padding removed), to compare any layout with the single-process model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import ParallelContext
from .cross_entropy import vocab_parallel_cross_entropy, vocab_range
from .layers import (ColumnParallelLinear, LinearWithWeightGradStore, RowParallelLinear, VocabParallelEmbedding,
                     WeightGradStore, default_init, linear_with_wgrad_store, padded_vocab_size,
                     set_tensor_model_parallel_attributes)
from .mappings import (all_gather_dim, copy_to_tp_region, gather_from_sequence_parallel_region,
                       gather_from_tp_region, reduce_from_tp_region, reduce_scatter_dim,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tp_region, split_dim)
from .random import DEFAULT_STREAM, MODEL_PARALLEL_STREAM, RNGStreams

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "WeightGradStore",
    "LinearWithWeightGradStore", "linear_with_wgrad_store", "padded_vocab_size", "default_init",
    "set_tensor_model_parallel_attributes", "vocab_parallel_cross_entropy", "vocab_range",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "all_gather_dim", "reduce_scatter_dim", "split_dim",
    "RNGStreams", "DEFAULT_STREAM", "MODEL_PARALLEL_STREAM",
    "sync_sequence_parallel_grads", "gather_full_state_dict", "gather_full_tensor",
]


def sync_sequence_parallel_grads(model: nn.Module, ctx: ParallelContext) -> int:
    """All-reduce over tp the grads of parameters marked ``sequence_parallel``, as one flat bucket.

    Returns the number of gradient elements reduced (0 when tp is 1 or nothing is marked).
    Parameters are visited in ``named_parameters`` order, identical on every tp rank.
    """
    if ctx.tp_size == 1:
        return 0
    grads = [p.grad for _, p in model.named_parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ctx.tp_group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
    return offset


def gather_full_tensor(t: torch.Tensor, param: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Full tensor of ``t`` (the parameter's data or grad), sharded like ``param``; padding removed."""
    if getattr(param, "tensor_model_parallel", False) and ctx.tp_size > 1:
        if getattr(param, "partition_stride", 1) != 1:
            raise NotImplementedError(f"partition_stride {param.partition_stride} is not supported")
        t = all_gather_dim(t.detach(), ctx, param.partition_dim)
    rows = getattr(param, "unpadded_rows", None)
    if rows is not None:
        t = t.narrow(0, 0, rows)
    return t.detach().clone()


def gather_full_state_dict(model: nn.Module, ctx: ParallelContext, *, grads: bool = False,
                           device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Global parameter name -> full tensor (or full gradient with ``grads=True``; None if absent).

    Collective over the tp group: every tp rank must call it. Names are the model's own,
    which are global (``layers.17.…``) whatever the pipeline split.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        src = p.grad if grads else p
        if src is None:
            out[name] = None
            continue
        out[name] = gather_full_tensor(src, p, ctx).to(device)
    return out
