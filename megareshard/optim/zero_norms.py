"""Sums over every element of the full model, from a `ZeroOptimizer`'s shards: the gradient norm (clipping, the
log), the parameter norm (--log-params-norm) and the zero count of the gradients (--log-num-zeros-in-grad). Each
element is counted once whatever the layout: replicated-over-tp tensors on tp rank 0 only, a tied-embedding
duplicate never, ZeRO shards summed over dp, MoE expert shards over their edp and expert ranks, then over tp × pp."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .clip_grads import counts_in_grad_norm

__all__ = ["over_the_model", "sum_of_squares", "count_zeros"]


def count_zeros(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """Elements equal to zero in ``tensors`` (fp64: exact to 2**53)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([(t == 0).sum() for t in tensors]).sum().double()


def sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ‖g‖² over ``grads`` (fp32, 0-d, on ``device``; a fresh tensor, safe to all-reduce in place)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()


def over_the_model(opt, pick: Callable, total: Callable) -> torch.Tensor:
    """``total(tensors, device)`` (a 0-d tensor: a sum over elements) of ``pick(entry)`` over the full model of
    `ZeroOptimizer` ``opt``, each element counted once: summed over this rank's shards, over dp (stage>=1: shards are disjoint) and over
    the model-parallel group with the tp rules of ``clip_grads`` (replicated-over-tp params only on tp rank 0,
    a tied-embedding duplicate never); MoE expert tensors over their edp shards and the stage's expert ranks."""
    tp_rank = opt.ctx.tp_rank()
    dev = opt.entries[0].master.device
    dense: list[torch.Tensor] = []
    experts: list[torch.Tensor] = []     # MoE expert weights
    for e in opt.entries:
        if not e.expert and not counts_in_grad_norm(e.param, tp_rank):
            continue
        t = pick(e)
        if t is not None and t.numel():
            (experts if e.expert else dense).append(t)
    sq, esq = total(dense, dev), total(experts, dev)
    if opt.shard_dp > 1:
        dist.all_reduce(sq, group=opt.ctx.dp_group)
    if opt.has_experts:   # every expert element once: over its edp shards, then over the experts of the stage
        if opt.expert_shard_dp > 1:
            dist.all_reduce(esq, group=opt.ctx.edp_group)
        if opt.ctx.etp_ep_size > 1:
            dist.all_reduce(esq, group=opt.ctx.etp_ep_group)
        if tp_rank == 0:   # the stage's whole expert total, counted on one tp rank of the model-parallel sum
            sq += esq
    opt.ctx.sum_over_model_parallel(sq)  # tp × pp (per-stage layouts: once per stage replica)
    return sq
