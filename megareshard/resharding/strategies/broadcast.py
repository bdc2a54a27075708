"""``broadcast`` (paper §3.1): the slice in K chunks pipelined along a chain sender → first receiver of each
other host (hosts in the order they first appear in ``remote``: ascending for a sorted list), each hop forwarding chunk k as soon as it has it and fanning it out to the other
receivers on its host — t + (A−1)·t/K ≈ t, the NIC lower bound. On NCCL one ``broadcast`` per task on its
communicator (NCCL pipelines it itself); gloo's broadcast is not host-aware, so the chain of point-to-point
messages runs there."""
from __future__ import annotations

from typing import Mapping, Sequence

from ..spec import split_bounds
from ..wire import Msg, TaskCost, by_host
from .base import ChunkModel, Strategy, register_strategy


def messages(numel: int, sender: int, remote: Sequence[int], host_of: Mapping[int, int], chunks: int) -> list[Msg]:
    if not remote:
        return []
    groups = by_host(remote, host_of)
    local = groups.pop(host_of[sender], [])  # the sender is the head of its own host
    hosts = list(groups)
    heads = [groups[h][0] for h in hosts]
    msgs: list[Msg] = []
    for a, b in split_bounds(numel, max(1, min(chunks, numel))):
        prev = sender
        for r in local:
            msgs.append(Msg(sender, r, a, b, False))
        for head in heads:
            msgs.append(Msg(prev, head, a, b, prev != sender))
            prev = head
        for h, head in zip(hosts, heads):
            msgs.extend(Msg(head, r, a, b, True) for r in groups[h][1:])
    return msgs


def cost(nbytes: int, sender_host: int, receivers_per_host: Mapping[int, int], chunks: int) -> TaskCost:
    """A pipelined chain: every host of the chain but the last sends the slice once, every receiving host
    receives it once; the NIC time is t·(1 + (A−1)/K), overlapping the fan-out inside hosts."""
    remote = {h: c for h, c in sorted(receivers_per_host.items()) if h != sender_host and c > 0}
    local = receivers_per_host.get(sender_host, 0)
    fanout = local > 0 or any(c > 1 for c in remote.values())
    chain = (sender_host, *remote)
    a = len(remote)
    hops = a + (1 if fanout else 0)
    return TaskCost(
        nic_bytes=float(nbytes * (1 + (a - 1) / chunks)) if a else 0.0,
        intra_bytes=float(nbytes) * ((1 + (hops - 1) / chunks) if a else 1.0) if fanout else 0.0,
        pipelined=True, out_bytes={h: nbytes for h in chain[:-1]} if a else {}, in_bytes={h: nbytes for h in remote},
        chain=chain)


def chunks(net: ChunkModel, nbytes: int, hosts: int, numel: int) -> int:
    """The network model's K for the chain (`NetworkModel.broadcast_chunks`)."""
    return net.broadcast_chunks(nbytes, hosts, numel)


BROADCAST = register_strategy(Strategy(
    "broadcast", "pipelined broadcast along a chain of hosts, fanned out inside each (the paper's)", messages, cost,
    chunks=chunks, nccl_broadcast=True))
