"""The `Strategy` record and its registry (pure: no torch, no processes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from ...registry import Registry
from ..wire import Msg, TaskCost

__all__ = ["ChunkModel", "Strategy", "STRATEGIES", "register_strategy", "get_strategy", "strategy_names"]

class ChunkModel(Protocol):
    """What a strategy's chunk choice asks of the network model (`network.NetworkModel`, which imports the
    strategies: named by what it offers, not imported)."""

    def broadcast_chunks(self, nbytes: int, hosts: int, numel: int) -> int: ...


MessagesFn = Callable[[int, int, Sequence[int], Mapping[int, int], int], list[Msg]]
CostFn = Callable[[int, int, Mapping[int, int], int], TaskCost]


@dataclass(frozen=True)
class Strategy:
    """One way to move a unit task's slice from its sender to its receivers."""

    name: str
    """Its name (``--reshard-strategy``)."""
    help: str
    """One line for ``--help`` and the docs."""
    messages: MessagesFn
    """``(numel, sender, remote receivers (sorted), host_of, chunks) -> messages`` in global posting order:
    flat element ranges between ranks; a message whose source received the range itself is a *forward*."""
    cost: CostFn
    """``(nbytes, sender_host, receiving ranks per host that need the data, chunks) -> TaskCost``."""
    chunks: Callable[[ChunkModel, int, int, int], int] | None = None
    """``(network model, nbytes, receiving hosts, numel) -> K``: how many pipelined chunks a task is split into
    (the broadcast chain's); None: one."""
    carries_data: bool = True
    """False for a bound that sends placeholder bytes (the receivers' tensors then hold undefined values)."""
    wire_bytes: Callable[[int], int] | None = None
    """The bytes a task of ``nbytes`` puts on the wire (the network model's lower bound counts them); None:
    ``nbytes``."""
    copy_per_receiver: bool = False
    """Every receiving rank gets its own copy over the NIC (the planner's quick transfer bound counts them)."""
    nccl_broadcast: bool = False
    """On NCCL: one ``torch.distributed.broadcast`` per task on the task's communicator (NCCL pipelines it
    itself) instead of the messages; otherwise the messages, batched."""
    backends: frozenset[str] = field(default=frozenset({"gloo", "nccl"}))
    """The torch.distributed backends it runs on."""
    planned: bool = True
    """The layout planner considers it (a bound such as ``signal`` is not a choice)."""


STRATEGIES: Registry[Strategy] = Registry("resharding strategy", type_=Strategy)


def register_strategy(strategy: Strategy) -> Strategy:
    """Add `strategy` (the registry rule: `megareshard.registry`)."""
    return STRATEGIES.register(strategy)


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`; an unknown name raises with the names there are."""
    return STRATEGIES.get(name)


def strategy_names(planned: bool = False) -> tuple[str, ...]:
    """The registered names in registration order (``planned``: only those the layout planner considers)."""
    return tuple(s.name for s in STRATEGIES.items() if s.planned or not planned)
