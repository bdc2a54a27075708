"""The simulator's network: a transfer holds the sender's send channel and the receiver's receive channel."""
from __future__ import annotations

import pytest

from megareshard.pipeline import Costs, PipelineGraph, generate, simulate
from megareshard.pipeline.schedule import ActionKind as K

C = 5.0  # ms per transfer on the edges into stage 3


def _fan_in(recv_nic: bool):
    """Stages 0, 1, 2 each send one tensor to stage 3 at t = 0 (chain 2->3, skips 0->3 and 1->3).

    Compute before stage 3 is free and the chain edges 0->1, 1->2 cost nothing, so the three
    transfers into stage 3 become ready together, on three different senders' NICs."""
    g = PipelineGraph(4, ((0, 3, "a"), (1, 3, "b")))
    costs = Costs(f=[0, 0, 0, 1], b=[0, 0, 0, 1], comm={"0->1": 0.0, "1->2": 0.0, "*": C}, recv_nic=recv_nic)
    return simulate(generate("1f1b", 4, 1, graph=g), costs=costs)


def test_three_senders_into_one_host_take_three_times_as_long():
    tl = _fan_in(recv_nic=True)
    into3 = sorted((c for c in tl.comm if c.receiver == 3 and c.direction == "F"), key=lambda c: c.start)
    assert {str(c.edge) for c in into3} == {"0->3:a", "1->3:b", "2->3"}
    # one after the other on stage 3's receive channel: the last lands at 3 C, not C
    assert [(c.start, c.end) for c in into3] == [(0.0, C), (C, 2 * C), (2 * C, 3 * C)]
    f3 = next(iv for iv in tl.compute[3] if iv.action.kind == K.F)
    assert f3.start == 3 * C
    # without the receive channel the three overlap and stage 3 starts after one transfer
    free = _fan_in(recv_nic=False)
    assert next(iv for iv in free.compute[3] if iv.action.kind == K.F).start == C
    assert tl.makespan - free.makespan == pytest.approx(2 * C)


def test_receive_channel_is_separate_from_send_channel_and_work_conserving():
    """Full duplex: stage 3 sends its three gradients while nothing else is in flight, and a
    sender whose first transfer waits for a busy receiver still sends to an idle one."""
    tl = _fan_in(recv_nic=True)
    out3 = sorted((c for c in tl.comm if c.sender == 3), key=lambda c: c.start)
    # B on stage 3 ends at 3C + 2 (F = 1, B = 1); its three gradients leave one after the other
    assert [c.start for c in out3] == [3 * C + 2, 4 * C + 2, 5 * C + 2]
    for stage in range(4):  # no channel carries two transfers at once
        for side in ("sender", "receiver"):
            xs = sorted((c.start, c.end) for c in tl.comm if getattr(c, side) == stage)
            assert all(a[1] <= b[0] for a, b in zip(xs, xs[1:])), (stage, side, xs)


def test_chain_receiver_gets_activation_and_gradient_one_after_the_other():
    """On a chain, stage 1 receives activations from stage 0 and gradients from stage 2 on one
    receive channel: with m microbatches and every transfer costing c, stage 1's receive
    channel carries 2 m c in all, and the two kinds never overlap."""
    c = 0.75
    tl = simulate(generate("1f1b", 3, 4), costs=Costs(f=1, b=2, comm=c))
    into1 = sorted((x.start, x.end) for x in tl.comm if x.receiver == 1)
    assert len(into1) == 2 * 4 and sum(e - s for s, e in into1) == pytest.approx(2 * 4 * c)
    assert all(a[1] <= b[0] for a, b in zip(into1, into1[1:]))


def test_plot_schedule_models_the_receiving_nic_unless_told_not_to():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import plot_schedule

    argv = ["--schedule", "1f1b", "--stages", "4", "--microbatches", "4", "--comm", "1", "--skip", "0", "3",
            "--skip", "1", "3"]
    (both,) = plot_schedule.build_timelines(plot_schedule.parse_args(argv))
    (send_only,) = plot_schedule.build_timelines(plot_schedule.parse_args(argv + ["--no-recv-nic"]))
    # stage 3 receives three activations per microbatch: they queue on its NIC only in the full model
    assert both.makespan > send_only.makespan


def test_posting_a_send_or_a_receive_holds_the_program():
    """gpipe, 2 stages, 1 microbatch (F = 1, B = 2, free wire): stage 0 posts its gradient receive, runs F and
    posts the send; stage 1 posts its receive and waits. The two sends lie on the critical path (6 + 2 p); the
    receives are posted at the start (stage 1's while it waits, stage 0's before its first compute, which is
    where the makespan starts), so they cost nothing here."""
    sched = generate("gpipe", 2, 1)
    for p, r in ((0.0, 0.0), (0.5, 0.0), (0.0, 0.25), (0.5, 0.25)):
        tl = simulate(sched, costs=Costs(f=1.0, b=2.0, comm=0.0, send_post=p, recv_post=r))
        assert tl.makespan == pytest.approx(6 + 2 * p, abs=1e-12), (p, r)
        assert [iv.start for iv in tl.compute[1]] == pytest.approx([1 + r + p, 2 + r + p]), (p, r)  # F, B
        sends = sorted(c.start for c in tl.comm)
        assert sends == pytest.approx([1 + r + p, 4 + r + 2 * p]), (p, r)  # each leaves once posted
    # 1f1b, 4 stages: free posts are the simulator without them, bit for bit; each kind of post costs time
    sched = generate("1f1b", 4, 16)
    base = simulate(sched, costs=Costs(f=1.0, b=2.0, comm=0.1)).makespan
    span = {(p, r): simulate(sched, costs=Costs(f=1.0, b=2.0, comm=0.1, send_post=p, recv_post=r)).makespan
            for p, r in ((0.0, 0.0), (0.05, 0.0), (0.0, 0.05), (0.05, 0.05))}
    assert span[0.0, 0.0] == base
    assert base < span[0.05, 0.0] < span[0.05, 0.05] and base < span[0.0, 0.05] < span[0.05, 0.05]
    # no program can do more than its compute and its posts back to back: a middle stage's 16 × (F + B) and
    # its 4 posts per microbatch bound the step from below (stage 1 starts after stage 0's F and one transfer)
    assert span[0.05, 0.05] >= 16 * 3.0 + 16 * 4 * 0.05
