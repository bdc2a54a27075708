"""Fused vocabulary-parallel cross-entropy (Megatron-LM's ``--cross-entropy-loss-fusion``), chunked over tokens.

The unfused version (``cross_entropy.py``) converts this rank's logits shard ``[tokens, V/tp]`` to fp32
whole, keeps three fp32 copies of it alive in the forward and saves the fp32 softmax for the backward:
with bf16 logits that is six times the logits' own memory. This one computes the same function and
never holds more than one chunk of tokens in fp32:

1. the row maximum over this rank's real columns, read from the logits in their own dtype (the
   maximum of bf16 numbers is exact), then one MAX all-reduce over tp;
2. chunk by chunk of tokens: the fp32 chunk minus the maximum, its ``sum(exp)`` and the label's
   shifted logit; then ONE all-reduce over tp of both (the unfused version issues three all-reduces,
   this one two, as Megatron-LM's fused kernel does);
3. the backward, chunk by chunk again, recomputes ``exp(logit − max) / sum`` from the saved logits
   (in their own dtype) and writes the gradient of each chunk in the logits' dtype.

Every element goes through the same operations in the same order as in the unfused version, so the
loss and the gradients agree to the rounding of the element-wise kernels (on one CPU, bitwise where
those kernels treat a chunk as they treat the whole). Saved for the backward: the logits themselves
(not an fp32 softmax) and two fp32 numbers per token.

The per-chunk work is two pure functions (`CrossEntropyKernels`): plain PyTorch, or compiled with
torch.compile (``--torch-compile``), each then one or two generated kernels per chunk. Compiled by inductor
(``fuses``) their fp32 values stay inside the generated kernels — its code for a chunk allocates the two fp32
numbers per token and, in the backward, the gradient in the logits' dtype, nothing of the chunk's size in fp32 —
so the whole input is one chunk: one call each way instead of one per 256 MiB of fp32, and the backward returns
the kernel's gradient instead of copying it into a buffer of the logits' size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..parallel import ParallelContext

__all__ = ["fused_vocab_parallel_cross_entropy", "CrossEntropyKernels", "eager_kernels", "compiled_kernels",
           "fusing_backend", "chunk_tokens_for", "DEFAULT_CHUNK_BYTES"]

#: fp32 bytes one chunk may take (tokens × local vocabulary × 4): bounds the transient memory
DEFAULT_CHUNK_BYTES = 256 * 2 ** 20


def chunk_tokens_for(local_vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's fp32 logits take at most ``chunk_bytes`` (at least one token)."""
    return max(1, chunk_bytes // (4 * max(local_vocab, 1)))


def _shifted(logits: torch.Tensor, row_max: torch.Tensor, valid: int) -> torch.Tensor:
    """fp32 ``logits − row_max`` with the padding columns (``>= valid``) at −inf (a new tensor)."""
    x = logits.float()
    if valid < x.size(-1):
        cols = torch.arange(x.size(-1), device=x.device)
        x = x.masked_fill(cols >= valid, float("-inf"))
    return x - row_max.unsqueeze(-1)


def _local_labels(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    outside = (labels < start) | (labels >= start + width)
    return (labels - start).masked_fill(outside, 0), outside


def _stats(logits: torch.Tensor, labels: torch.Tensor, row_max: torch.Tensor, start: int,
           valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's ``sum(exp(logit − max))`` over this rank's columns and its labels' shifted logits
    (0 where the label is another rank's)."""
    shifted = _shifted(logits, row_max, valid)
    local, outside = _local_labels(labels, start, logits.size(-1))
    target = torch.gather(shifted, -1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return torch.exp(shifted).sum(dim=-1), target


def _grad(logits: torch.Tensor, labels: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor,
          grad_loss: torch.Tensor, start: int, valid: int) -> torch.Tensor:
    """One chunk's gradient of the loss with respect to its logits: ``(softmax − onehot) · grad_loss``."""
    softmax = torch.exp(_shifted(logits, row_max, valid)) / sum_exp.unsqueeze(-1)
    local, outside = _local_labels(labels, start, logits.size(-1))
    # softmax − 1 at the label, softmax − 0 elsewhere: the unfused version's scatter_add of −1, element-wise
    # (so that a compiler fuses it with the exponential)
    cols = torch.arange(logits.size(-1), device=logits.device)
    onehot = ((cols == local.unsqueeze(-1)) & ~outside.unsqueeze(-1)).to(softmax.dtype)
    grad = softmax - onehot
    return (grad * grad_loss.unsqueeze(-1).to(grad.dtype)).to(logits.dtype)


@dataclass(frozen=True)
class CrossEntropyKernels:
    """The per-chunk functions: ``stats`` (forward) and ``grad`` (backward)."""

    stats: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    grad: Callable[..., torch.Tensor]
    name: str = "eager"
    #: the functions keep their fp32 intermediates inside their kernels (inductor): a chunk costs no fp32 memory
    #: of its size, so the default chunk is the whole input
    fuses: bool = False


def eager_kernels() -> CrossEntropyKernels:
    return CrossEntropyKernels(_stats, _grad, "eager")


_COMPILED: dict[tuple, CrossEntropyKernels] = {}


def fusing_backend(backend) -> bool:
    """Whether torch.compile's ``backend`` keeps the chunk functions' fp32 values inside its kernels (inductor)."""
    return backend == "inductor"


def compiled_kernels(backend="inductor", mode: str | None = None) -> CrossEntropyKernels:
    """The per-chunk functions compiled with torch.compile (``backend``: a name or a callable; built once per
    backend and mode)."""
    key = (backend, mode or "default")
    if key not in _COMPILED:
        opts = dict(backend=backend, dynamic=False, mode=None if mode in (None, "default") else mode)
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
        _COMPILED[key] = CrossEntropyKernels(torch.compile(_stats, **opts), torch.compile(_grad, **opts),
                                             f"compiled ({name})", fuses=fusing_backend(backend))
    return _COMPILED[key]


def _all_reduce(x: torch.Tensor, ctx: ParallelContext, op=dist.ReduceOp.SUM) -> None:
    if ctx.tp_size > 1:
        dist.all_reduce(x, op=op, group=ctx.tp_group)


class _FusedVocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits, labels, ctx, vocab_size, chunk, kernels):
        shape = labels.shape
        rows = logits.reshape(-1, logits.size(-1))
        flat_labels = labels.reshape(-1)
        local_v = rows.size(-1)
        start = ctx.tp_rank() * local_v
        valid = local_v if vocab_size is None else min(max(vocab_size - start, 0), local_v)
        if valid > 0:
            row_max = rows[:, :valid].amax(dim=-1).float()
        else:  # this whole shard is vocabulary padding
            row_max = torch.full((rows.size(0),), float("-inf"), device=rows.device)
        _all_reduce(row_max, ctx, dist.ReduceOp.MAX)
        n = rows.size(0)
        packed = torch.empty(2, n, dtype=torch.float32, device=rows.device)  # [sum_exp; target]: one all-reduce
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            packed[0, a:b], packed[1, a:b] = kernels.stats(rows[a:b], flat_labels[a:b], row_max[a:b], start, valid)
        _all_reduce(packed, ctx)
        sum_exp, target = packed[0], packed[1]
        fctx.save_for_backward(rows, flat_labels, row_max, sum_exp)
        fctx.meta = (logits.shape, start, valid, chunk, kernels)
        return torch.log(sum_exp.view(shape)) - target.view(shape)

    @staticmethod
    def backward(fctx, grad_loss):
        rows, flat_labels, row_max, sum_exp = fctx.saved_tensors
        shape, start, valid, chunk, kernels = fctx.meta
        g = grad_loss.reshape(-1)
        if chunk >= rows.size(0):  # one chunk: the kernel's gradient is the result, no copy into a buffer
            grad = kernels.grad(rows, flat_labels, row_max, sum_exp, g, start, valid)
            return grad.reshape(shape), None, None, None, None, None
        grad = torch.empty_like(rows)
        for a in range(0, rows.size(0), chunk):
            b = min(a + chunk, rows.size(0))
            grad[a:b] = kernels.grad(rows[a:b], flat_labels[a:b], row_max[a:b], sum_exp[a:b], g[a:b], start, valid)
        return grad.view(shape), None, None, None, None, None


def fused_vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, ctx: ParallelContext,
                                       vocab_size: int | None = None, *, chunk_tokens: int | None = None,
                                       kernels: CrossEntropyKernels | None = None) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of ``labels``): `vocab_parallel_cross_entropy`'s function and
    arguments, chunked over ``chunk_tokens`` tokens at a time (default: `DEFAULT_CHUNK_BYTES` of fp32 per
    chunk; the whole input when ``kernels.fuses``) with ``kernels`` (default: plain PyTorch)."""
    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and labels {tuple(labels.shape)} disagree: "
                         "labels must have the logits' shape without the vocabulary dim")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    kernels = kernels or eager_kernels()
    tokens = logits_shard.numel() // max(logits_shard.size(-1), 1)
    chunk = chunk_tokens or (max(tokens, 1) if kernels.fuses else chunk_tokens_for(logits_shard.size(-1)))
    return _FusedVocabParallelCE.apply(logits_shard, labels, ctx, vocab_size, chunk, kernels)
