"""``sendrecv``: the sender sends every receiver its own copy — A·B·t for A hosts × B devices (paper §3.1)."""
from __future__ import annotations

from typing import Mapping, Sequence

from ..wire import Msg, TaskCost
from .base import Strategy, register_strategy


def messages(numel: int, sender: int, remote: Sequence[int], host_of: Mapping[int, int], chunks: int) -> list[Msg]:
    return [Msg(sender, r, 0, numel, False) for r in remote]


def cost(nbytes: int, sender_host: int, receivers_per_host: Mapping[int, int], chunks: int) -> TaskCost:
    """Every remote receiving rank's copy crosses the sender's NIC and its own host's; local receivers are
    intra-host copies."""
    remote = {h: c for h, c in sorted(receivers_per_host.items()) if h != sender_host and c > 0}
    local = receivers_per_host.get(sender_host, 0)
    n = sum(remote.values())
    return TaskCost(nic_bytes=float(nbytes * n), intra_bytes=float(nbytes * local), pipelined=False,
                    out_bytes={sender_host: nbytes * n} if n else {},
                    in_bytes={h: nbytes * c for h, c in remote.items()}, chain=(sender_host, *remote))


SENDRECV = register_strategy(Strategy(
    "sendrecv", "point-to-point: every receiving rank gets its own copy from the sender", messages, cost,
    copy_per_receiver=True))
