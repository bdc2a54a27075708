"""``allgather`` (Megatron's scatter-gather, Alpa's "local allgather"): each receiving host's B devices receive
1/B of the slice each, then exchange the pieces inside the host — A·t for A hosts (paper §3.1)."""
from __future__ import annotations

from typing import Mapping, Sequence

from ..spec import split_bounds
from ..wire import Msg, TaskCost, by_host
from .base import Strategy, register_strategy


def messages(numel: int, sender: int, remote: Sequence[int], host_of: Mapping[int, int], chunks: int) -> list[Msg]:
    if not remote:
        return []
    hosts = by_host(remote, host_of)
    local = hosts.pop(host_of[sender], [])  # the sender's own host: served by the sender itself
    msgs = [Msg(sender, r, 0, numel, False) for r in local]
    for h in sorted(hosts):
        rs = hosts[h]
        pieces = split_bounds(numel, len(rs))
        for r, (a, b) in zip(rs, pieces):
            msgs.append(Msg(sender, r, a, b, False))
        for r, (a, b) in zip(rs, pieces):  # intra-host exchange
            if b > a:
                msgs.extend(Msg(r, o, a, b, True) for o in rs if o != r)
    return [m for m in msgs if m.stop > m.start]


def cost(nbytes: int, sender_host: int, receivers_per_host: Mapping[int, int], chunks: int) -> TaskCost:
    """The slice crosses the sender's NIC once per receiving host and each receiving host's NIC once; a host
    that fans it out to more than one device adds one intra-host pass."""
    remote = {h: c for h, c in sorted(receivers_per_host.items()) if h != sender_host and c > 0}
    local = receivers_per_host.get(sender_host, 0)
    fanout = local > 0 or any(c > 1 for c in remote.values())
    a = len(remote)
    return TaskCost(nic_bytes=float(nbytes * a), intra_bytes=float(nbytes) if fanout else 0.0, pipelined=False,
                    out_bytes={sender_host: nbytes * a} if a else {}, in_bytes={h: nbytes for h in remote},
                    chain=(sender_host, *remote))


ALLGATHER = register_strategy(Strategy(
    "allgather", "scatter to each receiving host's ranks, then all-gather inside the host (Megatron's "
    "scatter-gather)", messages, cost))
