"""Run a `TransferPlan`: one call on every rank of a process group that spans the source and the destinations.

Under NCCL's rules (docs/design.md §4b), checked on gloo by ``MEGARESHARD_NCCL_CHECK``:

* **Point-to-point only, paired in issue order.** The plan gives every message a global step; each rank walks
  the steps it takes part in, in order, and posts that step's operations — sends and receives, in the plan's
  global (bucket, message) order — as one ``batch_isend_irecv`` group on the caller's group (NCCL's
  ncclGroupStart/End: a rank's receive and send progress together; on a group joined across jobs the same calls,
  `group.post_ops`), then waits for them. Both ends of every
  message post it in the same step and in the same order relative to the pair's other messages, so the k-th
  send from x to y is the k-th receive at y from x; no tags. A forward (a broadcast chain hop, a fan-out inside
  a host) is posted one step after the message that brought its data.
* **No collective but one.** The only collective is the final ``all_reduce`` of the slowest rank's time, issued
  once by every member; the caller's group carries nothing else during ``run`` (its other users must wait).
* **One thread.** The calling thread issues everything; no stream threads.

Deadlock-free by induction on the steps: every operation of step s has its peer in step s, and the data a step
forwards arrived in an earlier one. Staging stays within the plan's bound (`TransferPlan.staging_bytes`): a sender
packs a bucket at its first send, a receiver allocates it at its first receive and unpacks it into its destination
tensors after its last operation on it, when it is freed.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ...launch.watchdog import is_communication_error
from ...parallel.nccl_check import set_label, set_op_labels
from .group import group_backend, group_rank, post_ops
from .plan import Region, TransferPlan

__all__ = ["TransferExecutor", "TransferFailed"]


class TransferFailed(RuntimeError):
    """A transfer's operation failed because a member of the group died, stalled (the group's timeout) or was cut
    off; the message names this rank and the step (its peers) or the final all-reduce. The group is unusable
    afterwards; the sources were only read."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _view(t: torch.Tensor, region: Region, base: Region) -> torch.Tensor:
    for d, ((a, b), (o, _)) in enumerate(zip(region, base)):
        t = t.narrow(d, a - o, b - a)
    return t


