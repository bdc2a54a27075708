"""Receives follow sends per channel (sending mesh -> receiving mesh), across every edge it carries.

NCCL pairs the messages between two ranks in issue order, and tensors of several edges between the
same two stages can share a communicator, so the lowering posts receives in the sender's merged
order and the validator refuses a program that does not.
"""
from __future__ import annotations

import itertools

import pytest

from megareshard.pipeline import ActionKind, PipelineGraph, ScheduleError, generate, lower, validate
from megareshard.pipeline.schedule import Schedule

GRAPHS = [
    PipelineGraph(3, skip_edges=[(0, 1, "x"), (1, 2, "y")]),  # a second tensor beside each chain edge
    PipelineGraph(4, skip_edges=[(0, 1, "a"), (0, 3, "b"), (1, 3, "c")]),
]


@pytest.mark.parametrize("graph", GRAPHS, ids=["parallel", "mixed"])
def test_every_schedule_posts_in_the_senders_order(graph: PipelineGraph) -> None:
    for name, dw, L, m in itertools.product(("gpipe", "1f1b", "eager-1f1b"), (False, True), (1, 2, 3), (1, 4, 7)):
        validate(lower(generate(name, graph.num_stages, m, dw, graph), lookahead=L))


def test_a_crossed_receive_is_refused() -> None:
    graph = GRAPHS[0]
    low = lower(generate("1f1b", 3, 4, False, graph))
    acts = low.actions[1]
    # swap stage 1's first two activation receives from stage 0 (edges 0->1 and 0->1:x, mb 0)
    i, j = [k for k, a in enumerate(acts) if a.kind == ActionKind.RECV_F and a.peer == 0][:2]
    assert acts[i].edge != acts[j].edge
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=r"mesh 0 -> mesh 1: send #0 is \('0->1', 'F', 0\) but receive "
                                            r"#0 is \('0->1:x', 'F', 0\).*pair in issue order"):
        validate(Schedule(graph, low.num_microbatches, [list(a) for a in low.actions[:1]] + [acts]
                          + [list(a) for a in low.actions[2:]]))
