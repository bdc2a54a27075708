"""ZeRO-3: every parameter keeps only its data-parallel shard between uses; a layer's parameters are
gathered just before its forward and again before its backward, freed after, prefetched, and its
gradients reduce-scattered as soon as they are produced.

Built here rather than on PyTorch's FSDP2 (``fully_shard``): FSDP2 turns parameters into DTensors and
reduce-scatters a module's gradients in its own post-backward hook. Delayed weight gradients (the
pipeline's I/W split) write a layer's weight gradients after that hook, in the W action, so FSDP2 never
reduces them (a two-rank probe with our ``ColumnParallelLinear`` and a ``WeightGradStore``: gradient None
after W); and the optimizer, the fp32 masters with loss scaling, the gradient clipping and the checkpoints
all work on plain tensors with a ``ShardInfo`` box. So the sharding is ZeRO 1/2's own (each parameter on
dim 0 over dp, ``zero_shards.py``), which makes stage 3 the same arithmetic as the other stages and its
checkpoints the same files, and this module adds what FSDP2 would have: gather, free, prefetch, reduce.

Units. A *unit* is the parameters gathered together, by one all-gather: each Transformer layer (every
child of a module's ``layers`` container), and the rest of each stage module (the *root*: embeddings,
final norm, output layer). A rank holding several stages (virtual stages, ``ModelChunks``) has one root
per stage. A parameter belongs to one unit; a module that uses another root's parameter (zbv's tied
word embedding, used by the last stage's output layer on mesh 0) gathers that unit too.

Between uses a parameter's storage is empty (``untyped_storage().resize_(0)``) and its rows live in
``entry.shard``, views of one packed buffer per unit (the fp32 master itself for an fp32 parameter, so
no extra copy; a separate low-precision copy refreshed after each step otherwise). A gather all-gathers
the packed buffer (``D`` segments, rank-major) and copies every parameter out in one call into its
storage, grown to ``D·chunk`` rows (so the copy is one strided copy per parameter, no loop over ranks).
Autograd keeps referring to the same parameter objects, so whatever it saved for backward sees the data
again once the unit is gathered for backward.

When (hooks on each unit's module; ``holders`` counts who needs a unit; it is freed at zero):

* forward: the unit is gathered (waited for) before the module runs, and the next unit of the recorded
  forward order is prefetched (its all-gather starts, overlapping this module's compute); after the
  forward it is freed (``reshard_after_forward``, the default, Megatron's and FSDP2's) or kept until its
  backward. A root is always kept from its forward to its backward (as FSDP2 keeps its root: backward
  needs it first). Without gradients (evaluation) every unit is freed after its forward.
* backward: a hook on the module's outputs gathers the unit again and prefetches the next unit in
  backward order; a hook on its inputs (all their gradients computed) frees it and reduce-scatters its
  gradients (``ZeroOptimizer.launch_reduction``). Under delayed weight gradients that reduction is queued
  in the layer's ``WeightGradStore`` after the layer's own weight-gradient work, so it runs in the W
  action, right after those gradients exist; the parameters themselves are freed after I (W needs none).
  A root, and anything whose inputs need no gradient, ends at the end of the backward pass.
* recomputation replays a forward inside the backward: the unit is already gathered; nothing is counted.
* ``keep_params_for_step`` (pipeline parallelism without resharding after forward): units stay gathered
  from their first use to the end of the stage's backward work (``end_step``, from the trainer's
  gradient reduction) and gradients accumulate unsharded until then: one all-gather and one
  reduce-scatter per unit and step instead of two and one per microbatch. ``persistence_threshold``
  does the same for the parameters of fewer elements, gathered in units of their own beside their
  layer's (DeepSpeed's ``stage3_param_persistence_threshold``: a small parameter costs a collective's
  fixed time for few bytes).

Every rank of a data-parallel group runs the same program, so the hooks fire — and the collectives are
issued — in the same order on all of them (NCCL's rule; ``run_ranks(..., nccl_check=True)`` checks it).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import nn

from ..parallel.collectives import all_gather_into
from .zero_shards import Bucket, ShardEntry

__all__ = ["ParamSharder", "Unit"]

_FREE, _GATHERING, _GATHERED = 0, 1, 2
_split_copy = getattr(torch, "split_with_sizes_copy", None)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (recomputation replays forwards there)."""
    return torch._C._current_graph_task_id() != -1


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors needing gradients in a forward's arguments or outputs (tuples, lists, dicts, one level deep
    at each)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                out.append(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


class Unit:
    """Parameters gathered by one all-gather: one packed shard buffer at rest, the parameters' storages when
    gathered."""

    __slots__ = ("name", "entries", "offsets", "seg", "dtype", "packed", "holders", "state", "recv", "work",
                 "pinned", "reduce_buckets", "nbytes", "keep", "D", "group")

    def __init__(self, name: str, entries: list[ShardEntry], D: int, group) -> None:
        self.name, self.entries = name, entries
        # the ranks sharing the unit's rows: the dp group, or for MoE expert weights the expert-data-parallel one
        self.D, self.group = D, group
        self.offsets, off = [], 0
        for e in entries:
            self.offsets.append(off)
            off += e.seg
        self.seg = off
        self.dtype = entries[0].param.dtype
        self.holders, self.state, self.pinned = 0, _FREE, False
        self.recv = self.work = None
        self.packed: torch.Tensor | None = None
        self.reduce_buckets: list[Bucket] = []
        self.nbytes = 0  # of the gathered parameters (padded storages)
        self.keep = False  # gathered for the whole step (kept for the step, or under the persistence threshold)


class _Hooked:
    """A module whose forward needs ``units``; ``own``: those it owns (whose gradients its backward produces)."""

    __slots__ = ("module", "units", "own", "root", "is_root", "order", "fwd_next", "bwd_next", "pending",
                 "stores", "recording")

    def __init__(self, module: nn.Module, units: list[Unit], own: list[Unit], root: "_Hooked | None") -> None:
        self.module, self.units, self.own = module, units, own
        self.is_root = root is None
        self.root = self if root is None else root
        self.order: list[_Hooked] = []           # roots: the hooked modules in forward order (recorded once)
        self.recording: bool | None = None         # roots: None before the first forward, True during it
        self.fwd_next: dict[int, _Hooked] = {}
        self.bwd_next: dict[int, _Hooked] = {}
        self.pending: _Call | None = None
        self.stores = [m for m in module.modules() if hasattr(m, "wgrad_store")]

    def wgrad_store(self):
        """The weight-gradient store attached to the module's layers now (delayed weight gradients), or None."""
        for m in self.stores:
            if m.wgrad_store is not None:
                return m.wgrad_store
        return None


class _Call:
    """One forward of a hooked module that a backward will follow."""

    __slots__ = ("hooked", "held", "pre_done", "post_done")

    def __init__(self, hooked: _Hooked) -> None:
        self.hooked, self.held, self.pre_done, self.post_done = hooked, True, False, False


def _roots(module: nn.Module) -> list[nn.Module]:
    """The stage modules: a ``ModelChunks``' chunks (virtual stages), else the module itself."""
    chunks = getattr(module, "chunks", None)
    return list(chunks.values()) if isinstance(chunks, nn.ModuleDict) else [module]


def _layers(root: nn.Module) -> list[nn.Module]:
    layers = getattr(root, "layers", None)
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers) \
        if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else []


