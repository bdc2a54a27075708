"""Autograd-aware collectives over any group, rows of variable count per rank (the token dispatchers').

Every one is an all-to-all with split sizes underneath (``all_to_all_single``: gloo and NCCL both have it),
so a rank may send and receive a different number of rows than its peers — which routed tokens need:

==========================  =============================================  ==========================
function                    forward                                        backward
==========================  =============================================  ==========================
``all_to_all``              rows ``in_splits[i]`` to rank i, ``out_splits``  the reverse all-to-all
``gather_rows``             every rank's rows, in group-rank order         ``reduce_scatter_rows``
``reduce_scatter_rows``     row block i of the sum goes to rank i          ``gather_rows``
==========================  =============================================  ==========================

A reduce-scatter receives every rank's copy of its block and sums them in group-rank order, the same order
on every run. A group of one rank (``group`` None or size 1) is the identity, with no call into
torch.distributed. Every rank of the group issues each of them in the same order (NCCL's rules).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...compile_boundary import outside_compiled_regions
from ...parallel.collectives import all_gather_into

__all__ = ["group_size", "group_rank", "all_to_all", "gather_rows", "reduce_scatter_rows", "all_gather_counts"]


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _a2a(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                           group=group)
    return out


def _gather(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    n = len(sizes)
    return _a2a(x.repeat(n, *([1] * (x.dim() - 1))), group, sizes, [x.size(0)] * n)


def _reduce_scatter(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    n, mine = len(sizes), sizes[group_rank(group)]
    received = _a2a(x, group, [mine] * n, sizes)
    return received.view(n, mine, *x.shape[1:]).sum(dim=0)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, out_splits, in_splits):
        fctx.args = (group, out_splits, in_splits)
        return _a2a(x, group, out_splits, in_splits)

    @staticmethod
    def backward(fctx, g):
        group, out_splits, in_splits = fctx.args
        return _a2a(g, group, in_splits, out_splits), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, sizes):
        fctx.args = (group, sizes)
        return _gather(x, group, sizes)

    @staticmethod
    def backward(fctx, g):
        return _reduce_scatter(g, *fctx.args), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, sizes):
        fctx.args = (group, sizes)
        return _reduce_scatter(x, group, sizes)

    @staticmethod
    def backward(fctx, g):
        return _gather(g, *fctx.args), None, None


@outside_compiled_regions
def _apply(fn, *args):
    return fn.apply(*args)


def all_to_all(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Send ``in_splits[i]`` rows to group rank i, receive ``out_splits[i]`` from it (concatenated in rank order)."""
    return x if group_size(group) == 1 else _apply(_AllToAll, x, group, list(out_splits), list(in_splits))


def gather_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's rows (rank i holds ``sizes[i]``); backward sums each rank's gradient block."""
    return x if group_size(group) == 1 else _apply(_GatherRows, x, group, list(sizes))


def reduce_scatter_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's block (``sizes`` rows per rank, in rank order)."""
    return x if group_size(group) == 1 else _apply(_ReduceScatterRows, x, group, list(sizes))


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``[n] -> [ranks, n]``: every rank's counts (no gradient)."""
    n = group_size(group)
    if n == 1:
        return counts.unsqueeze(0)
    out = counts.new_empty((n * counts.numel(),))
    all_gather_into(out, counts.contiguous().view(-1), group)
    return out.view(n, -1)
