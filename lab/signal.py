"""The ``signal`` bound: one byte per message instead of the data (``--custom-import lab.signal
--reshard-strategy signal``).

Not a strategy a user trains with: the receivers' tensors hold undefined values (the loss is meaningless), so
it is registered from the lab, never offered by the planner. What it measures is a schedule's time with
transfers as cheap as they can be made — every message still posted, paired and waited for — the upper bound
of what better communication can win back (docs/benchmarks.md: "fraction of the signal bound"). It is laid
out as ``sendrecv`` is (sender → every receiver), one placeholder byte each.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from megareshard.resharding.strategies import Strategy, register_strategy, sendrecv
from megareshard.resharding.wire import Msg, TaskCost


def messages(numel: int, sender: int, remote: Sequence[int], host_of: Mapping[int, int], chunks: int) -> list[Msg]:
    return [Msg(sender, r, 0, 1, False) for r in remote]


def cost(nbytes: int, sender_host: int, receivers_per_host: Mapping[int, int], chunks: int) -> TaskCost:
    return sendrecv.cost(1, sender_host, receivers_per_host, chunks)


def _one_byte(nbytes: int) -> int:
    return 1


SIGNAL = register_strategy(Strategy(
    "signal", "one byte per message: the communication upper bound of a benchmark (undefined stage inputs)",
    messages, cost, carries_data=False, wire_bytes=_one_byte, planned=False))
