"""When receives are posted and sends retired (`pipeline/posting.py`), and NCCL's model of it (pure).

* grouped posting pairs each receive with the last send to the same peer before its WAIT: on 1F1B that is
  torch's exchange (the forward send with the backward receive, the backward send with the next forward
  receive), written out by hand for two stages;
* every generated schedule runs to the end under NCCL's model (issue order per communicator, groups run
  together, a message completes when both ends run), with the mesh pairs `split_pairs` keeps apart; the
  one-stage-per-mesh families need none kept apart on a chain, and only the long skip edge's pair on a
  U-Transformer's graph;
* a hand-written schedule whose exchange would cross (both stages queue a send in front of the receive the
  other needs) is refused naming the waiting action and the send it queues behind; with its pair split it
  runs;
* every forward activation is retired (its data freed) by the WAIT of its own gradient at the latest, so
  before its backward runs, and the retire points are causal (after the receiver's WAIT).
"""
from __future__ import annotations

import itertools

import pytest

from megareshard.pipeline import ActionKind, PipelineGraph, Schedule, ScheduleError, generate, lower, validate
from megareshard.pipeline.generators import forward_only
from megareshard.pipeline.posting import (check_nccl, nccl_dry_run, plan_posting, retire_points, split_pairs,
                                          two_way_pairs)
from megareshard.pipeline.schedules import schedule_names

_K = ActionKind

CROSSING = """stages 2 microbatches 4
stage 0: F0 F1 F2 F3 B0 B1 B2 B3
stage 1: F0 F1 B0 B1 F2 F3 B2 B3
"""




def test_grouped_posting_is_torchs_1f1b_exchange():
    low = lower(generate("1f1b", 2, 4))
    plan = plan_posting(low, "grouped", {frozenset((0, 1))})
    sends = {m: [(a.text(), plan.posts[m].get(i, ())) for i, a in enumerate(low.actions[m])
                 if a.kind in (_K.SEND_F, _K.SEND_B)] for m in (0, 1)}
    # stage 0: the forward send of mb k+1 carries the receive of mb k's gradient; the last one also the last
    # gradient's (no send to stage 1 comes between)
    assert [(t, [(d, mb) for _, d, mb in p]) for t, p in sends[0]] == [
        ("SF0->1", []), ("SF1->1", [("B", 0)]), ("SF2->1", [("B", 1)]), ("SF3->1", [("B", 2), ("B", 3)])]
    assert not [i for i, a in enumerate(low.actions[0]) if a.kind == _K.WAIT_B and plan.posts[0].get(i)]
    # stage 1: the backward send of mb k carries the receive of mb k+1's activation
    assert [(t, [(d, mb) for _, d, mb in p]) for t, p in sends[1]] == [
        ("SB0->0", [("F", 1)]), ("SB1->0", [("F", 2)]), ("SB2->0", [("F", 3)]), ("SB3->0", [])]
    assert [plan.groups(m) for m in (0, 1)] == [3, 3]
    # RECV actions post nothing under grouped posting; under early posting each posts its own receive
    assert all(i not in plan.posts[m] for m in (0, 1) for i, a in enumerate(low.actions[m])
               if a.kind in (_K.RECV_F, _K.RECV_B))
    early = plan_posting(low, "early")
    assert all(early.posts[m] == {i: ((a.edge, a.kind.direction, a.mb),) for i, a in enumerate(low.actions[m])
                                  if a.kind in (_K.RECV_F, _K.RECV_B)} for m in (0, 1))
    assert not nccl_dry_run(low, plan)
    # a pair whose directions do not share a communicator keeps early posting under grouped mode too
    assert plan_posting(low, "grouped", ()).posts == early.posts


def _cases():
    for name in schedule_names():
        for P, m, dw in itertools.product((2, 3, 4), (2, 4, 8), (False, True)):
            try:
                yield name, P, m, dw, generate(name, P, m, delay_wgrad=dw)
            except (ScheduleError, ValueError):  # a kind that needs another shape (e.g. m a multiple of P)
                continue


