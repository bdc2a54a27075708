"""One step's actions on this rank, and the state they share: a base class of `PipelineRuntime` (runtime.py).

`_Step` is a step's per-rank state (inputs, outputs, received tensors, pending sends, weight-gradient stores,
the stats), dropped at the end of the step; `_PendingSend` a send started and not yet retired. `StepActions`
holds what the runtime's loop calls for each action of the lowered program — the contract written down in
``lowering.py`` and summed up in ``runtime.py``'s docstring: compute (F, B, I, W: ``_compute``, ``_forward``,
``_backward``), the gradient reduction R (``_reduce_grads``), communication (SEND, RECV, WAIT:
``_communicate``, ``_receive``) and retiring a send known complete (``_finish_send``). They read the runtime's
state (its stages, edges, resharders, forward step, placement): this class is not built on its own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..resharding.executor import post_together
from ..tensor_parallel import WeightGradStore
from .backward import run_backward, run_backward_many, safe_to_free
from .schedule import Action, ActionKind, Edge

__all__ = ["StepActions"]

_K = ActionKind



@dataclass
class _PendingSend:
    handle: Any
    tensor: torch.Tensor
    direction: str
    mb: int
    edge: Edge
    start: float
    free: bool  # free the tensor's data once complete (forward activations)


@dataclass
class _Step:
    """Per-step state of one rank: everything is dropped at the end of the step."""

    microbatches: list[dict[str, torch.Tensor]]
    train: bool
    loss: torch.Tensor
    device: torch.device
    autocast_dtype: torch.dtype | None = None
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None  # fp16 loss scaling on the last stage
    # keyed by (stage, microbatch): a rank holding virtual stages has one of each per stage
    inputs: dict[tuple[int, int], dict[Edge, torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], dict[Edge | None, torch.Tensor]] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], dict[Edge, torch.Tensor]] = field(default_factory=dict)
    posted: dict[tuple[Edge, str, int], Any] = field(default_factory=dict)
    # (edge, 'F' | 'B', mb): what WAIT returned, or what a local hand-off put there
    received: dict[tuple[Edge, str, int], torch.Tensor] = field(default_factory=dict)
    sends: dict[tuple[Edge, str, int], _PendingSend] = field(default_factory=dict)  # (edge, 'F' | 'B', mb)
    stores: dict[tuple[int, int], WeightGradStore] = field(default_factory=dict)
    # outputs_freed: sent activations whose data was freed when their send was retired; freed_before_backward:
    # those freed before their B ran; sent_held_peak: most activation sends started and not yet retired at once
    stats: dict[str, int] = field(default_factory=lambda: {"outputs_freed": 0, "freed_before_backward": 0,
                                                           "sent_held_peak": 0})
    held: int = 0  # activation sends started and not yet retired
    freed: set[tuple[int, int]] = field(default_factory=set)  # (stage, mb) whose sent activation data was freed
    live: set[tuple[int, int]] = field(default_factory=set)  # (stage, mb) activations held (F run, B/W not yet)


class StepActions:
    """The per-action work of `PipelineRuntime` (its base class; see the module docstring)."""

    def _reduce_grads(self, a: Action) -> None:
        """R: the trainer's handler starts stage ``a.stage``'s data-parallel gradient reduction (not waited here)."""
        if self.grad_reduce_handler is None:  # pragma: no cover - training_schedule() refuses this program
            raise RuntimeError(f"stage {a.stage}: R without a grad_reduce_handler")
        self.grad_reduce_handler(a.stage)

    @staticmethod
    def _count_live(a: Action, st: _Step) -> None:
        """Activations held per the simulator's rule (F until B, or until W under delayed W): the measured
        peak count of in-flight microbatches, ``last_stats['peak_inflight']``."""
        if not st.train:
            return
        if a.kind == _K.F:
            st.live.add((a.stage, a.mb))
            st.stats["peak_inflight"] = max(st.stats.get("peak_inflight", 0), len(st.live))
        elif a.kind in (_K.B, _K.W):
            st.live.discard((a.stage, a.mb))

    # ---- compute ---------------------------------------------------------------------------------
    def _chunk(self, model: torch.nn.Module, stage: int) -> torch.nn.Module:
        """The module running ``stage``: the model itself (one stage per mesh) or its chunk."""
        chunk = getattr(model, "chunk", None)
        if callable(chunk):
            return chunk(stage)
        if len(self.stages) != 1:
            raise TypeError(f"mesh {self.stage} runs stages {list(self.stages)} but the model is one module; "
                            "pass a pipeline.chunks.ModelChunks")
        return model

    def _compute(self, model: torch.nn.Module, a: Action, st: _Step) -> None:
        if a.kind == _K.F:
            self._forward(self._chunk(model, a.stage), a.stage, a.mb, st)
        elif a.kind in (_K.B, _K.I):
            self._backward(self._chunk(model, a.stage), a.stage, a.mb, st, delay=a.kind == _K.I)
        elif a.kind == _K.W:
            store = st.stores.pop((a.stage, a.mb), None)
            if store is None:
                raise RuntimeError(f"stage {a.stage}: W{a.mb} without a preceding I{a.mb}")
            store.flush()
        else:  # pragma: no cover
            raise AssertionError(a)

    def _forward(self, model: torch.nn.Module, stage: int, mb: int, st: _Step) -> None:
        first, last = stage == 0, stage == self.num_stages - 1
        inputs: dict[Edge, torch.Tensor] = {}
        for edge in self._in[stage]:
            try:
                x = st.received.pop((edge, "F", mb))
            except KeyError:
                raise RuntimeError(f"stage {stage}: F{mb} needs the activation of edge {edge}, which has not "
                                   "arrived (a local hand-off runs its producer first)") from None
            if st.train:
                x.requires_grad_(True)
            inputs[edge] = x
        st.inputs[(stage, mb)] = inputs
        out = self.forward_step(model, st.microbatches[mb], st.device, num_microbatches=len(st.microbatches),
                                received={e.name: x for e, x in inputs.items()}, first=first, last=last,
                                autocast_dtype=st.autocast_dtype)
        if last:
            st.loss += out.detach()
            if st.train:
                st.outputs[(stage, mb)] = {None: out}
            return
        outs = self._out[stage]
        missing = [str(e) for e in outs if e.name not in out]
        if missing:
            raise RuntimeError(f"stage {stage}: the model returned outputs {sorted(out)} but the stage "
                               f"sends on edge(s) {', '.join(missing)}")
        produced = {e: out[e.name] for e in outs}
        # local hand-offs: the consumer on this mesh reads the output as if received (detached: its
        # own leaf, so its backward stops there and hands the gradient back)
        for e, t in produced.items():
            if e in self.local_edges:
                st.received[(e, "F", mb)] = t.detach()
        if st.train:
            st.outputs[(stage, mb)] = produced
        else:  # forward only: keep what SEND_F still sends
            remote = {e: t for e, t in produced.items() if e not in self.local_edges}
            if remote:
                st.outputs[(stage, mb)] = remote

    def _backward(self, model: torch.nn.Module, stage: int, mb: int, st: _Step, delay: bool) -> None:
        store = None
        if delay:
            store = st.stores[(stage, mb)] = WeightGradStore()
        if delay:  # the module queues its weight-gradient GEMMs in the store (tensor_parallel.WeightGradStore)
            if not hasattr(model, "set_wgrad_store"):
                raise TypeError(f"stage {stage}: delayed weight gradients need a stage module with set_wgrad_store "
                                f"(tensor_parallel's linear layers); {type(model).__name__} has none")
            model.set_wgrad_store(store)
        outs = st.outputs.pop((stage, mb))
        st.stats["freed_before_backward"] += int((stage, mb) in st.freed)
        if stage == self.num_stages - 1:
            out = outs[None]
            run_backward(st.scale_loss(out) if st.scale_loss is not None else out, None)
        else:
            edges = self._out[stage]
            try:
                grads = [st.received.pop((e, "B", mb)) for e in edges]
            except KeyError:
                raise RuntimeError(f"stage {stage}: backward of mb {mb} before the gradient of its output(s) "
                                   f"{', '.join(map(str, edges))} arrived") from None
            grads = [g * self._grad_scale[e] if e in self._grad_scale else g for e, g in zip(edges, grads)]
            run_backward_many([outs[e] for e in edges], grads)
        if delay:
            model.set_wgrad_store(None)
        grads = {}
        for e, x in st.inputs.pop((stage, mb), {}).items():
            if x.grad is None:
                raise RuntimeError(f"stage {stage}: backward of mb {mb} produced no gradient for the input "
                                   f"of edge {e}")
            if e in self.local_edges:  # hand the gradient back to the producing stage on this mesh
                st.received[(e, "B", mb)] = x.grad
            else:
                grads[e] = x.grad
        if grads:
            st.input_grads[(stage, mb)] = grads

    # ---- communication -----------------------------------------------------------------------------
    def _communicate(self, a: Action, st: _Step, sends: Sequence[tuple[Edge, str, int]],
                     posts: Sequence[tuple[Edge, str, int]]) -> None:
        """SEND starts a send (unposted); then, whatever the action, the sends and receives the posting plan puts
        here go out together (`posting.py`: at a SEND the sends of its compute and the receives grouped with
        them, at a RECV under early posting its own receive, at a WAIT what is left of its channel up to it);
        WAIT then blocks on its receive — the only blocking communication."""
        e, mb = a.edge, a.mb
        k = a.kind
        recvs = [self._receive(st, item) for item in posts]
        if k == _K.SEND_F:
            outs = st.outputs[(a.stage, mb)]
            out = outs[e] if st.train else outs.pop(e)
            if not outs:
                del st.outputs[(a.stage, mb)]
            # free the data of the chain output only: a skip output may be saved by a later op of
            # this stage (or be the very same tensor as another edge's output)
            free = (st.train and self._free_outputs and e.is_chain and safe_to_free(out)
                    and not any(t is out for other, t in outs.items() if other != e))
            h = self.comms[e].send_forward(out, mb, post=False)
            st.sends[a.key] = _PendingSend(h, out, "F", mb, e, time.time(), free=free)
            st.held += 1
            st.stats["sent_held_peak"] = max(st.stats["sent_held_peak"], st.held)
        elif k == _K.SEND_B:
            grads = st.input_grads[(a.stage, mb)]
            g = grads.pop(e)
            if not grads:
                del st.input_grads[(a.stage, mb)]
            h = self.comms[e].send_backward(g, mb, post=False)
            st.sends[a.key] = _PendingSend(h, g, "B", mb, e, time.time(), free=False)
        if recvs or sends:
            post_together(recvs + [st.sends[item].handle for item in sends])
        if k in (_K.WAIT_F, _K.WAIT_B):
            d = k.direction
            try:
                h = st.posted.pop((e, d, mb))
            except KeyError:
                raise RuntimeError(f"stage {self.stage}: {a} waits for a receive that was never posted") from None
            t = h.wait()
            if t is None:
                raise RuntimeError(f"stage {self.stage}: rank {self.ctx.rank} received nothing on edge {e} "
                                   f"({'activation' if d == 'F' else 'gradient'}, mb {mb}): it is not in the "
                                   "edge's destination mesh")
            st.received[(e, d, mb)] = t
        elif k not in (_K.SEND_F, _K.SEND_B, _K.RECV_F, _K.RECV_B):  # pragma: no cover
            raise AssertionError(a)

    def _receive(self, st: _Step, item: tuple[Edge, str, int]) -> Any:
        """The receive of `item` (edge, direction, mb), started unposted on first mention."""
        h = st.posted.get(item)
        if h is None:
            e, d, _ = item
            h = st.posted[item] = self.comms[e].recv_forward(post=False) if d == "F" else \
                self.comms[e].recv_backward(post=False)
        return h

    def _finish_send(self, s: _PendingSend, st: _Step) -> None:
        """Retire a send known complete (gloo reports completion only to a waiter; this wait returns at once)."""
        try:
            s.handle.wait()
        except BaseException as e:
            raise RuntimeError(f"stage {self.stage}: sending the {'activation' if s.direction == 'F' else 'gradient'} "
                               f"of mb {s.mb} on edge {s.edge} failed") from e
        st.held -= s.direction == "F"
        if s.free:
            # Megatron's deallocate_output_tensor: keep the autograd node, drop the data
            s.tensor.data = torch.empty((1,), dtype=s.tensor.dtype, device=s.tensor.device)
            st.stats["outputs_freed"] += 1
            st.freed.add((s.edge.src, s.mb))
        if st.send_done:
            record = {"stage": self.stage, "vstage": s.edge.src if s.direction == "F" else s.edge.dst,
                      "kind": "SEND_" + s.direction, "mb": s.mb, "start": s.start, "end": time.time(), "edge": str(s.edge),
                      "peer": self.placement[s.edge.dst if s.direction == "F" else s.edge.src]}
            for h in st.send_done:
                h(record)
