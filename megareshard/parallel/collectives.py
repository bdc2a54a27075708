"""Flat-tensor collectives under their current names.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (the old names warn). Both gloo and NCCL
implement them; older torch has only the old names. One place picks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (dim 0 = world × x's dim 0) receives every rank's ``x`` in rank order."""
    return _all_gather(out, x, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """``out`` receives this rank's dim-0 chunk of the sum of every rank's ``x``."""
    return _reduce_scatter(out, x, group=group, async_op=async_op)
