"""A star with local fan-out: the sender sends the whole slice once to the first receiver of every other host,
which copies it to the other receivers of its host. A·t on the sender's NIC (A receiving hosts), like allgather,
but each receiving host's NIC carries it once and no host splits it."""
from typing import Mapping, Sequence

from megareshard.resharding import Strategy
from megareshard.resharding.wire import Msg, TaskCost


def messages(numel: int, sender: int, remote: Sequence[int], host_of: Mapping[int, int], chunks: int) -> list[Msg]:
    by_host: dict[int, list[int]] = {}
    for r in remote:
        by_host.setdefault(host_of[r], []).append(r)
    msgs = []
    for host, ranks in sorted(by_host.items()):
        if host == host_of[sender]:  # the sender serves its own host
            msgs += [Msg(sender, r, 0, numel, False) for r in ranks]
            continue
        head, rest = ranks[0], ranks[1:]
        msgs.append(Msg(sender, head, 0, numel, False))
        msgs += [Msg(head, r, 0, numel, True) for r in rest]  # forwarded: head received it first
    return msgs


def cost(nbytes: int, sender_host: int, receivers_per_host: Mapping[int, int], chunks: int) -> TaskCost:
    remote = {h: c for h, c in sorted(receivers_per_host.items()) if h != sender_host and c > 0}
    fan_out = max([receivers_per_host.get(sender_host, 0)] + [c - 1 for c in remote.values()])
    return TaskCost(nic_bytes=float(nbytes * len(remote)), intra_bytes=float(nbytes * fan_out), pipelined=False,
                    out_bytes={sender_host: nbytes * len(remote)} if remote else {},
                    in_bytes={h: nbytes for h in remote}, chain=(sender_host, *remote))


STAR = Strategy("star", "the whole slice to one rank per host, which copies it to the others", messages, cost)
