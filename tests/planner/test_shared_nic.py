"""Data-parallel replicas whose stage-boundary transfers share a host's NIC (pure): each replica's transfer alone,
the share of the time the others hold the NIC, and the NIC's throughput bound on the pipeline."""
from __future__ import annotations

import pytest

from megareshard.pipeline.schedule import Edge
from megareshard.pipeline.simulate import CommInterval, Timeline
from megareshard.planner import ClusterSpec, ModelShape, plan_layouts
from megareshard.planner import search
from megareshard.planner.search import _edge_seconds, _shapes, _shared_edges

MID = ModelShape(num_layers=6, hidden_size=160, num_attention_heads=4, seq_length=80, vocab_size=640)


def _shape(model, cluster, tp, pp, b=2):
    return next(s for s in _shapes(model, cluster, 12, (b,), (0,), (False,), False)
                if (s.tp, s.pp) == (tp, pp) and not s.layouts)


def test_two_replicas_on_one_host_send_twice_the_bytes_of_one() -> None:
    """3 hosts × 2, tp1 pp3 dp2: each mesh is one host holding both replicas, so a boundary moves both
    replicas' rows through one NIC: all at once it takes one replica's bytes longer than one replica alone."""
    c = ClusterSpec(hosts=3, devices_per_host=2, nic_gbps=0.08, intra_gbps=10)
    sh = _shape(MID, c, 1, 3)
    edges, solo, busiest = _edge_seconds(MID, c, sh, "allgather", {})
    one = MID.seq_length * sh.b * MID.hidden_size * MID.dtype_bytes  # one replica's rows
    assert busiest == 2 * one
    for k in edges:
        assert edges[k] - solo[k] == pytest.approx(one / c.nic_Bps, rel=1e-12)
    # tp2 pp3 dp1: one row per mesh, nothing to share
    edges, solo, _ = _edge_seconds(MID, c, _shape(MID, c, 2, 3), "allgather", {})
    assert edges == solo


def _timeline(intervals: list[tuple[float, float]], end: float) -> Timeline:
    e = Edge(0, 1)
    comm = [CommInterval(a, b, e, "F", i, 0, 1) for i, (a, b) in enumerate(intervals)]
    comm.append(CommInterval(end - 1e-3, end, Edge(1, 2), "F", 0, 1, 2))  # sets the makespan
    return Timeline(3, [[], [], []], comm)


def test_a_transfer_meets_the_other_replicas_for_their_share_of_the_time() -> None:
    # mesh 0 sends for 2 s of 4: the other replica holds the NIC half the time
    tl = _timeline([(0.0, 1.0), (2.0, 3.0)], 4.0)
    shared, bound = _shared_edges({"*": 2.0}, {"*": 1.0}, tl)
    assert shared == {"*": pytest.approx(1.5)}
    assert bound == pytest.approx(4.0)  # both replicas' transfers: 2 × 2 s on mesh 0's send side
    # a NIC never idle: every transfer meets the other's, the full time
    shared, _ = _shared_edges({"*": 2.0}, {"*": 1.0}, _timeline([(0.0, 2.0), (2.0, 4.0)], 4.0))
    assert shared == {"*": pytest.approx(2.0)}


@pytest.mark.parametrize("nic_gbps", [0.08, 0.004])
def test_sharing_lies_between_never_and_always_colliding(monkeypatch, nic_gbps) -> None:
    """The pp3 dp2 layout's step: above the step with every transfer alone, below the step with every transfer
    meeting the other replica's, and never below the NIC's throughput (2 m transfers through the middle mesh's
    NIC per replica, both replicas)."""
    c = ClusterSpec(hosts=3, devices_per_host=2, nic_gbps=nic_gbps, intra_gbps=10)

    def step(**patch) -> tuple[float, float, int]:
        for name, fn in patch.items():
            monkeypatch.setattr(search, name, fn)
        ranked = plan_layouts(MID, c, 12, micro_batches=(2,), schedules=["1f1b"], strategies=["allgather"],
                              zero_stages=(0,), recompute_options=(False,), stage_meshes=False, uneven_splits=False)
        x = next(x for x in ranked if (x.tp, x.pp, x.dp) == (1, 3, 2) and not x.delay_wgrad)
        monkeypatch.undo()
        return x.step_s, x.edge_s, x.num_microbatches

    shared, full, m = step()
    never, _, _ = step(_shared_edges=lambda edges, solo, tl: (solo, 0.0))
    always, _, _ = step(_replica_seconds=lambda plan, net: net.predict(plan, order="concurrent"))
    assert never < shared < always
    assert shared >= 2 * m * full * (1 - 1e-12)