def test_every_generated_schedule_runs_under_nccls_ordering():
    seen, kept_apart = set(), {}
    for name, P, m, dw, sched in _cases():
        low = lower(sched)
        ev = lower(forward_only(sched.graph, m, sched.placement))
        split = split_pairs([low, ev])
        for prog in (low, ev):
            shared = two_way_pairs(prog) - split
            plan = plan_posting(prog, "grouped", shared)
            check_nccl(prog, plan)  # raises naming the stuck action
            if prog is low and shared:
                assert sum(plan.groups(s) for s in range(low.num_meshes)) > 0, (name, P, m, dw)
        seen.add(name)
        if split:
            kept_apart[name] = kept_apart.get(name, 0) + 1
    assert {"gpipe", "1f1b", "eager-1f1b", "zb-h1"} <= seen
    # one stage per mesh: every exchange groups; virtual stages that cross back and forth between two meshes
    # (interleaved on 2 meshes, zbv) may keep a pair's directions apart
    assert not {"gpipe", "1f1b", "eager-1f1b", "zb-h1"} & set(kept_apart), kept_apart
    # a U-Transformer's skip edges: the first stage streams activations to the last one several microbatches
    # ahead of its gradients, so that pair keeps a communicator per direction; the chain pairs still group
    unet = PipelineGraph(4, ((0, 3, "skip0"), (1, 2, "skip1")))
    for name in ("1f1b", "eager-1f1b", "zb-h1"):
        low = lower(generate(name, 4, 4, graph=unet))
        split = split_pairs([low])
        assert split == {frozenset((0, 3))}, (name, split)
        plan = plan_posting(low, "grouped", two_way_pairs(low) - split)
        assert not nccl_dry_run(low, plan) and plan.groups(0) > 0, name
        with pytest.raises(ScheduleError, match="deadlock under NCCL's ordering"):
            check_nccl(low, plan_posting(low, "grouped", two_way_pairs(low)))


def test_a_crossing_exchange_is_refused_naming_the_action():
    low = lower(Schedule.loads(CROSSING))
    validate(low)  # fine with early posting (gloo)
    plan = plan_posting(low, "grouped", {frozenset((0, 1))})
    with pytest.raises(ScheduleError) as ei:
        check_nccl(low, plan)
    e = ei.value
    assert (e.mesh, e.index, e.action) == (0, 9, "WB0<-1@0"), e
    assert "queued behind the send of activation 2 on edge 0->1 (issued at mesh 0 action 6 'SF2->1@0')" in e.why, e.why
    assert split_pairs([low]) == {frozenset((0, 1))}
    assert not nccl_dry_run(low, plan_posting(low, "grouped", ()))  # directions apart: early receives, no hang


def test_sends_retire_causally_and_activations_before_their_backward():
    for name, P, m, dw, sched in _cases():
        low = lower(sched)
        retire = retire_points(low)
        where = {}
        for s, acts in enumerate(low.actions):
            for i, a in enumerate(acts):
                where[(a.kind, a.key)] = (s, i)
        for s, acts in enumerate(low.actions):
            done = {item: i for i, items in retire[s].items() for item in items}
            for i, a in enumerate(acts):
                if a.kind not in (_K.SEND_F, _K.SEND_B) or a.key not in done:
                    continue
                assert done[a.key] > i, (name, P, m, dw, a)
                if a.kind == _K.SEND_F:  # retired by the WAIT of its gradient at the latest
                    wait_b = where[(_K.WAIT_B, (a.edge, "B", a.mb))]
                    assert wait_b[0] == s and done[a.key] <= wait_b[1], (name, P, m, dw, a)
            assert all(a.key in done for a in acts if a.kind == _K.SEND_F), (name, P, m, dw)
