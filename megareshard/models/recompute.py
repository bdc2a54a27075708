"""Activation recomputation (Megatron's ``--recompute-activations`` / ``--recompute-granularity full``).

``checkpoint(fn, *args, streams=...)`` runs ``fn`` without keeping its intermediate
activations; backward runs it again (``torch.utils.checkpoint``, non-reentrant) to get
them back. For the replay to be the same computation, every random draw must repeat:

* torch's global RNG (CPU, and the CUDA device's) is restored by checkpoint's
  ``preserve_rng_state=True``;
* our named dropout streams (``RNGStreams``) live outside torch's global state — ``fork``
  swaps a stream's state in and stores the advanced one back — so the wrapper snapshots
  the streams at the first forward, loads the snapshot for the replay and puts the
  streams' *current* state back afterwards (later forwards are unaffected).

Granularities (``GPTModel(recompute_granularity=…)``):

* ``"selective"``: only the attention core (``softmax(QKᵀ)V`` with its dropout) of every
  layer — the part whose activations grow with ``s²`` and cost few FLOPs to redo;
* ``"full"``: whole Transformer layers, the first ``recompute_num_layers`` layers of the
  stage (Megatron's "block" method): only each layer's input is kept.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Iterable

import torch
import torch.utils.checkpoint as _cp

__all__ = ["checkpoint", "configure_recompute", "replaying", "RECOMPUTE_GRANULARITIES"]

RECOMPUTE_GRANULARITIES = ("selective", "full")

# Activation meters (megareshard.memory.ActivationMeter) measuring in this context: a checkpointed
# region keeps its inputs alive outside autograd's saved tensors, so it reports them to them.
# A ContextVar of immutable tuples: dynamically scoped by the meter's `with`, no shared mutable state.
ACTIVE_METERS: ContextVar[tuple] = ContextVar("megareshard_activation_meters", default=())
# True while a checkpointed region runs again in backward (set and read in the thread that replays it)
_REPLAYING: ContextVar[bool] = ContextVar("megareshard_recompute_replaying", default=False)


def replaying() -> bool:
    """Whether the caller runs inside the backward's replay of a checkpointed region: what a forward records
    beside its outputs (the MoE router's losses for the log) it recorded at the first run already."""
    return _REPLAYING.get()


def configure_recompute(layers: Iterable[Any], granularity: str | None, num_layers: int | None) -> int:
    """Apply a granularity to a stage's Transformer layers; returns how many whole layers to recompute
    ("full": the first ``num_layers``, all by default; "selective": the attention core of every layer)."""
    layers = list(layers)
    if granularity == "selective":
        for layer in layers:
            layer.attention.recompute_core = True
    if granularity != "full":
        return 0
    return len(layers) if num_layers is None else min(num_layers, len(layers))


def checkpoint(fn: Callable[..., Any], *args: Any, streams=None) -> Any:
    """``fn(*args)`` with its activations recomputed in backward; dropout masks identical.

    ``streams``: the ``RNGStreams`` that ``fn`` forks (None when it draws no random numbers).
    Without grad (evaluation) it is a plain call.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    for meter in ACTIVE_METERS.get():
        meter.keep(*[a for a in args if torch.is_tensor(a)])
    snapshot = streams.state_dict() if streams is not None else None
    calls = [0]

    def run(*a):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        token = _REPLAYING.set(True)
        try:
            if snapshot is None:
                return fn(*a)
            current = streams.state_dict()
            streams.load_state_dict(snapshot)
            try:
                return fn(*a)
            finally:
                streams.load_state_dict(current)
        finally:
            _REPLAYING.reset(token)

    return _cp.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
