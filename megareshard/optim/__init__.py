"""Optimizer pieces: AdamW parameter groups, learning-rate schedule, model-parallel gradient clipping."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .lr_scheduler import LRScheduler, WarmupCosine

if TYPE_CHECKING:
    import torch

    from .clip_grads import clip_grad_norm_, global_grad_norm


def build_adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                eps: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (biases, LayerNorm and 1-D parameters are exempt).

    Uses PyTorch's fused (GPU) or foreach implementation; apex's FusedAdam is not needed for that.
    """
    import torch

    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_gpu = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_gpu or None,
                             foreach=None if on_gpu else True)


__all__ = ["LRScheduler", "WarmupCosine", "build_adamw", "clip_grad_norm_", "global_grad_norm"]


def __getattr__(name: str) -> Any:
    """The gradient-clipping functions, imported on first use: the argument checks import the learning-rate
    schedule from this package without loading torch (``pretrain_gpt.py --validate-only`` answers in a second)."""
    if name in ("clip_grad_norm_", "global_grad_norm"):
        from . import clip_grads

        return getattr(clip_grads, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
