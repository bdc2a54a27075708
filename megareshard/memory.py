"""Per-rank memory accounting: parameters, gradients, optimizer state, peak activations.

Everything is MEASURED from the tensors that exist, never computed from formulas:
bytes are summed over distinct storages (a view and its base, or a master shard that is a
view of its parameter, count once).

Peak activations:

* CUDA: ``torch.cuda.max_memory_allocated`` over the measured span minus the memory
  allocated when it began (``ActivationMeter`` resets the peak statistics on entry);
* CPU (no allocator statistics): the most bytes of distinct storages that autograd holds
  for backward at any moment of the span (``torch.autograd.graph.saved_tensors_hooks``:
  a storage counts from its first pack until backward has unpacked every tensor saved on
  it), excluding parameters, plus the inputs activation recomputation keeps alive. Over one
  iteration this is the activation peak: one microbatch's worth for sequential
  microbatches, the in-flight ones for a pipeline schedule.
  (Max RSS is not used: it never decreases and counts the allocator's caching.)

``max_over(report, group)`` takes the element-wise MAX over a process group (the pipeline
group, or the world): the first stage usually runs out of memory first.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from .models import recompute as _recompute

__all__ = ["MemoryReport", "tensor_bytes", "ActivationMeter", "memory_report", "optimizer_state_bytes", "max_over",
           "format_report"]

MiB = 2 ** 20


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (Nones skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


class ActivationMeter:
    """Context manager measuring the activation memory of the forward passes run inside it.

    ``exclude``: tensors (parameters) whose storages are not activations. ``exclude_live``: a set of
    storage data pointers kept current by its owner (ZeRO-3's gathered parameters, whose storages come
    and go), looked up when a tensor is saved. After exit, ``peak_bytes`` holds the measurement (see the
    module docstring for CPU vs CUDA).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), device: torch.device | str | None = None,
                 exclude_live: set[int] | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._exclude_live = exclude_live if exclude_live is not None else set()
        self._refs: dict[int, int] = {}    # storage -> saved tensors holding it
        self._bytes: dict[int, int] = {}
        self._live = 0
        self._kept = 0
        self.peak_bytes = 0

    def _add(self, t: torch.Tensor) -> int | None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self._exclude or ptr in self._exclude_live or not st.nbytes():
            return None
        if self._refs.get(ptr, 0) == 0:
            self._bytes[ptr] = st.nbytes()
            self._live += st.nbytes()
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        self.peak_bytes = max(self.peak_bytes, self._live + self._kept)
        return ptr

    def keep(self, *tensors: torch.Tensor) -> None:
        """Called by ``recompute.checkpoint`` for the inputs it keeps alive until its backward
        (they are never unpacked through our hooks, so they stay counted for the span)."""
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in self._exclude:
                self._kept += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, self._live + self._kept)

    def _pack(self, t: torch.Tensor):
        return (self._add(t), t)

    def _unpack(self, packed):
        # backward reads each saved tensor once (no retain_graph): after that its node frees it
        ptr, t = packed
        if ptr is not None:
            self._refs[ptr] -= 1
            if self._refs[ptr] == 0:
                self._live -= self._bytes.pop(ptr)
        return t

    def __enter__(self) -> "ActivationMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._token = _recompute.ACTIVE_METERS.set(_recompute.ACTIVE_METERS.get() + (self,))
        return self

    def __exit__(self, *exc) -> None:
        _recompute.ACTIVE_METERS.reset(self._token)
        self._hooks.__exit__(*exc)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        # on CPU peak_bytes was tracked live: the most saved-activation bytes alive at once


@dataclass
class MemoryReport:
    """Bytes on this rank (or the max over a group after ``max_over``)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def memory_report(model: torch.nn.Module, optimizer=None, activations: int = 0) -> MemoryReport:
    """Measure parameters, gradients and optimizer state of ``model`` / ``optimizer`` now.

    ``optimizer``: a ``ZeroOptimizer`` (its fp32 masters that are not views of parameters,
    Adam moments, and its shard gradients count; at ZeRO-3 the parameters' shards are the parameters,
    whose own storages are empty between uses) or a ``torch.optim`` optimizer (its state); see
    ``optimizer_state_bytes`` for the moments of a step not taken yet.
    """
    params = list(model.parameters())
    if optimizer is not None and hasattr(optimizer, "param_tensors"):
        params += optimizer.param_tensors()
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    grads = [p.grad for p in params]
    if optimizer is not None and hasattr(optimizer, "grad_tensors"):
        grads += optimizer.grad_tensors()
    return MemoryReport(params=tensor_bytes(params), grads=tensor_bytes(grads),
                        optimizer=optimizer_state_bytes(optimizer, params) if optimizer is not None else 0,
                        activations=int(activations))


def optimizer_state_bytes(optimizer, params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of ``optimizer``'s state: a ``ZeroOptimizer``'s separate fp32 masters and its AdamW state, or a
    ``torch.optim`` optimizer's state; storages shared with ``params`` (masters that are views of the model's
    parameters) do not count again.

    AdamW allocates its two moments (each the shape and dtype of the tensor it updates) in its first step.
    For tensors it has not stepped yet (before the first step, or when fp16 loss scaling skipped it) they are
    counted ahead, so the figure is what the process holds once training runs; the step counter's scalar
    (4 bytes per tensor) is left out until it exists.
    """
    inner = getattr(optimizer, "inner", optimizer)  # a ZeroOptimizer wraps a torch.optim.AdamW
    if hasattr(optimizer, "state_tensors"):
        tensors = optimizer.state_tensors()
    else:
        tensors = [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
    shared = {p.untyped_storage().data_ptr() for p in params}
    tensors = [t for t in tensors if t.untyped_storage().data_ptr() not in shared]
    unstepped = [p for g in inner.param_groups for p in g["params"] if not inner.state.get(p)]
    return tensor_bytes(tensors) + 2 * sum(p.numel() * p.element_size() for p in unstepped)


def max_over(report: MemoryReport, group=None) -> MemoryReport:
    """Element-wise max of ``report`` over ``group`` (None: the world); identity without distributed."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return MemoryReport(**asdict(report))
    t = torch.tensor([report.params, report.grads, report.optimizer, report.activations], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return MemoryReport(*(int(v) for v in t.tolist()))


def format_report(report: MemoryReport, what: str = "per rank") -> str:
    """One start-up line, e.g. ``memory (max per rank): params 12.0 MiB | grads … | total …``."""
    parts = [f"{k} {getattr(report, k) / MiB:.2f} MiB" for k in ("params", "grads", "optimizer", "activations")]
    return f"memory ({what}): " + " | ".join(parts) + f" | total {report.total / MiB:.2f} MiB"
