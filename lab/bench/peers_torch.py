"""The peer of lab/bench/bench_peers.py: torch.distributed.pipelining's schedules on megareshard's GPT layers.

Each rank builds its stages from ``GPTModel`` chunks (``layer_range``, tp as the run's; the same seed
and global layer indices, so the weights and the arithmetic are ours), wraps them in
``torch.distributed.pipelining.PipelineStage`` over the rank's pipeline group (one per tp rank: with
tp 2 each tp rank sends a full copy of the activation to its counterpart, what torchtitan does), and
steps one of torch's schedules. The loss is ours (``vocab_parallel_cross_entropy``, mean over tokens,
``/ m`` per microbatch, ``scale_grads=False``), so the peer computes the same loss and gradients.

Paced compute: ``pace_stage`` wraps the stage's ``forward_one_chunk`` (F), ``backward_one_chunk``
(B, or I with ``full_backward=False``) and ``backward_weight_one_chunk`` (W): each sleeps until its
per-kind budget has passed, the same budgets as megareshard's runtime (``lab.cluster.pacing.Pacer``), scaled
by the share of the rank's layers the chunk holds when a rank holds several chunks.

``LifetimeMeter`` measures saved-activation bytes by the lifetime of the tensors autograd saves, which
stays right under ``retain_graph`` (torch's zero-bubble I/W split unpacks a saved tensor twice) and
when a weight-gradient store keeps a layer's input for a delayed W, unlike counting unpacks.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

# name -> (placement style, chunks per rank); "loop": rank r holds stages r, r + P, ...; "v": r and 2P-1-r
PEER_SCHEDULES: dict[str, tuple[str, int]] = {
    "Schedule1F1B": ("loop", 1),
    "ScheduleGPipe": ("loop", 1),
    "ScheduleInterleaved1F1B": ("loop", 2),
    "ScheduleLoopedBFS": ("loop", 2),
    "ScheduleInterleavedZeroBubble": ("loop", 2),
    "ScheduleZBVZeroBubble": ("v", 2),
    "ScheduleDualPipeV": ("v", 2),
}
# megareshard's registry name with the same per-mesh action order (for the simulator's prediction)
EQUIVALENT = {"Schedule1F1B": "1f1b", "ScheduleGPipe": "gpipe", "ScheduleInterleaved1F1B": "interleaved-1f1b",
              "ScheduleZBVZeroBubble": "zbv"}


def peer_stages_of(name: str, rank: int, pp: int) -> list[int]:
    """The (virtual) stage indices rank `rank` of the pipeline holds under schedule `name`."""
    style, v = PEER_SCHEDULES[name]
    if style == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(v)]


def chunk_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Even split of the GPT's layers over `num_stages` stages (ValueError when it does not divide)."""
    if num_layers % num_stages:
        raise ValueError(f"{num_layers} layers do not split evenly over {num_stages} stages")
    per = num_layers // num_stages
    return [(s * per, (s + 1) * per) for s in range(num_stages)]


def chunk_share(layer_range: tuple[int, int], layers_per_rank: int) -> float:
    """The share of a rank's per-kind pacing budget one chunk gets: the share of the rank's layers it holds
    (the rule for torch's multi-chunk stages and megareshard's virtual-stage chunks alike)."""
    r0, r1 = layer_range
    return (r1 - r0) / layers_per_rank


class LifetimeMeter:
    """Context manager: the most bytes of distinct storages saved for backward that are alive at once (CPU).

    A storage counts from the first time autograd saves a tensor on it until every tensor object saved on
    it is gone (``weakref.finalize``): whoever holds it — the graph, a retained graph (torch's I/W
    split unpacks a saved tensor twice), or a weight-gradient store that keeps a layer's input for a
    delayed W (megareshard's ``--delay-wgrad-compute``) — so no schedule's held activations are missed.
    ``exclude``: parameters (not activations).
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._tensors: set[int] = set()    # ids of saved tensor objects still alive
        self._refs: dict[int, int] = {}    # storage -> saved tensor objects alive on it
        self._bytes: dict[int, int] = {}
        self.live = 0
        self.peak_bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self._exclude or not st.nbytes() or id(t) in self._tensors:
            return t
        self._tensors.add(id(t))
        if self._refs.get(ptr, 0) == 0:
            self._bytes[ptr] = st.nbytes()
            self.live += st.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live)
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        weakref.finalize(t, self._release, ptr, id(t))
        return t

    def _release(self, ptr: int, key: int) -> None:
        self._tensors.discard(key)
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.live -= self._bytes.pop(ptr)

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "LifetimeMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class PeerChunk(torch.nn.Module):
    """One torch pipelining stage: a ``GPTModel`` chunk taking tokens (first) or hidden ``[s, b, h]``,
    returning hidden states or, on the last stage, the logits shard ``[b, s, V_pad/tp]``."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens=x) if self.gpt.pre_process else self.gpt(hidden=x)


