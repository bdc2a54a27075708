"""What stays outside the compiled regions of a model (``--torch-compile``), as graph breaks.

A compiled region (a Transformer layer, the loss head) is traced by torch.compile; a few things in it
must run as written instead, eagerly and in the order the program issues them:

* tensor-parallel collectives (``tensor_parallel/mappings.py``): every member of a communicator issues
  the same operations in the same order, from one thread (NCCL's rules, checked on gloo by
  ``nccl_check``): traced into a graph they would leave that order to the compiler;
* the linear layer whose weight gradient may be delayed (``LinearWithWeightGradStore``): its backward
  decides at backward time whether to queue the weight-gradient work (the I/W split);
* dropout drawn from megareshard's named RNG streams, activation recomputation's replay, and every
  element-wise chain whose fusion is switched off (``--no-bias-gelu-fusion`` ...).

``outside_compiled_regions`` marks such a module-level function. Nothing changes until a model is
compiled: then `prepare_graph_breaks` rebinds each marked function, in its module, to its
``torch.compiler.disable`` version, which a compiled region calls as a graph break (and an eager caller
as the function itself, through a thin wrapper). Callers therefore reach a marked function through its
module's globals at call time (a plain call in the same module, or ``module.fn``), never through a
reference taken earlier. Importing a model never imports the compiler.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

__all__ = ["outside_compiled_regions", "prepare_graph_breaks"]

_MARKED: list[tuple[str, str, Callable[..., Any]]] = []


def outside_compiled_regions(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark module-level ``fn`` to run eagerly, as a graph break, when a compiled region calls it (returns
    ``fn`` itself; see the module docstring)."""
    _MARKED.append((fn.__module__, fn.__name__, fn))
    return fn


def prepare_graph_breaks() -> None:
    """Rebind every marked function to its ``torch.compiler.disable`` version (before anything is traced)."""
    for module, name, fn in _MARKED:
        mod = sys.modules[module]
        if getattr(mod, name) is fn:
            setattr(mod, name, torch.compiler.disable(fn, recursive=True))
