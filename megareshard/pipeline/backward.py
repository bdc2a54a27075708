"""Backward through a stage whose sent output's data may already be freed (Megatron's ``custom_backward`` and
``deallocate_output_tensor``): the runtime keeps a sent activation's autograd graph and drops its data once the
send is known complete, when nothing in the graph saved it."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["run_backward", "run_backward_many", "can_free_outputs", "safe_to_free"]


def run_backward_many(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """`run_backward` for a stage with several outgoing edges (chain + skip tensors), in one pass."""
    if len(outs) == 1:
        run_backward(outs[0], grads[0])
        return
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None:  # pragma: no cover
        torch.autograd.backward(list(outs), list(grads))
        return
    engine.run_backward(tuple(outs), tuple(grads), False, False, (), True, True)


def run_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward that accepts an output whose data was freed (only its graph is left).

    ``torch.autograd.backward`` compares the gradient's shape with ``out.shape``, which is
    ``(1,)`` once the data is freed; the engine itself checks against the shape recorded
    in the graph, so call it directly (what Megatron's ``custom_backward`` does).
    """
    if grad is None:
        out.backward()
        return
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None:  # pragma: no cover - outputs are then never freed (see safe_to_free)
        torch.autograd.backward(out, grad)
        return
    engine.run_backward((out,), (grad,), False, False, (), True, True)


def can_free_outputs() -> bool:
    return getattr(torch.autograd.Variable, "_execution_engine", None) is not None


def safe_to_free(t: torch.Tensor) -> bool:
    """True when no autograd node of ``t`` saved ``t`` itself (then backward never reads its data).

    The GPT's stage output is a residual add (saves nothing), but a model whose last op
    saves its result (e.g. ``tanh``) must keep it: check instead of assuming.
    """
    fn = t.grad_fn
    if fn is None or t._base is not None:
        return False
    ptr = t.untyped_storage().data_ptr()
    for name in dir(fn):
        if not name.startswith("_saved_"):
            continue
        try:
            v = getattr(fn, name)
        except Exception:
            continue
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == ptr:
                return False
    return True
