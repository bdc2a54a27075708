"""Cross-entropy over vocabulary-sharded logits, without ever gathering the logits.

Each tp rank holds ``logits[..., V_pad / tp]`` for its contiguous vocabulary range.
Numerically stable across ranks with three small all-reduces of ``[b, s]`` tensors:

1. MAX of the local row maxima (subtract it: no overflow in ``exp``),
2. SUM of the target logit (only the rank owning the label contributes, others add 0),
3. SUM of ``sum(exp(logit - max))``.

loss = log(sum_exp) - (target_logit - max). Computed in fp32 whatever the logits' dtype
(bf16 logits would otherwise lose most of the loss's precision).

Vocabulary padding: columns whose global index is ``>= vocab_size`` are padding (the
embedding rows behind them are zero, so their logits are 0, not -inf). They are set to
-inf here, so they neither enter the softmax sum nor receive gradient: padding never
changes the loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import ParallelContext

__all__ = ["vocab_parallel_cross_entropy", "vocab_range"]


def vocab_range(padded_vocab: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, stop) of the global vocabulary indices held by ``tp_rank``."""
    if padded_vocab % tp_size:
        raise ValueError(f"padded vocabulary {padded_vocab} is not divisible by tensor-parallel size {tp_size}")
    per = padded_vocab // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def _all_reduce(x: torch.Tensor, ctx: ParallelContext, op=dist.ReduceOp.SUM) -> None:
    if ctx.tp_size > 1:
        dist.all_reduce(x, op=op, group=ctx.tp_group)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, labels, ctx, vocab_size):
        in_dtype = logits.dtype
        logits = logits.float()
        local_v = logits.size(-1)
        start = ctx.tp_rank() * local_v
        stop = start + local_v
        if vocab_size is not None and stop > vocab_size:
            # padding columns of this shard: exclude them from max, softmax and gradient
            logits = logits.clone()
            logits[..., max(vocab_size - start, 0):] = float("-inf")

        logits_max = logits.max(dim=-1).values
        _all_reduce(logits_max, ctx, dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)          # new tensor; input untouched

        outside = (labels < start) | (labels >= stop)
        local_labels = (labels - start).masked_fill(outside, 0)
        target = torch.gather(logits, -1, local_labels.unsqueeze(-1)).squeeze(-1)
        target = target.masked_fill(outside, 0.0)
        _all_reduce(target, ctx)

        exp_logits = torch.exp(logits)
        sum_exp = exp_logits.sum(dim=-1)
        _all_reduce(sum_exp, ctx)
        loss = torch.log(sum_exp) - target

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        fctx.save_for_backward(softmax, outside, local_labels)
        fctx.in_dtype = in_dtype
        return loss

    @staticmethod
    def backward(fctx, grad_loss):
        softmax, outside, local_labels = fctx.saved_tensors
        grad = softmax  # reuse the buffer: d loss / d logits = softmax - onehot(label)
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -onehot)
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad.to(fctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, ctx: ParallelContext,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of ``labels``) from this rank's vocab shard of the logits.

    ``logits_shard``: ``[..., V_pad / tp]``, rank r holding columns ``[r·V_pad/tp, (r+1)·V_pad/tp)``.
    ``labels``: int64 ``[...]`` global vocabulary indices (``< vocab_size``).
    ``vocab_size``: the real (unpadded) vocabulary; columns at or beyond it are ignored.
    With ``ctx.tp_size == 1`` no collective is issued.
    """
    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and labels {tuple(labels.shape)} disagree: "
                         "labels must have the logits' shape without the vocabulary dim")
    return _VocabParallelCE.apply(logits_shard, labels, ctx, vocab_size)
