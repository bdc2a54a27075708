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

__all__ = ["MemoryReport", "tensor_bytes", "ActivationMeter", "memory_report", "max_over", "format_report"]

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
    whose own storages are empty between uses) or a ``torch.optim`` optimizer (its state).
    """
    params = list(model.parameters())
    if optimizer is not None and hasattr(optimizer, "param_tensors"):
        params += optimizer.param_tensors()
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    grads = [p.grad for p in params]
    opt_tensors: list[torch.Tensor] = []
    if optimizer is not None and hasattr(optimizer, "state_tensors"):
        opt_tensors = optimizer.state_tensors()
        grads += optimizer.grad_tensors()
    elif optimizer is not None:
        for st in optimizer.state.values():
            opt_tensors.extend(v for v in st.values() if torch.is_tensor(v))
    opt_tensors = [t for t in opt_tensors if t.untyped_storage().data_ptr() not in param_ptrs]
    return MemoryReport(params=tensor_bytes(params), grads=tensor_bytes(grads), optimizer=tensor_bytes(opt_tensors),
                        activations=int(activations))


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
