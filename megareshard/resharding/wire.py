"""What a resharding strategy produces for one unit task: its point-to-point messages (`Msg`, what the executor
sends) and what it costs the hosts' NICs (`TaskCost`, what the network model and the schedulers weigh). Pure
data, shared by the strategies (`strategies/`), the executor's message layout (`messages.py`) and the network
model (`network.py`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["Msg", "TaskCost", "SEND", "RECV", "INTRA", "by_host"]

SEND, RECV, INTRA = 0, 1, 2  # NIC directions / resources of a host


@dataclass(frozen=True)
class Msg:
    """One point-to-point message: elements [start, stop) of a task's flattened slice."""

    src: int
    dst: int
    start: int
    stop: int
    forward: bool  # src received this range itself (broadcast hop, fan-out, allgather exchange)


@dataclass(frozen=True)
class TaskCost:
    """What one unit task does to the hosts, for a given sending host and strategy.

    `nic_bytes` is the task's NIC duration expressed in bytes (divide by bandwidth for
    seconds); `intra_bytes` the intra-host work on its critical path; `pipelined` tells
    whether the two overlap (broadcast) or add up (sendrecv, allgather).
    """

    nic_bytes: float
    intra_bytes: float
    pipelined: bool
    out_bytes: Mapping[int, int] = field(default_factory=dict)  # host -> bytes out of its NIC
    in_bytes: Mapping[int, int] = field(default_factory=dict)  # host -> bytes into its NIC
    chain: tuple[int, ...] = ()  # sender host then receiving hosts (broadcast/signal order)

    def resources(self, sender_host: int) -> tuple[tuple[int, int], ...]:
        """(host, SEND/RECV/INTRA) sides this task occupies."""
        res = [(h, SEND) for h in sorted(self.out_bytes)] + [(h, RECV) for h in sorted(self.in_bytes)]
        if not res:
            res = [(sender_host, INTRA)]
        return tuple(res)

    def seconds(self, nic_Bps: float, intra_Bps: float, latency_s: float = 0.0) -> float:
        nic = self.nic_bytes / nic_Bps
        intra = self.intra_bytes / intra_Bps
        return (max(nic, intra) if self.pipelined else nic + intra) + latency_s


def by_host(ranks: Iterable[int], host_of: Mapping[int, int]) -> dict[int, list[int]]:
    """`ranks` grouped by host, each host's in the order given, hosts in order of first appearance."""
    out: dict[int, list[int]] = {}
    for r in ranks:
        out.setdefault(host_of[r], []).append(r)
    return out
