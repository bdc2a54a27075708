"""Autograd-aware tensor-parallel collectives (Megatron's "regions").

Each mapping is a pair (forward collective, backward collective) that are adjoint to
each other, so a layer can be written as "enter the tp region, compute, leave it":

==========================================  =========================  ==========================
mapping                                      forward                    backward
==========================================  =========================  ==========================
``copy_to_tp_region``                        identity                   all-reduce
``reduce_from_tp_region``                    all-reduce                 identity
``scatter_to_tp_region`` (last dim)          keep own chunk             all-gather
``gather_from_tp_region`` (last dim)         all-gather                 keep own chunk
``scatter_to_sequence_parallel_region``      keep own chunk (dim 0)     all-gather (dim 0)
``gather_from_sequence_parallel_region``     all-gather (dim 0)         reduce-scatter (dim 0)
``reduce_scatter_to_sequence_parallel_region``  reduce-scatter (dim 0)  all-gather (dim 0)
==========================================  =========================  ==========================

The sequence dimension is dim 0 because hidden states are ``[s, b, h]`` (Megatron's
layout): chunks along dim 0 are contiguous, so gathers and scatters need no copies.

With ``ctx.tp_size == 1`` every mapping is the identity and torch.distributed is never
touched, so single-process reference runs need no process group.

Gathers and reduce-scatters are single flat-buffer collectives on gloo and NCCL alike
(``parallel/collectives.py``): no all-reduce-then-slice fallback that would double traffic.

Inside a compiled region (``--torch-compile``) every mapping with a collective runs eagerly, as a
graph break (``compile_boundary``): the collectives keep the order the program issues them in.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..compile_boundary import outside_compiled_regions
from ..parallel import ParallelContext
from ..parallel.collectives import all_gather_into, reduce_scatter_into

__all__ = [
    "all_gather_dim", "reduce_scatter_dim", "split_dim",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]


# ---- raw collectives over the tp group (no autograd) --------------------------------------
def _check_divisible(size: int, tp: int, dim: int, what: str) -> int:
    if size % tp:
        raise ValueError(f"{what}: dimension {dim} has size {size}, not divisible by tensor-parallel size {tp}")
    return size // tp


def split_dim(x: torch.Tensor, ctx: ParallelContext, dim: int) -> torch.Tensor:
    """This tp rank's contiguous chunk of ``x`` along ``dim`` (even split required)."""
    tp = ctx.tp_size
    if tp == 1:
        return x
    chunk = _check_divisible(x.size(dim), tp, dim, "split across tp")
    return x.narrow(dim, ctx.tp_rank() * chunk, chunk).contiguous()


def all_gather_dim(x: torch.Tensor, ctx: ParallelContext, dim: int) -> torch.Tensor:
    """Concatenate every tp rank's ``x`` along ``dim`` (tp-rank order).

    One all-gather into a flat buffer along dim 0 (gloo and NCCL both have it); other dims
    are moved to the front and back, which costs a copy but no extra traffic.
    """
    tp = ctx.tp_size
    if tp == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.size(0) * tp, *front.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, front, ctx.tp_group)
    return out.movedim(0, dim) if dim != 0 else out


def reduce_scatter_dim(x: torch.Tensor, ctx: ParallelContext, dim: int) -> torch.Tensor:
    """Sum ``x`` over tp ranks and keep this rank's chunk along ``dim`` (one reduce-scatter)."""
    tp = ctx.tp_size
    if tp == 1:
        return x
    chunk = _check_divisible(x.size(dim), tp, dim, "reduce-scatter across tp")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((chunk, *front.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, front, ctx.tp_group)
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def _all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if ctx.tp_size == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=ctx.tp_group)
    return out


# ---- autograd functions ----------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx):
        fctx.pctx = ctx
        return x.view_as(x)

    @staticmethod
    def backward(fctx, g):
        return _all_reduce(g, fctx.pctx), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx):
        return _all_reduce(x, ctx)

    @staticmethod
    def backward(fctx, g):
        return g, None


class _ScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, dim):
        fctx.pctx, fctx.dim = ctx, dim
        return split_dim(x, ctx, dim)

    @staticmethod
    def backward(fctx, g):
        return all_gather_dim(g, fctx.pctx, fctx.dim), None, None


class _GatherDim(torch.autograd.Function):
    """All-gather forward; backward either splits (grad replicated) or reduce-scatters."""

    @staticmethod
    def forward(fctx, x, ctx, dim, reduce_grad):
        fctx.pctx, fctx.dim, fctx.reduce_grad = ctx, dim, reduce_grad
        return all_gather_dim(x, ctx, dim)

    @staticmethod
    def backward(fctx, g):
        if fctx.reduce_grad:
            return reduce_scatter_dim(g, fctx.pctx, fctx.dim), None, None, None
        return split_dim(g, fctx.pctx, fctx.dim), None, None, None


class _ReduceScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, dim):
        fctx.pctx, fctx.dim = ctx, dim
        return reduce_scatter_dim(x, ctx, dim)

    @staticmethod
    def backward(fctx, g):
        return all_gather_dim(g, fctx.pctx, fctx.dim), None, None


@outside_compiled_regions
def _apply(fn, *args):
    """``fn.apply(*args)``: a collective's autograd function, never traced into a compiled region."""
    return fn.apply(*args)


# ---- public mappings ----------------------------------------------------------------------
def copy_to_tp_region(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Enter a tp region with a replicated input: identity forward, all-reduce of the gradient."""
    return x if ctx.tp_size == 1 else _apply(_CopyToTP, x, ctx)


def reduce_from_tp_region(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Leave a tp region by summing partial results: all-reduce forward, identity backward."""
    return x if ctx.tp_size == 1 else _apply(_ReduceFromTP, x, ctx)


def scatter_to_tp_region(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; backward all-gathers the gradient."""
    return x if ctx.tp_size == 1 else _apply(_ScatterDim, x, ctx, x.dim() - 1)


def gather_from_tp_region(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """All-gather the last dim (e.g. column-parallel output); backward keeps this rank's chunk."""
    return x if ctx.tp_size == 1 else _apply(_GatherDim, x, ctx, x.dim() - 1, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Replicated ``[s, b, h]`` -> this rank's sequence chunk; backward all-gathers along s."""
    return x if ctx.tp_size == 1 else _apply(_ScatterDim, x, ctx, 0)


def gather_from_sequence_parallel_region(x: torch.Tensor, ctx: ParallelContext,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Sequence-sharded ``[s/tp, b, h]`` -> full ``[s, b, h]``.

    Backward reduce-scatters when the consumer is a tp-parallel computation (each rank
    holds a partial gradient of the full sequence: column-parallel input), or just keeps
    this rank's chunk when the gradient is already complete on every rank.
    """
    if ctx.tp_size == 1:
        return x
    return _apply(_GatherDim, x, ctx, 0, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Partial sums ``[s, b, h]`` -> summed sequence chunk ``[s/tp, b, h]`` (row-parallel output)."""
    return x if ctx.tp_size == 1 else _apply(_ReduceScatterDim, x, ctx, 0)
