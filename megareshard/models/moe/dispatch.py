"""Token dispatchers: routed tokens to the ranks that hold their experts and back (Megatron-Core's
token_dispatcher.py, ``MoEAlltoAllTokenDispatcher`` and ``MoEAllGatherTokenDispatcher``).

Each rank starts with its own tokens ``[T, h]`` (its sequence chunk under sequence parallelism) and ends with
their outputs; in between every expert sees the rows routed to it from the whole ``etp × ep`` group.

``alltoall`` (Megatron's steps): permute the local tokens by expert; count them per expert and all-gather the
counts over ``etp × ep``; all-to-all over ep (rank i gets the rows of its experts); all-gather over etp
(the ranks sharing an expert's width all need its rows); sort the received chunks from (source, expert) to
(expert, source) order; experts; then the reverse: unsort, reduce-scatter over etp (the partial sums of the
row-parallel fc2), all-to-all back, and sum each token's k rows (``unpermute``).

``allgather``: all-gather tokens, probabilities and routing map over ``etp × ep`` (every rank the same number
of tokens), keep the rows of the local experts, experts, put the rows back into the gathered tokens'
places and reduce-scatter over ``etp × ep`` (each rank receives its tokens, summed over experts and etp).

Every rank of a group issues the same collectives in the same order; the sizes (row counts) are known on
every rank from the all-gathered counts before the all-to-alls that use them.
"""
from __future__ import annotations

import torch

from ...parallel import ParallelContext
from .comm import all_gather_counts, all_to_all, gather_rows, reduce_scatter_rows
from .routing import permute, unpermute

__all__ = ["AlltoAllDispatcher", "AllGatherDispatcher", "make_dispatcher"]


def _reorder(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order]) if chunks else x


class AlltoAllDispatcher:
    """All-to-all over ep, all-gather / reduce-scatter over etp."""

    def __init__(self, ctx: ParallelContext, num_experts: int, local_expert_indices: list[int]) -> None:
        self.ctx, self.num_experts = ctx, num_experts
        self.first, self.num_local = local_expert_indices[0], len(local_expert_indices)
        self.ep, self.etp = ctx.ep_size, ctx.etp_size

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """``x [T, h]``, ``probs``/``routing_map [T, E]`` -> rows for the local experts, their counts, their probs."""
        ctx, L = self.ctx, self.num_local
        self.num_tokens = x.size(0)
        rows, row_probs, self.sorted_indices = permute(x, routing_map, probs)
        local_counts = routing_map.sum(dim=0).long()                                  # [E]
        if self.ep * self.etp > 1:
            counts = all_gather_counts(local_counts, ctx.etp_ep_group)              # [ep·etp, E], ep-major
            counts = counts.view(self.ep, self.etp, -1).transpose(0, 1)            # [etp, ep, E]
            mine = counts[:, :, self.first:self.first + L]                          # [etp, ep, L]
            per_rank = mine.sum(dim=2)                                              # [etp, ep]
            self.in_splits = local_counts.view(self.ep, L).sum(dim=1).tolist()
            self.out_splits = per_rank[ctx.etp_rank()].tolist()
            self.tp_splits = per_rank.sum(dim=1).tolist()
            chunk_counts = mine.reshape(-1, L)                                      # [etp·ep, L]
        else:
            chunk_counts = local_counts.view(1, L)
        rows = all_to_all(rows, ctx.ep_group, self.out_splits, self.in_splits) if self.ep > 1 else rows
        row_probs = all_to_all(row_probs, ctx.ep_group, self.out_splits, self.in_splits) if self.ep > 1 else row_probs
        if self.etp > 1:
            rows = gather_rows(rows, ctx.etp_group, self.tp_splits)
            row_probs = gather_rows(row_probs, ctx.etp_group, self.tp_splits)
        sources = chunk_counts.size(0)
        self.chunk_sizes = chunk_counts.reshape(-1).tolist()                        # (source, expert) order
        if L > 1:
            self.by_expert = [s * L + e for e in range(L) for s in range(sources)]
            rows = _reorder(rows, self.chunk_sizes, self.by_expert)
            row_probs = _reorder(row_probs, self.chunk_sizes, self.by_expert)
        return rows, chunk_counts.sum(dim=0).tolist(), row_probs

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """Expert outputs (as `dispatch` returned the rows) -> ``[T, h]``, each token's rows summed."""
        ctx = self.ctx
        if self.num_local > 1:
            sizes = [self.chunk_sizes[i] for i in self.by_expert]
            back = sorted(range(len(self.by_expert)), key=self.by_expert.__getitem__)
            y = _reorder(y, sizes, back)
        if self.etp > 1:
            y = reduce_scatter_rows(y, ctx.etp_group, self.tp_splits)
        if self.ep > 1:
            y = all_to_all(y, ctx.ep_group, self.in_splits, self.out_splits)
        return unpermute(y, self.sorted_indices, self.num_tokens)


class AllGatherDispatcher:
    """All-gather over etp × ep, reduce-scatter back."""

    def __init__(self, ctx: ParallelContext, num_experts: int, local_expert_indices: list[int]) -> None:
        self.ctx, self.num_experts = ctx, num_experts
        self.first, self.num_local = local_expert_indices[0], len(local_expert_indices)
        self.n = ctx.etp_ep_size

    def dispatch(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        group, n = self.ctx.etp_ep_group, self.n
        self.num_tokens = x.size(0)
        if n > 1:
            sizes = [x.size(0)] * n
            routing_map = all_gather_counts(routing_map.to(torch.int32).reshape(-1), group).view(
                -1, self.num_experts).bool()
            probs = gather_rows(probs, group, sizes)
            x = gather_rows(x, group, sizes)
        self.gathered = x.size(0)
        local_map = routing_map[:, self.first:self.first + self.num_local]
        rows, row_probs, self.sorted_indices = permute(x, local_map, probs[:, self.first:self.first + self.num_local])
        return rows, local_map.sum(dim=0).tolist(), row_probs

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        out = unpermute(y, self.sorted_indices, self.gathered)
        if self.n > 1:
            out = reduce_scatter_rows(out, self.ctx.etp_ep_group, [self.num_tokens] * self.n)
        return out


def make_dispatcher(kind: str, ctx: ParallelContext, num_experts: int, local_expert_indices: list[int]):
    """``alltoall`` or ``allgather`` (``moe_token_dispatcher_type``)."""
    cls = {"alltoall": AlltoAllDispatcher, "allgather": AllGatherDispatcher}[kind]
    return cls(ctx, num_experts, local_expert_indices)
