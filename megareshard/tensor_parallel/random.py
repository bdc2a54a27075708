"""Named RNG streams per tensor-parallel rank (Megatron's CUDA RNG tracker, without globals).

Why two streams:

* ``"default"`` — identical on every tp rank. Dropout on tensors that are *replicated*
  over tp (hidden states between blocks without sequence parallelism) must draw the
  same mask everywhere, or the replicas diverge.
* ``"model-parallel"`` — seeded ``seed + 2718 + tp_rank``. Dropout on tensors that are
  *sharded* over tp (attention probabilities of this rank's heads, sequence-sharded
  hidden states under sequence parallelism) must draw different masks on different
  ranks, or every shard would repeat the same pattern.

``fork(name)`` swaps the device's global generator state for the stream's, runs the
block, stores the advanced state back and restores the outer state. Kernels that take
no ``generator`` argument (``F.dropout``, fused SDPA dropout on CUDA) therefore draw from
the stream. ``state_dict()`` / ``load_state_dict()`` capture the streams exactly, for
checkpoints and for replaying a forward during activation recomputation.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["RNGStreams", "DEFAULT_STREAM", "MODEL_PARALLEL_STREAM", "MODEL_PARALLEL_SEED_OFFSET"]

DEFAULT_STREAM = "default"
MODEL_PARALLEL_STREAM = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718
PIPELINE_SEED_STRIDE = 100  # Megatron: each pipeline stage offsets its seeds by 100 · pp_rank


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStreams:
    """Named generator states for one process; owned by a model (or the training state)."""

    def __init__(self, seed: int, tp_rank: int = 0, pp_rank: int = 0,
                 device: torch.device | str | None = None) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.seed, self.tp_rank, self.pp_rank = int(seed), int(tp_rank), int(pp_rank)
        base = self.seed + PIPELINE_SEED_STRIDE * self.pp_rank
        self._states: dict[str, torch.Tensor] = {}
        self.add(DEFAULT_STREAM, base)
        self.add(MODEL_PARALLEL_STREAM, base + MODEL_PARALLEL_SEED_OFFSET + self.tp_rank)

    @classmethod
    def for_context(cls, seed: int, ctx, device: torch.device | str | None = None) -> "RNGStreams":
        """Streams for this rank of ``ctx`` (a ParallelContext)."""
        return cls(seed, tp_rank=ctx.tp_rank(), pp_rank=ctx.pp_rank(), device=device)

    def add(self, name: str, seed: int) -> None:
        """Register a stream seeded with ``seed`` (e.g. an extra stream for expert layers)."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists (streams: {sorted(self._states)})")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self._states[name] = gen.get_state()

    @property
    def names(self) -> list[str]:
        return list(self._states)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_STREAM) -> Iterator[None]:
        """Run the block with the device's global RNG drawing from stream ``name``."""
        if name not in self._states:
            raise KeyError(f"unknown RNG stream {name!r}; streams: {sorted(self._states)}")
        outer = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, outer)

    def state_dict(self) -> dict:
        """Exact copy of every stream (CPU byte tensors), for checkpoints and recomputation."""
        return {"seed": self.seed, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                "states": {k: v.clone().cpu() for k, v in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        missing = set(self._states) - set(state["states"])
        if missing:
            raise KeyError(f"RNG state lacks streams {sorted(missing)} (has {sorted(state['states'])})")
        self._states = {k: v.clone().cpu() for k, v in state["states"].items()}
