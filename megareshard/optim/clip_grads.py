"""Gradient norm over the whole model, whatever the layout, and clipping by it.

Each parameter element must be counted exactly once across all model-parallel ranks:
tp-sharded parameters are counted by every tp rank (each holds a different slice);
parameters replicated over tp only by tp rank 0; a duplicate of a tied parameter held
by a second pipeline stage (``shared_embedding_duplicate``) not at all. The squared
sums are then added over the model-parallel (tp × pp) group. Computed in fp32.

The trainer's ``ZeroOptimizer`` applies the same rule (``counts_in_grad_norm``) to its
shards; ``clip_grad_norm_`` is the plain path for full local gradients, and the
reference the ZeRO tests compare against.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..parallel import ParallelContext


def counts_in_grad_norm(p: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of ``p`` contributes to the global gradient norm."""
    if getattr(p, "shared_embedding_duplicate", False):
        return False
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


def global_grad_norm(params: Iterable[torch.nn.Parameter], ctx: ParallelContext) -> float:
    """L2 norm of all gradients of the full model (identical on every rank)."""
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    tp_rank = ctx.tp_rank()
    for p in params:
        if counts_in_grad_norm(p, tp_rank):
            sq += p.grad.detach().float().pow(2).sum()
    ctx.sum_over_model_parallel(sq)  # over tp × pp (per-stage layouts: once per stage replica)
    return sq.sqrt().item()


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, ctx: ParallelContext) -> float:
    """Scale gradients so their global norm is at most ``max_norm`` (0 disables); returns the norm before."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, ctx)
    if max_norm > 0 and total > max_norm:
        coeff = max_norm / (total + 1e-6)
        torch._foreach_mul_([p.grad for p in params], coeff)
    return total
