"""Backward through a stage whose sent output's data may already be freed (Megatron's ``custom_backward`` and
``deallocate_output_tensor``): the runtime keeps a sent activation's autograd graph and drops its data once the
send is known complete, when nothing in the graph saved it."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["run_backward", "run_backward_many", "can_free_outputs", "safe_to_free"]


# the autograd engine, called directly: it checks a gradient against the shape recorded in the graph, not against
# the output's (``(1,)`` once its data is freed); without it outputs are never freed (`can_free_outputs`)
_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)


def run_backward_many(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Backward from outputs whose data may be freed (only their graph is left), in one pass: a stage with several
    outgoing edges (chain + skip tensors) gives all of them (what Megatron's ``custom_backward`` does for one)."""
    if _ENGINE is None:  # pragma: no cover - outputs are then never freed
        torch.autograd.backward(list(outs), list(grads))
        return
    _ENGINE.run_backward(tuple(outs), tuple(grads), False, False, (), True, True)


def run_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """`run_backward_many` for one output; ``grad`` None: ``out`` is the loss."""
    if grad is None:
        out.backward()
        return
    run_backward_many((out,), (grad,))


def can_free_outputs() -> bool:
    return _ENGINE is not None


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