def make_loss_fn(ctx, vocab_size: int, num_microbatches: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Our last stage's loss: per-token cross entropy over the vocab-parallel logits, mean, ``/ m``."""
    from megareshard.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = vocab_parallel_cross_entropy(out.transpose(0, 1), target.t(), ctx, vocab_size=vocab_size)
        return loss.t().contiguous().float().mean() / num_microbatches

    return loss_fn


@dataclass
class PacedStats:
    """What the pacing wrappers saw in one step: the trace (stage, kind, mb, start, end) and overruns."""

    trace: list[dict[str, Any]]
    overruns: int = 0
    overrun_us: int = 0


def pace_stage(stage, index: int, stats: PacedStats, budgets: Callable[[], dict[str, float] | None],
               share: float) -> None:
    """Wrap `stage`'s compute methods: trace every F/B/I/W and, when ``budgets()`` gives {kind: s}, sleep
    until ``budget × share`` has passed (an unpaced kind in a paced run raises: it would run at CPU speed)."""

    def wrap(fn, kind_of):
        def run(*args, **kwargs):
            kind = kind_of(args, kwargs)
            t0 = time.time()
            out = fn(*args, **kwargs)
            b = budgets()
            if b is not None:
                if kind not in b:
                    raise ValueError(f"peer stage {index}: no pacing budget for {kind} (budgets: {sorted(b)})")
                left = b[kind] * share - (time.time() - t0)
                if left > 0:
                    time.sleep(left)
                else:
                    stats.overruns += 1
                    stats.overrun_us += int(-left * 1e6)
            mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
            stats.trace.append({"stage": index, "kind": kind, "mb": mb, "start": t0, "end": time.time()})
            return out
        return run

    stage.forward_one_chunk = wrap(stage.forward_one_chunk, lambda a, k: "F")
    stage.backward_one_chunk = wrap(stage.backward_one_chunk,
                                    lambda a, k: "B" if k.get("full_backward", True) else "I")
    stage.backward_weight_one_chunk = wrap(stage.backward_weight_one_chunk, lambda a, k: "W")


class TorchPeer:
    """One torch.distributed.pipelining schedule over this rank's chunks; call ``step(batch)``.

    ``chunks``: {stage index: GPTModel} this rank holds (the trainer's own stage model may be one).
    ``step`` returns the mean loss over the microbatches on every rank of the pipeline (all-reduced over
    the pipeline group, as megareshard's runtime does), gradients accumulated in the chunks.
    """

    def __init__(self, name: str, chunks: dict[int, torch.nn.Module], ctx, *, pp: int, num_microbatches: int,
                 vocab_size: int, layers_per_rank: int) -> None:
        import torch.distributed.pipelining as tpp

        self.name, self.ctx, self.m = name, ctx, num_microbatches
        self.num_stages = pp * PEER_SCHEDULES[name][1]
        self.chunks = chunks
        self.budget: dict[str, float] | None = None
        self.stats = PacedStats([])
        self.stages = []
        for idx in sorted(chunks):
            st = tpp.PipelineStage(PeerChunk(chunks[idx]), idx, self.num_stages, torch.device("cpu"),
                                   group=ctx.pp_group)
            pace_stage(st, idx, self.stats, lambda: self.budget, chunk_share(chunks[idx].layer_range, layers_per_rank))
            self.stages.append(st)
        cls = getattr(tpp, name)
        loss_fn = make_loss_fn(ctx, vocab_size, num_microbatches)
        if PEER_SCHEDULES[name][1] == 1:
            self.schedule = cls(self.stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = cls(self.stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
        self.holds_first = 0 in chunks
        self.holds_last = self.num_stages - 1 in chunks

    def parameters(self):
        for c in self.chunks.values():
            yield from c.parameters()

    def step(self, microbatches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every microbatch (the schedule's order), the loss on every rank."""
        self.stats.trace, self.stats.overruns, self.stats.overrun_us = [], 0, 0
        tokens = torch.cat([mb["tokens"] for mb in microbatches])
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        losses: list[torch.Tensor] = []
        args = (x,) if self.holds_first else ()
        kw = {"target": y, "losses": losses} if self.holds_last else {}
        self.schedule.step(*args, return_outputs=False, **kw)
        loss = torch.stack([t.detach().float() for t in losses]).sum() if losses else torch.zeros(())
        if dist.is_initialized() and self.ctx.pp_size > 1:
            dist.all_reduce(loss, group=self.ctx.pp_group)
        return loss


def compute_order(schedule) -> list[list[tuple[str, int, int]]] | None:
    """A torch schedule's compute order per rank, ``(kind, microbatch, stage)`` with kind F/B/I/W (an
    overlapped F+B of DualPipeV is its sub-actions in order); None where the schedule keeps no
    ``pipeline_order`` it executes (then the registry's equivalent, 1f1b or gpipe, stands in). The
    single-stage schedules execute a loop of their own; their ``pipeline_order`` is a description
    (torch 2.13's 1F1B one skips microbatch 0 on the last rank), so it is not used."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if not isinstance(schedule, PipelineScheduleMulti):
        return None
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return None
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}  # _ComputationType values; the rest are not compute
    out = []
    for rank in sorted(order):
        acts = []
        for a in order[rank]:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):  # OVERLAP_F_B: its forward and backward, in order
                ct = getattr(sub.computation_type, "value", str(sub.computation_type))
                if ct in kinds:  # REDUCE_GRAD, UNSHARD, RESHARD: no compute of the pipeline
                    acts.append((kinds[ct], int(sub.microbatch_index), int(sub.stage_index)))
        out.append(acts)
    return out


def order_to_schedule(order: list[list[tuple[str, int, int]]], name: str, pp: int, num_microbatches: int):
    """megareshard's Schedule IR of a torch schedule's compute order (for the simulator)."""
    from megareshard.pipeline import Action, ActionKind, PipelineGraph, Schedule

    v = PEER_SCHEDULES[name][1]
    place = [0] * (pp * v)
    for r in range(pp):
        for s in peer_stages_of(name, r, pp):
            place[s] = r
    acts = [[Action(ActionKind(k), mb, s) for k, mb, s in rank] for rank in order]
    return Schedule(PipelineGraph(pp * v), num_microbatches, acts, f"torch {name}", tuple(place))