class ParamSharder:
    """The stage-3 half of a ``ZeroOptimizer``: units, their gathers and frees, the module hooks. ``opt`` is that
    optimizer (``zero.py``, which imports this module: it is not imported back, not even for the annotation)."""

    def __init__(self, opt: Any, module: nn.Module, *, reshard_after_forward: bool = True,
                 keep_params_for_step: bool = False, persistence_threshold: int = 0) -> None:
        self.opt, self.ctx = opt, opt.ctx
        self.D = opt.shard_dp
        self.reshard_after_forward = reshard_after_forward
        self.keep_params_for_step = keep_params_for_step
        self.gathered_ptrs: set[int] = set()
        self.live_bytes = self.peak_bytes = 0  # gathered parameter storages now, and at most so far
        self.gathers = 0                       # all-gathers issued (a count for tests and benchmarks)
        self._calls: list[_Call] = []          # calls whose backward started in the current backward pass
        self._extra: list[Unit] = []           # units gathered by a recomputed forward outside any call
        self._callback_queued = False
        entry_of = {id(e.param): e for e in opt.entries}
        owner: dict[int, Unit] = {}            # param id -> its unit
        self.units: list[Unit] = []
        self.hooked: list[_Hooked] = []

        def make_units(name: str, params) -> list[Unit]:
            # one unit per dtype; parameters under the persistence threshold in units of their own, kept; MoE
            # expert weights in units of their own, sharded over (and gathered from) the expert-data-parallel group
            groups: dict[tuple[torch.dtype, bool, bool], list[ShardEntry]] = {}
            for p in params:
                e = entry_of.get(id(p))
                if e is not None and id(p) not in owner:
                    groups.setdefault((p.dtype, p.numel() < persistence_threshold, e.expert), []).append(e)
                    owner[id(p)] = None  # claimed (set below)
            out = []
            for (dtype, small, expert), entries in groups.items():
                D, group = (opt.expert_shard_dp, self.ctx.edp_group) if expert else (self.D, self.ctx.dp_group)
                u = Unit(name + (f" [{dtype}]" if len({d for d, _, _ in groups}) > 1 else "")
                         + (" (persistent)" if small else "") + (" (experts)" if expert else ""), entries, D, group)
                u.keep = keep_params_for_step or small
                for e in entries:
                    owner[id(e.param)] = u
                out.append(u)
            self.units.extend(out)
            return out

        for r, root in enumerate(_roots(module)):
            layers = _layers(root)
            inside = {id(p) for layer in layers for p in layer.parameters()}
            root_params = [p for p in root.parameters() if id(p) not in inside]
            own_root = make_units(f"stage module {r}", root_params)
            uses = list(dict.fromkeys(owner[id(p)] for p in root_params if id(p) in entry_of))
            h_root = _Hooked(root, uses, own_root, None)
            self.hooked.append(h_root)
            for i, layer in enumerate(layers):
                own = make_units(f"stage module {r} layer {getattr(layer, 'index', i)}", list(layer.parameters()))
                used = list(dict.fromkeys(owner[id(p)] for p in layer.parameters() if id(p) in entry_of))
                if used:
                    self.hooked.append(_Hooked(layer, used, own, h_root))
        missing = [e.name for e in opt.entries if id(e.param) not in owner]
        if missing:
            raise ValueError(f"ZeRO-3: parameters {missing[:5]} are not in the model given to the optimizer")
        for u in self.units:
            self._lay_out(u)
            rest = [e for e in u.entries if not e.defer]
            if rest:
                u.reduce_buckets.append(Bucket(rest))
        self._handles = []
        for h in self.hooked:
            self._handles.append(h.module.register_forward_pre_hook(functools.partial(self._pre_forward, h),
                                                                    with_kwargs=True))
            self._handles.append(h.module.register_forward_hook(functools.partial(self._post_forward, h),
                                                                with_kwargs=True))

    # ---- layout ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _lay_out(self, u: Unit) -> None:
        """Move the unit's parameters into their shards (one packed buffer) and empty their storages."""
        D = u.D
        first = u.entries[0].param
        u.packed = torch.zeros(u.seg, dtype=u.dtype, device=first.device)
        for e, off in zip(u.entries, u.offsets):
            p = e.param
            if not p.is_contiguous() or p.storage_offset() or p.untyped_storage().nbytes() != p.numel() * \
                    p.element_size():
                p.data = p.detach().clone()  # a view of a larger storage: its storage is about to be resized
            n = e.stop - e.start
            e.shard = u.packed[off:off + n * e.row_size].view(e.info.shard_shape)
            e.shard.copy_(e.param_rows()[e.start:e.stop].reshape(e.info.shard_shape))
            e.master = e.shard if e.master_is_view else e.shard.float().clone()
            nbytes = D * e.seg * p.element_size()
            p.untyped_storage().resize_(nbytes)
            e.padded = torch.empty(0, dtype=p.dtype, device=p.device).set_(
                p.untyped_storage(), 0, (D, e.seg), (e.seg, 1))
            p.untyped_storage().resize_(0)
            u.nbytes += nbytes

    def shard_buffers(self) -> list[torch.Tensor]:
        return [u.packed for u in self.units]

    # ---- gather / free --------------------------------------------------------------------------
    def _start_gather(self, u: Unit) -> None:
        if u.state != _FREE:
            return
        for e in u.entries:
            e.param.untyped_storage().resize_(e.padded.numel() * e.padded.element_size())
        if len(u.entries) == 1:  # straight into the parameter's storage: nothing to copy out
            u.recv = u.entries[0].padded.view(-1)
        else:
            u.recv = torch.empty(u.D * u.seg, dtype=u.dtype, device=u.packed.device)
        if u.D == 1:   # expert weights without replicas (edp 1): the whole tensor is this rank's shard
            u.recv.copy_(u.packed)
            u.work = None
        else:
            u.work = all_gather_into(u.recv, u.packed, group=u.group, async_op=True)
        u.state = _GATHERING
        self.gathers += 1
        self.live_bytes += u.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        for e in u.entries:
            self.gathered_ptrs.add(e.param.untyped_storage().data_ptr())

    def _ensure(self, u: Unit) -> None:
        if u.state == _FREE:
            self._start_gather(u)
        if u.state != _GATHERING:
            return
        if u.work is not None:
            u.work.wait()
        if len(u.entries) > 1:
            grid = u.recv.view(u.D, u.seg)
            if _split_copy is not None:
                _split_copy(grid, [e.seg for e in u.entries], 1, out=[e.padded for e in u.entries])
            else:
                for e, off in zip(u.entries, u.offsets):
                    e.padded.copy_(grid[:, off:off + e.seg])
        u.recv = u.work = None
        u.state = _GATHERED

    def _free(self, u: Unit) -> None:
        if u.state == _GATHERING:  # a prefetch nobody used: complete it before its buffers go
            self._ensure(u)
        if u.state == _FREE:
            return
        for e in u.entries:
            st = e.param.untyped_storage()
            self.gathered_ptrs.discard(st.data_ptr())
            st.resize_(0)
        u.state = _FREE
        self.live_bytes -= u.nbytes

    def _acquire(self, u: Unit) -> None:
        u.holders += 1
        self._ensure(u)
        if u.keep and torch.is_grad_enabled():
            u.pinned = True

    def _release(self, u: Unit) -> None:
        u.holders -= 1
        if u.holders <= 0 and not u.pinned:
            u.holders = 0
            self._free(u)

    def end_step(self) -> None:
        """The stage's backward work of this step is over (the trainer's gradient reduction starts): every unit
        kept for the step, or prefetched and not used, is freed."""
        self._calls.clear()
        for u in self.units:
            u.pinned = False
            u.holders = 0
            self._free(u)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered inside the block (collective over dp: every rank gathers every unit)."""
        for u in self.units:
            self._acquire(u)
        try:
            yield
        finally:
            for u in self.units:
                self._release(u)

    # ---- hooks ----------------------------------------------------------------------------------
    def _prefetch(self, h: "_Hooked | None") -> None:
        if h is not None:
            for u in h.units:
                self._start_gather(u)

    def _pre_forward(self, h: _Hooked, module, args, kwargs) -> None:
        if _in_backward():  # recomputation: the unit was gathered for this backward; count nothing
            for u in h.units:
                if u.state != _GATHERED:
                    self._acquire(u)
                    self._extra.append(u)
                    self._queue_final_callback()
            return
        for u in h.units:
            self._acquire(u)
        root = h.root
        if h.is_root and root.recording is None:
            root.recording = True
        if root.recording:
            root.order.append(h)       # recorded on the root's first forward
        self._prefetch(root.fwd_next.get(id(h)))
        h.pending = None
        if torch.is_grad_enabled():
            call = h.pending = _Call(h)
            inputs = _grad_tensors((args, kwargs))
            if inputs and not h.is_root:
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, functools.partial(self._post_backward_hook, call), mode="all")

    def _post_forward(self, h: _Hooked, module, args, kwargs, output) -> None:
        if _in_backward():
            return
        root = h.root
        if h.is_root and root.recording:  # the forward order is complete
            root.recording = False
            order = root.order
            root.fwd_next = {id(a): b for a, b in zip(order, order[1:])}
            back = [order[0]] + order[:0:-1]
            root.bwd_next = {id(a): b for a, b in zip(back, back[1:])}
        call, h.pending = h.pending, None
        outputs = _grad_tensors(output) if call is not None else []
        if not outputs:  # evaluation, or nothing downstream needs a gradient: no backward comes
            for u in h.units:
                self._release(u)
            return
        if self.reshard_after_forward and not h.is_root:
            for u in h.units:
                self._release(u)
            call.held = False
        torch.autograd.graph.register_multi_grad_hook(outputs, functools.partial(self._pre_backward, call),
                                                      mode="any")

    def _pre_backward(self, call: _Call, grad=None) -> None:
        if call.pre_done:
            return
        call.pre_done = True
        h = call.hooked
        self._calls.append(call)
        self._queue_final_callback()
        if not call.held:
            for u in h.units:
                self._acquire(u)
            call.held = True
        else:
            for u in h.units:
                self._ensure(u)
        self._prefetch(h.root.bwd_next.get(id(h)))

    def _post_backward_hook(self, call: _Call, grads=None) -> None:
        self._post_backward(call)  # gradients of the inputs computed: the module's backward is over

    def _post_backward(self, call: _Call) -> None:
        if call.post_done:
            return
        call.post_done = True
        h = call.hooked
        if call.held:
            for u in h.units:
                self._release(u)
            call.held = False
        if not any(u.reduce_buckets and not u.keep for u in h.own):
            return  # kept for the step: gradients accumulate, reduced at the step's end
        store = h.wgrad_store()
        if store is not None:  # delayed weight gradients: reduce right after the W work of this module
            store.put(functools.partial(self._reduce, h))
        else:
            self._reduce(h)

    def _reduce(self, h: _Hooked) -> None:
        for u in h.own:
            if not u.keep:
                for b in u.reduce_buckets:
                    self.opt.launch_reduction(b)

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        """End of a backward pass: modules whose inputs needed no gradient (roots) end here."""
        self._callback_queued = False
        calls, self._calls = self._calls, []
        for call in calls:
            self._post_backward(call)
        extra, self._extra = self._extra, []
        for u in extra:
            self._release(u)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
