"""Bucketed data-parallel gradient averaging (the plain, unsharded path).

The trainer reduces gradients inside ``optim.zero.ZeroOptimizer`` (every zero stage);
this class is the simple reference it is tested against, and a building block for
users who drive their own loop.

Gradients are packed into flat buckets (one all-reduce per bucket instead of one per
parameter: latency dominates small messages), reduced asynchronously so buckets overlap
each other, averaged over dp and unpacked. Buckets follow the reverse order of
registration, which is roughly the order backward produces gradients.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


class GradAverager:
    """Average ``.grad`` of ``params`` over a data-parallel group, in buckets of ``bucket_bytes``."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group, dp_size: int,
                 bucket_bytes: int = 25 * 2**20) -> None:
        self.group = group
        self.dp_size = dp_size
        self.buckets: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            if current and (size + p.numel() * p.element_size() > bucket_bytes or p.dtype != current[0].dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self.buckets.append(current)

    def average(self) -> None:
        """All-reduce and divide by dp; parameters without a gradient get zeros (they took no part)."""
        if self.dp_size == 1:
            return
        pending = []
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            pending.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        for bucket, flat, work in pending:
            work.wait()
            flat.div_(self.dp_size)
            offset = 0
            for p in bucket:
                n = p.numel()
                piece = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
                offset += n
