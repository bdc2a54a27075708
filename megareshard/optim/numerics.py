"""Megatron's ``--check-for-nan-in-loss-and-grad``: stop at the first non-finite loss or gradient.

Before the data-parallel gradient reduction each rank computes the norm of each of its gradients
(``GradNorms``: one multi-tensor kernel, kept on the device; as Megatron checks each bucket before its
collective; not possible with ``--overlap-grad-reduce``, whose reductions start during the backward).
After the backward and before the optimizer step, every rank knows the global gradient norm (it is
all-reduced over the world), and one MAX all-reduce of a flag (``nonfinite_anywhere``) tells every rank
whether any rank's loss is non-finite; the trainer reads both, with the logged loss, in the iteration's one
host read. When either is non-finite, all ranks take the same path:
each names its first parameter whose gradient holds a NaN or an inf, the names are gathered, and
every rank raises the same ``NonFiniteError`` (iteration, ranks, parameter): no rank steps, no
rank is left waiting in a collective. The parameters are untouched, so the last checkpoint is clean.

With fp16 and a loss scaler, non-finite gradients are overflows of the scaled loss: the step is
skipped and the scale lowered (``grad_scaler``), not stopped; a non-finite loss still stops.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["NonFiniteError", "GradNorms", "grad_norms", "first_nonfinite_grad", "nonfinite_anywhere",
           "check_loss_and_grad"]


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient stopped training; the message names the iteration, ranks and parameter."""


def first_nonfinite_grad(named_params: Iterable[tuple[str, torch.nn.Parameter]],
                         master_grads: dict[str, torch.Tensor] | None = None) -> tuple[str, str] | None:
    """(name, 'nan' or 'inf') of the first parameter (model order) whose gradient is not finite, else None.

    ``master_grads`` (name -> fp32 gradient shard, ZeRO) is looked at where the parameter's own
    ``.grad`` was freed (ZeRO 2)."""
    master_grads = master_grads or {}
    grads = [(name, g) for name, p in named_params for g in (p.grad, master_grads.get(name))
             if g is not None and g.numel()]
    if not grads:
        return None
    # one flag per gradient computed on its device, then a single transfer (not one synchronisation per parameter)
    finite = torch.stack([torch.isfinite(g).all().to(grads[0][1].device) for _, g in grads]).tolist()
    for (name, g), ok in zip(grads, finite):
        if not ok:
            return name, "nan" if bool(torch.isnan(g).any()) else "inf"
    return None


class GradNorms:
    """Each gradient's norm, computed on the device (``grad_norms``) and read on the host only when asked: a
    gradient holding a NaN has a NaN norm, one holding an inf (and no NaN) an infinite one. A gradient whose
    sum of squares overflows fp32 (elements beyond about 1e19) counts as infinite too, as it does in the
    global norm."""

    def __init__(self, names: list[str], norms: torch.Tensor | None):
        self.names, self.norms = names, norms

    def first_nonfinite(self) -> tuple[str, str] | None:
        """(name, 'nan' or 'inf') of the first gradient (model order) whose norm is not finite, else None."""
        if self.norms is None:
            return None
        for name, v in zip(self.names, self.norms.tolist()):
            if not math.isfinite(v):
                return name, "nan" if math.isnan(v) else "inf"
        return None


def grad_norms(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> GradNorms:
    """The norms of the parameters' current gradients (one ``torch._foreach_norm`` computing them in fp32, one
    stack; no host read). Runs every iteration under --check-for-nan-in-loss-and-grad (Megatron's default), so it
    launches a fixed number of kernels, not one a gradient."""
    grads = [(name, p.grad) for name, p in named_params if p.grad is not None and p.grad.numel()]
    if not grads:
        return GradNorms([], None)
    dev = grads[0][1].device
    norms = torch._foreach_norm([g for _, g in grads], 2, dtype=torch.float32)
    if any(n.device != dev for n in norms):   # gradients on several devices (not the training loop's case)
        norms = [n.to(dev) for n in norms]
    return GradNorms([name for name, _ in grads], torch.stack(norms))


def nonfinite_anywhere(loss: torch.Tensor) -> torch.Tensor:
    """A 1-element fp32 flag, 1 where any rank's ``loss`` is not finite (MAX all-reduce over the world, launched
    here, read with the iteration's other numbers)."""
    flag = (~torch.isfinite(loss.detach().float())).any().float().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def check_loss_and_grad(*, iteration: int, rank: int, local_loss: float, bad_loss_anywhere: bool, grad_norm: float,
                        overflow_skips: bool, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                        master_grads: dict[str, torch.Tensor] | None,
                        before_reduction: GradNorms | None = None) -> None:
    """Collective over the world when it raises (every rank calls it at the same point with the same
    ``bad_loss_anywhere`` and ``grad_norm``). Raises ``NonFiniteError`` on every rank when any rank's loss
    (``bad_loss_anywhere``: ``nonfinite_anywhere``, read), or the global gradient norm, is not finite
    (gradients: unless ``overflow_skips``, fp16 loss scaling, where the step is skipped instead).

    ``before_reduction``: this rank's gradient norms before the data-parallel reduction (which spreads a
    non-finite gradient to every replica), so the message names the rank it came from."""
    bad_grad = not math.isfinite(grad_norm) and not overflow_skips
    if not (bad_loss_anywhere or bad_grad):
        return
    origin = before_reduction.first_nonfinite() if before_reduction is not None else None
    mine = {"rank": rank, "loss": local_loss if not math.isfinite(local_loss) else None,
            "grad": origin or first_nonfinite_grad(named_params, master_grads), "origin": origin is not None}
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    losses = [f"rank {e['rank']} loss {e['loss']}" for e in every if e["loss"] is not None]
    grads = [e for e in every if e["origin"]] or [e for e in every if e["grad"] is not None]
    parts = []
    if losses:
        parts.append("non-finite loss on " + ", ".join(losses))
    if grads:
        first = grads[0]
        parts.append(f"first non-finite parameter gradient: {first['grad'][0]} ({first['grad'][1]}) on rank "
                     f"{first['rank']}" + (" before the data-parallel reduction" if first["origin"] else "")
                     + (f" (also on rank(s) {', '.join(str(e['rank']) for e in grads[1:])})" if len(grads) > 1
                        else ""))
    elif bad_grad:
        parts.append(f"gradient norm {grad_norm}")
    raise NonFiniteError(f"iteration {iteration}: {'; '.join(parts)}; training stopped before the optimizer step "
                         "(parameters unchanged; --no-check-for-nan-in-loss-and-grad disables this check)")
