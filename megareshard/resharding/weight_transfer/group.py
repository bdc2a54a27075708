"""The transfer's process group: the default one, one `torch.distributed.new_group` made in this process's world, or
one joined through a rendezvous of its own (`join_transfer_group`) — and the few calls the transfer makes on it,
all in ranks of that group.

**Why a group of its own.** A trainer and a separate generator job (an RL framework's inference workers) are two
torch.distributed worlds: ``init_process_group`` makes one default group per process, and ``new_group`` /
``split_group`` only carve subgroups out of it, so no public torch API (torch 2.13) makes a group that spans two
jobs. `join_transfer_group` therefore builds the group as torch's experimental ``torch.distributed._dist2.new_group``
and vLLM's ``stateless_init_torch_distributed_process_group`` do: a ``TCPStore`` of its own (rank 0 of the transfer
group serves it on ``host:port``), a backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) on a ``PrefixStore`` of
it, and a ``ProcessGroup`` that carries that backend — private methods (``_set_default_backend``,
``_register_backend``, ``_set_group_name``, the backend's ``_set_sequence_number_for_group``), used only in
`_make_group`, checked on the pinned torch by the tests. The group is not registered in torch's world
(``_world``), so this process's default group and every group it has are untouched, and a process with no default
group at all can join. torch's collectives (``all_reduce``, ``all_gather_object``)
and ``isend``/``irecv`` with ``group_dst``/``group_src`` work on such a group; what needs the registry — a group
rank through ``dist.get_rank(group)``, ``dist.get_backend``, ``P2POp`` (it maps ranks through the registry, so
``batch_isend_irecv`` cannot take it) — is replaced here: `group_rank`, `group_backend`, and `post_ops`, which does
exactly what ``batch_isend_irecv`` does (gloo: the operations one after the other; NCCL: inside torch's private
``_coalescing_manager``, ncclGroupStart/End — not run here on a GPU yet).

The NCCL checking mode (``MEGARESHARD_NCCL_CHECK``) sees a joined group's operations: the group is registered with
the recorder, which keeps them in a record of their own, ``DIR/group-<name>/rank<k>.json`` in transfer-group ranks
(``nccl_check.check_logs`` on that directory, once both jobs' records are in it).
"""
from __future__ import annotations

import contextlib
import re
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ...parallel import nccl_check

__all__ = ["join_transfer_group", "leave_transfer_group", "group_rank", "group_backend", "post_ops", "is_joined"]

# groups made by join_transfer_group: group -> its backend name (torch's registry does not know them)
_JOINED: dict[Any, str] = {}