class TransferExecutor:
    """This rank's part of a plan, compiled once; `run` moves the weights (every rank of ``group`` calls it).

    Plan ranks are ranks of ``group`` (default: the world; a group `join_transfer_group` made spans other jobs).
    Construction checks, with one object all-gather over the group, that every rank holds the same plan (its
    ``key``) — the only other collective."""

    def __init__(self, plan: TransferPlan, group: Any = None, *, check: bool = True) -> None:
        if group is None and not dist.is_initialized():
            raise RuntimeError("a weight transfer needs an initialised torch.distributed process group")
        self.plan, self.group = plan, group
        self.rank = group_rank(group)
        world = dist.get_world_size(group)
        used = max({*plan.source, *plan.dest, *plan.hosts})
        if used >= world:
            raise ValueError(f"the plan uses rank {used} but the process group has {world} ranks")
        self._nccl = group_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self._nccl else torch.device("cpu")
        if check:
            keys: list[Any] = [None] * world
            dist.all_gather_object(keys, plan.key, group=group)
            bad = sorted(r for r, k in enumerate(keys) if k != plan.key)
            if bad:
                raise ValueError(f"rank(s) {bad} of the transfer group hold another plan than rank {self.rank} "
                                 f"(keys {keys[bad[0]][:12]} vs {plan.key[:12]}): every rank must plan from the same "
                                 "layouts, hosts and bucket size")
        me = self.rank
        # per step: this rank's (bucket, message index, kind) in global order
        self.steps: dict[int, list[tuple[int, int, str]]] = {}
        self.last_step: dict[int, int] = {}  # bucket -> this rank's last step on it
        for b in plan.buckets:
            for j, (m, s) in enumerate(zip(b.msgs, b.steps)):
                if m.src == me or m.dst == me:
                    self.steps.setdefault(s, []).append((b.index, j, "send" if m.src == me else "recv"))
                    self.last_step[b.index] = max(self.last_step.get(b.index, -1), s)
        self.local = [(n, reg) for r, n, reg in plan.local_copies if r == me]
        self.src_boxes = plan.source.get(me, {})
        self.dst_boxes = plan.dest.get(me, {})

    def _check(self, given: Mapping[str, torch.Tensor], boxes: Mapping, what: str) -> None:
        missing = sorted(n for n in boxes if n not in given)
        if missing:
            raise ValueError(f"rank {self.rank}: no {what} tensor for {len(missing)} parameter(s) the plan gives it, "
                             f"first {missing[0]}")
        p = {q.name: q for q in self.plan.params}
        for n, b in boxes.items():
            t = given[n]
            if tuple(t.shape) != b.shape or t.dtype != _DTYPES.get(p[n].dtype):
                raise ValueError(f"rank {self.rank}: {what} tensor {n} is {tuple(t.shape)} {t.dtype}, the plan's box "
                                 f"{list(b.region)} needs {b.shape} {p[n].dtype}")

    def run(self, sources: Mapping[str, torch.Tensor] | None = None,
            dests: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Move the weights: ``sources`` this rank's source tensors by global name (each of its box's shape),
        ``dests`` the tensors its destination boxes fill. Returns the report: bytes, seconds (the slowest
        rank's), effective rate, the network bound and the fraction of it reached."""
        plan, me = self.plan, self.rank
        sources, dests = dict(sources or {}), dict(dests or {})
        self._check(sources, self.src_boxes, "source")
        self._check(dests, self.dst_boxes, "destination")
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, reg in self.local:
                _view(dests[name], reg, self.dst_boxes[name].region).copy_(
                    _view(sources[name], reg, self.src_boxes[name].region))
            staged: dict[int, torch.Tensor] = {}
            peak = 0
            for step in sorted(self.steps):
                ops, labels, works_of = [], [], []
                for bi, j, kind in self.steps[step]:
                    b = plan.buckets[bi]
                    if bi not in staged:
                        staged[bi] = self._stage(b, sources, me == b.sender)
                        peak = max(peak, sum(t.numel() * t.element_size() for t in staged.values()))
                    m = b.msgs[j]
                    flat = staged[bi][m.start:m.stop]
                    ops.append((kind, flat, m.dst if kind == "send" else m.src))  # group ranks
                    labels.append(f"wt{plan.key[:8]}/b{bi}/m{j}")
                    works_of.append(bi)
                set_op_labels(labels)
                try:
                    for w in post_ops(ops, self.group):
                        w.wait()
                except Exception as e:
                    self._failed(e, f"its step {step} of {plan.num_steps} (messages with ranks "
                                    f"{sorted({p for _, _, p in ops})})")
                finally:
                    set_op_labels(None)
                for bi in dict.fromkeys(works_of):
                    if self.last_step[bi] == step:
                        b = plan.buckets[bi]
                        if me in b.receivers:
                            self._unpack(b, staged[bi], dests)
                        del staged[bi]
            for b in plan.aliases.get(me, []):
                first = self.dst_boxes[b.name]
                dests[b.local_name].copy_(_view(dests[b.name], b.region, first.region))
        if self._nccl:
            torch.cuda.synchronize()
        mine = time.perf_counter() - t0
        slowest = torch.tensor([mine], dtype=torch.float64, device=self.device)
        set_label(f"wt{plan.key[:8]}/time")
        try:
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as e:
            self._failed(e, "the final all-reduce of the slowest rank's time (every rank of the group)")
        finally:
            set_label(None)
        seconds = float(slowest.item())
        bound = plan.lower_bound_s()
        return {"bytes": plan.wire_bytes, "delivered_bytes": plan.delivered_bytes, "seconds": seconds,
                "rate_gbps": plan.wire_bytes * 8 / seconds / 1e9 if seconds > 0 else None,
                "bound_s": bound, "bound_fraction": bound / seconds if seconds > 0 and bound > 0 else None,
                "buckets": len(plan.buckets), "steps": plan.num_steps, "rank_seconds": mine,
                "rank_staging_bytes": peak}

    def _failed(self, e: Exception, where: str) -> None:
        """Raise a communication error as `TransferFailed`, naming this rank and where in the plan it was."""
        if not is_communication_error(e):
            raise e
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise TransferFailed(f"rank {self.rank} of the transfer group failed in {where}: {type(e).__name__}: "
                             f"{first} (a peer rank died, stalled or lost its network)") from e

    def _stage(self, b, sources: Mapping[str, torch.Tensor], pack: bool) -> torch.Tensor:
        """The bucket's flat buffer: packed from this rank's source boxes when it is the bucket's sender."""
        flat = torch.empty(b.numel, dtype=_DTYPES[b.dtype], device=self.device)
        if pack:
            for i, off in b.entries:
                u = self.plan.pieces[i]
                name = self.plan.piece_names[i]
                reg = tuple((s.start, s.stop) for s in u.slice)
                flat[off:off + u.numel].view(*(z - a for a, z in reg)).copy_(
                    _view(sources[name], reg, self.src_boxes[name].region))
        return flat

    def _unpack(self, b, flat: torch.Tensor, dests: Mapping[str, torch.Tensor]) -> None:
        for i, off in b.entries:
            u = self.plan.pieces[i]
            name = self.plan.piece_names[i]
            reg = tuple((s.start, s.stop) for s in u.slice)
            _view(dests[name], reg, self.dst_boxes[name].region).copy_(
                flat[off:off + u.numel].view(*(z - a for a, z in reg)))
