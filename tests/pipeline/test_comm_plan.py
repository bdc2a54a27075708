"""How many communicators the stage boundaries create: one per distinct (participants, forwarders), never per task.

Pure planning (no processes): the count `show_topology.py --communicators` prints and
docs/benchmarks.md quotes for a pp 8 x tp 8 x dp 4 GPT on 8-GPU hosts.
"""
from __future__ import annotations

import pytest

from megareshard.parallel import Topology
from tools.show_topology import count_communicators


@pytest.mark.parametrize("sp, want", [
    # no sequence parallelism: per edge and direction one task per dp slice, sent by one of its 8 tp
    # holders to the 8 tp ranks of the destination dp group -> 7 edges x 2 x dp 4 = 56 sets of 9 ranks
    (False, "56 for 7 edges x 2 directions, 9-9 ranks each; a rank is in at most 4"),
    # sequence parallel: every (dp, tp) slice has one holder and one receiver, and the two directions of an edge
    # between two single ranks share their communicator (a send and a receive can be one group) -> 7 x 32 pairs
    (True, "224 for 7 edges x 2 directions, 2-2 ranks each; a rank is in at most 2"),
])
def test_pp8_tp8_dp4_gpt(sp: bool, want: str) -> None:
    topo = Topology(256, tp=8, pp=8, nproc_per_node=8, order="tp-dp-pp")
    got = count_communicators(topo, seq=2048, micro_batch=1, hidden=4096, strategy="broadcast", sequence_parallel=sp)
    assert want in got, got