def is_joined(group: Any) -> bool:
    return group is not None and group in _JOINED


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (None: the default group)."""
    if group is None:
        return dist.get_rank()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this process is not a member of the transfer group it was given")
    return group.rank()


def group_backend(group: Any) -> str:
    return _JOINED[group] if is_joined(group) else str(dist.get_backend(group))


def post_ops(ops: Sequence[tuple[str, torch.Tensor, int]], group: Any) -> list[Any]:
    """Post ``(kind, tensor, group peer)`` operations ("send"/"recv") as one group (NCCL's ncclGroupStart/End);
    returns their works. A joined group gets what ``batch_isend_irecv`` would do, which it cannot be given."""
    def one(kind: str, t: torch.Tensor, peer: int):
        if kind == "send":
            return dist.isend(t, group=group, group_dst=peer)
        return dist.irecv(t, group=group, group_src=peer)

    if len(ops) == 1:
        return [one(*ops[0])]
    if not is_joined(group):
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if k == "send" else dist.irecv, t, group=group,
                                                  group_peer=p) for k, t, p in ops])
    device = ops[0][1].device
    with nccl_check.op_batch(group):
        if _JOINED[group] == "nccl":  # batch_isend_irecv's own path for a backend that coalesces
            from torch.distributed.distributed_c10d import _coalescing_manager
            with _coalescing_manager(group, device, async_ops=True) as cm:
                for op in ops:
                    one(*op)
            return cm.works
        return [one(*op) for op in ops]


def join_transfer_group(host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
                        timeout: float | timedelta = 600.0, device: torch.device | None = None) -> Any:
    """A process group of ``world_size`` ranks spanning separate jobs, made through a rendezvous of its own: every
    member calls this with the same ``host:port`` (rank 0 serves the store there, the others connect) and its own
    ``rank``. Returns the group, for `WeightTransfer(..., group=...)`; this process's default group (if any) and its
    groups are untouched. ``timeout`` (seconds): the rendezvous's and every operation's on the group — a member
    that dies or stops answering fails the others' operation after at most this long. ``backend``: "gloo" or
    "nccl" (``device``: the CUDA device, default the current one)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"join_transfer_group: backend {backend!r} is not 'gloo' or 'nccl'")
    if not 0 <= rank < world_size:
        raise ValueError(f"join_transfer_group: rank {rank} is outside 0..{world_size - 1}")
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    name = f"megareshard-transfer-{host}-{port}"
    try:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=td, wait_for_workers=False)
    except dist.DistError as e:
        what = "serve the rendezvous on" if rank == 0 else "reach the rendezvous at"
        raise ConnectionError(f"join_transfer_group: rank {rank} could not {what} {host}:{port} within "
                              f"{td.total_seconds():g}s: {_first_line(e)}") from None
    store = dist.PrefixStore("megareshard-transfer/", store)
    if store.add(f"joined/{rank}", 1) != 1:
        raise ValueError(f"join_transfer_group: two processes joined {host}:{port} as rank {rank}")
    if rank == 0:
        store.set("world_size", str(world_size))
    elif int(store.get("world_size")) != world_size:
        raise ValueError(f"join_transfer_group: rank {rank} joined {host}:{port} with world_size {world_size}, "
                         f"rank 0 with {int(store.get('world_size'))}")
    keys = [f"joined/{r}" for r in range(world_size)]
    try:
        store.wait(keys, td)
    except dist.DistError as e:
        try:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
        except dist.DistError:  # rank 0, which serves the store, is gone
            raise ConnectionError(f"join_transfer_group: rank {rank} lost the rendezvous at {host}:{port} (rank 0 "
                                  f"serves it) while waiting for the other ranks: {_first_line(e)}") from None
        raise ConnectionError(f"join_transfer_group: rank {rank}: {len(missing)} of {world_size} ranks did not join "
                              f"{host}:{port} within {td.total_seconds():g}s (missing ranks {missing})") from None
    if backend == "nccl" and device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    group = _make_group(store, rank, world_size, backend, td, device, name)
    _JOINED[group] = backend
    nccl_check.maybe_install()
    nccl_check.register_group(group, re.sub(r"[^A-Za-z0-9_.-]", "_", name), rank, world_size)
    return group


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _make_group(store, rank: int, size: int, backend: str, timeout: timedelta, device, name: str) -> Any:
    """A ProcessGroup on ``store`` that torch's registry does not hold (module docstring: why, and that these are
    private methods of ProcessGroup, as in torch's own ``_dist2.new_group``)."""
    from torch.distributed import ProcessGroup
    pg = ProcessGroup(store, rank, size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo
        be = ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout)
        kind, devices = ProcessGroup.BackendType.GLOO, [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
    else:
        from torch.distributed import ProcessGroupNCCL
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        be = ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, size, opts)
        kind, devices = ProcessGroup.BackendType.NCCL, [device]
    be._set_sequence_number_for_group()
    pg._set_default_backend(kind)
    for d in devices:
        pg._register_backend(d, kind, be)
    pg._set_group_name(name)
    return pg


def leave_transfer_group(group: Any) -> None:
    """Close a group `join_transfer_group` made (every member, after its last transfer)."""
    if not is_joined(group):
        raise ValueError("leave_transfer_group: not a group join_transfer_group made")
    nccl_check.dump()
    del _JOINED[group]
    with contextlib.suppress(Exception):
        group.shutdown()
