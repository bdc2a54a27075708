"""The planner's fixed (latency) costs: each term moves the prediction the way it should, by its formula, and the
cluster file carries the new fields (pure: no processes)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megareshard.pipeline import generate, simulate
from megareshard.pipeline.simulate import Costs
from megareshard.planner import ClusterSpec, ModelShape, plan_layouts
from megareshard.planner.cluster_file import CLUSTER_FORMAT, cluster_to_json, load_cluster
from megareshard.planner.costs import GRAD_BUCKET_BYTES, layer_flops, mesh_dp_seconds, stage_costs, wgrad_share
from megareshard.planner.search import _message_latency, _pipeline
from megareshard.resharding import ShardingSpec, plan_resharding
from megareshard.resharding.mesh import Mesh

SMALL = ModelShape(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024)
ZERO = dict(intra_latency_s=0.0, nic_latency_s=0.0, collective_latency_s=0.0, action_overhead_s=0.0)
KW = dict(layers=4, first=False, last=False, micro_batch=2, recompute=False, zero=0, dp_ring_edges_per_nic=2)


def test_tp_collectives_cost_their_count_times_the_latency() -> None:
    c0 = ClusterSpec(1, 8, **ZERO)
    c = ClusterSpec(1, 8, intra_latency_s=1e-3, nic_latency_s=0.0, collective_latency_s=0.01, action_overhead_s=0.0)
    for sp in (False, True):
        t0 = stage_costs(SMALL, c0, tp=2, dp=1, sequence_parallel=sp, dp_crosses_hosts=False, **KW)
        t = stage_costs(SMALL, c, tp=2, dp=1, sequence_parallel=sp, dp_crosses_hosts=False, **KW)
        # per layer and direction: 2 all-reduces of 2 ring steps, or 4 all-gathers/reduce-scatters of 1 step
        per_layer = 4 * (0.01 + 1e-3) if sp else 2 * (0.01 + 2 * 1e-3)
        assert t.forward_s - t0.forward_s == pytest.approx(4 * per_layer)
        assert t.backward_s - t0.backward_s == pytest.approx(4 * per_layer)
        assert t.tp_latency_s == pytest.approx(8 * per_layer)
    sp = stage_costs(SMALL, c, tp=2, dp=1, sequence_parallel=True, dp_crosses_hosts=False, **KW)
    no = stage_costs(SMALL, c, tp=2, dp=1, sequence_parallel=False, dp_crosses_hosts=False, **KW)
    assert sp.forward_s > no.forward_s  # twice the collectives: the same bytes, more fixed costs
    t1 = stage_costs(SMALL, c, tp=1, dp=1, sequence_parallel=False, dp_crosses_hosts=False, **KW)
    assert t1.tp_latency_s == 0.0


def test_the_ends_pay_the_embedding_output_layer_and_cross_entropy_collectives() -> None:
    """tp 2, 2 samples of 128 tokens, h 256, 2-byte activations: per all-reduce 0.01 s + 2 ring steps of 1 ms
    fixed, per all-gather / reduce-scatter 0.01 s + 1 ms; bytes at 1 GB/s (8 Gbit/s)."""
    c = ClusterSpec(1, 8, intra_gbps=8.0, intra_latency_s=1e-3, nic_latency_s=0.0, collective_latency_s=0.01,
                    action_overhead_s=0.0)
    act = 2 * 128 * 256 * 2  # b·s·h 2-byte elements
    ar, one_way = 0.01 + 2e-3, 0.01 + 1e-3
    kw = KW | {"tp": 2, "dp": 1, "dp_crosses_hosts": False}
    for sp in (False, True):
        mid = stage_costs(SMALL, c, sequence_parallel=sp, **kw)
        first = stage_costs(SMALL, c, sequence_parallel=sp, **{**kw, "first": True})
        last = stage_costs(SMALL, c, sequence_parallel=sp, **{**kw, "last": True})
        # the embedding lookup is costed as no FLOPs: the difference is its collective alone
        assert first.forward_s - mid.forward_s == pytest.approx(
            (one_way + act / 2 / 1e9) if sp else (ar + act / 1e9), rel=1e-9)
        assert first.backward_s == pytest.approx(mid.backward_s, rel=1e-12)  # the embedding's backward: no collective
        logits = 2 * 2 * 128 * 256 * 1024 / 2 / c.flops  # the output layer's GEMM, split over tp
        ce = 3 * (ar + 2 * 128 * 4 / 1e9)                 # three all-reduces of b·s fp32
        out_f = (one_way + act / 2 / 1e9) if sp else 0.0   # the output layer's input: all-gathered under sp
        out_b = (one_way + act / 2 / 1e9) if sp else (ar + act / 1e9)
        assert last.forward_s - mid.forward_s == pytest.approx(logits + ce + out_f, rel=1e-9)
        assert last.backward_s - mid.backward_s == pytest.approx(c.backward_factor * logits + out_b, rel=1e-9)
        assert last.tp_latency_s - mid.tp_latency_s == pytest.approx(3 * ar + (2 * one_way if sp else ar))
    # tp 1: nothing to reduce at either end
    one = stage_costs(SMALL, c, **{**kw, "tp": 1, "first": True, "last": True}, sequence_parallel=False)
    assert one.tp_latency_s == 0.0 and one.tp_bytes_per_mb == 0


def test_the_backward_splits_into_w_by_the_weight_gemms_or_the_calibrated_share() -> None:
    c = ClusterSpec(1, 8, **ZERO)
    t = stage_costs(SMALL, c, tp=2, dp=1, sequence_parallel=False, dp_crosses_hosts=False, **KW)
    s, h = SMALL.seq_length, SMALL.hidden_size
    share = (layer_flops(SMALL, 1) - 4 * s * s * h) / (2 * layer_flops(SMALL, 1))  # weighted GEMMs / (2 × forward)
    assert wgrad_share(SMALL, c, 4, last=False) == pytest.approx(share)
    compute = 4 * layer_flops(SMALL, 2) / 2 / c.flops
    assert t.wgrad_s == pytest.approx(share * c.backward_factor * compute)  # compute only: the collectives are I's
    measured = dataclasses.replace(c, wgrad_fraction=0.2)
    assert stage_costs(SMALL, measured, tp=2, dp=1, sequence_parallel=False, dp_crosses_hosts=False,
                       **KW).wgrad_s == pytest.approx(0.2 * c.backward_factor * compute)
    # the simulator runs I = B − W and W: a small W leaves less for zero-bubble schedules to fill bubbles with
    f, b, w = (1.0, 1.0), (2.0, 2.0), (0.4, 0.4)
    got, _ = _pipeline("zb-h1", True, 2, 8, f, b, 0.0, {}, 1, 0.0, w)
    want = simulate(generate("zb-h1", 2, 8, True), costs=Costs(f=list(f), b=list(b), i=[1.6, 1.6], w=[0.4, 0.4],
                                                                comm=0.0)).makespan
    assert got == pytest.approx(want, rel=1e-12)
    half, _ = _pipeline("zb-h1", True, 2, 8, f, b, 0.0, {})
    assert half == pytest.approx(simulate(generate("zb-h1", 2, 8, True), costs=Costs(
        f=list(f), b=list(b), i=[1.0, 1.0], w=[1.0, 1.0], comm=0.0)).makespan, rel=1e-12) and half != got


def test_layer_overhead_is_paid_per_layer_whatever_the_micro_batch_and_tp() -> None:
    c0 = ClusterSpec(1, 8, **ZERO)
    c = dataclasses.replace(c0, layer_overhead_s=0.004, backward_factor=2.5)
    for tp, mb in ((1, 1), (2, 1), (1, 4), (2, 4)):
        kw = KW | {"micro_batch": mb}
        t0 = stage_costs(SMALL, dataclasses.replace(c0, backward_factor=2.5), tp=tp, dp=1, sequence_parallel=False,
                         dp_crosses_hosts=False, **kw)
        t = stage_costs(SMALL, c, tp=tp, dp=1, sequence_parallel=False, dp_crosses_hosts=False, **kw)
        assert t.forward_s - t0.forward_s == pytest.approx(4 * 0.004)          # 4 layers, not divided by tp
        assert t.backward_s - t0.backward_s == pytest.approx(2.5 * 4 * 0.004)
    # so a smaller micro batch is cheaper by less than its FLOPs: halving it no longer halves the forward
    half = stage_costs(SMALL, c, tp=1, dp=1, sequence_parallel=False, dp_crosses_hosts=False, **KW | {"micro_batch": 1})
    full = stage_costs(SMALL, c, tp=1, dp=1, sequence_parallel=False, dp_crosses_hosts=False, **KW)
    assert half.forward_s - 4 * 0.004 == pytest.approx((full.forward_s - 4 * 0.004) / 2)


def test_action_overhead_is_added_to_every_simulated_compute_action() -> None:
    f, b, e, o = (1.0, 1.2), (2.0, 2.4), 0.1, 0.25
    for dw in (False, True):
        got, _ = _pipeline("1f1b", dw, 2, 6, f, b, e, {}, 1, o)
        want = simulate(generate("1f1b", 2, 6, dw),
                        costs=Costs(f=[x + o for x in f], b=[x + o for x in b], i=[x / 2 + o for x in b],
                                    w=[x / 2 + o for x in b], comm=e)).makespan
        assert got == pytest.approx(want, rel=1e-12)
        plain, _ = _pipeline("1f1b", dw, 2, 6, f, b, e, {})
        # the slower stage runs 6 F and 6 B (or 6 I and 6 W) actions back to back in its steady phase
        assert got - plain >= 6 * (3 if dw else 2) * o - 1e-9
    # the overhead is not part of the stage's F and B (the budgets a validation run paces to)
    c0 = ClusterSpec(1, 8, **ZERO)
    c = ClusterSpec(1, 8, **{**ZERO, "action_overhead_s": 0.002})
    a = stage_costs(SMALL, c0, tp=1, dp=1, sequence_parallel=False, dp_crosses_hosts=False, **KW)
    b2 = stage_costs(SMALL, c, tp=1, dp=1, sequence_parallel=False, dp_crosses_hosts=False, **KW)
    assert (a.forward_s, a.backward_s) == (b2.forward_s, b2.backward_s)


def test_the_planners_gradient_bucket_is_the_trainers() -> None:
    import inspect

    from megareshard.optim.zero import ZeroOptimizer
    from megareshard.parallel.data_parallel import GradAverager

    for cls in (ZeroOptimizer, GradAverager):
        assert inspect.signature(cls.__init__).parameters["bucket_bytes"].default == GRAD_BUCKET_BYTES


def test_dp_reduction_pays_a_ring_of_latencies_per_bucket() -> None:
    c0 = ClusterSpec(2, 4, **ZERO)
    c = ClusterSpec(2, 4, intra_latency_s=1e-4, nic_latency_s=1e-3, collective_latency_s=0.0, action_overhead_s=0.0)
    for crosses, alpha in ((False, 1e-4), (True, 1e-3)):
        a = stage_costs(SMALL, c0, tp=1, dp=4, sequence_parallel=False, dp_crosses_hosts=crosses, **KW)
        b = stage_costs(SMALL, c, tp=1, dp=4, sequence_parallel=False, dp_crosses_hosts=crosses, **KW)
        assert 4 * a.params < GRAD_BUCKET_BYTES  # one bucket: one ring of 2·(dp−1) steps
        assert b.dp_seconds - a.dp_seconds == pytest.approx(2 * 3 * alpha)
    big = ModelShape(num_layers=8, hidden_size=4096, num_attention_heads=32, seq_length=128, vocab_size=1024)
    a = stage_costs(big, c0, tp=1, dp=4, sequence_parallel=False, dp_crosses_hosts=True, **KW)
    b = stage_costs(big, c, tp=1, dp=4, sequence_parallel=False, dp_crosses_hosts=True, **KW)
    buckets = -(-4 * a.params // GRAD_BUCKET_BYTES)
    assert buckets > 1 and b.dp_seconds - a.dp_seconds == pytest.approx(buckets * 2 * 3 * 1e-3)

    # two model chunks on one mesh (virtual stages): the trainer buckets them as one model, so their reduction pays
    # the ring bytes of both and the latency of one bucket (each stage alone counts its own)
    s1 = stage_costs(SMALL, c, tp=1, dp=4, sequence_parallel=False, dp_crosses_hosts=True, **KW)
    assert mesh_dp_seconds(c, [s1], 4, True) == s1.dp_seconds
    assert mesh_dp_seconds(c, [s1, s1], 4, True) == pytest.approx(2 * s1.dp_seconds - 2 * 3 * 1e-3)
    two = 2 * a.params  # past one bucket together: one latency more
    assert mesh_dp_seconds(c, [b, b], 4, True) == pytest.approx(
        2 * b.dp_seconds + (-(-4 * two // GRAD_BUCKET_BYTES) - 2 * buckets) * 2 * 3 * 1e-3)


def _mesh(rows: list[list[int]], per_host: int) -> Mesh:
    return Mesh(rows, {r: r // per_host for row in rows for r in row})


def test_transfer_latency_counts_the_plans_messages_and_their_links() -> None:
    c = ClusterSpec(4, 2, intra_latency_s=1e-4, nic_latency_s=1e-3, collective_latency_s=0.0, action_overhead_s=0.0)
    spec = ShardingSpec.parse("R,S0,R")
    shape = (16, 2, 8)

    def latency(src: Mesh, dst: Mesh, strategy: str) -> float:
        plan = plan_resharding(shape, src, spec, dst, spec, strategy=strategy, scheduler="loadbalance", itemsize=2,
                               time_budget_s=0.05)
        return _message_latency(plan, c)

    # one rank to one rank: a single message, intra-host or across hosts
    assert latency(_mesh([[0]], 2), _mesh([[1]], 2), "sendrecv") == pytest.approx(1e-4)
    assert latency(_mesh([[0]], 2), _mesh([[2]], 2), "sendrecv") == pytest.approx(1e-3)
    # more receivers: more messages leave the sender, each across the NIC
    one_rank = latency(_mesh([[0]], 2), _mesh([[2]], 2), "sendrecv")
    two_hosts = latency(_mesh([[0]], 2), _mesh([[2, 4]], 2), "sendrecv")
    assert two_hosts == pytest.approx(2e-3) and two_hosts > one_rank
    # broadcast through both ranks of a host: one NIC message to its head, one intra-host forward
    assert latency(_mesh([[0]], 2), _mesh([[2, 3]], 2), "broadcast") >= 1e-3 + 1e-4 - 1e-12
    # a dp-split tensor (two slices) to one rank: that rank receives two messages
    assert latency(_mesh([[0], [1]], 2), _mesh([[2]], 2), "sendrecv") == pytest.approx(2e-3)


def test_more_microbatches_pay_more_fixed_costs() -> None:
    lat = ClusterSpec(4, 2, nic_gbps=0.2, intra_gbps=10, intra_latency_s=2e-4, nic_latency_s=1e-3,
                      collective_latency_s=5e-4, action_overhead_s=2e-3)
    free = dataclasses.replace(lat, **ZERO)
    kw = dict(micro_batches=(1, 4), zero_stages=(0,), recompute_options=(False,), schedules=["1f1b"],
              strategies=["sendrecv"], stage_meshes=False, top_shapes=50, keep=None)
    got, sync = {}, {}
    for name, cl in (("lat", lat), ("free", free)):
        for c in plan_layouts(SMALL, cl, 8, **kw):
            if (c.tp, c.pp, c.dp, c.sequence_parallel, c.delay_wgrad) == (2, 4, 1, False, False) and \
                    c.layers_per_stage is None and c.breakdown:
                got[name, c.micro_batch] = c.step_s
                sync[name, c.micro_batch] = c.breakdown["step-end all-reduces (loss, norm, checks)"]
    # the step's closing all-reduces cost the same whatever the micro batch; the rest grows with the microbatches
    assert sync["lat", 1] == sync["lat", 4] > 0 and sync["free", 1] == 0
    extra = {b: got["lat", b] - got["free", b] - sync["lat", b] for b in (1, 4)}
    assert extra[4] > 0 and extra[1] > 2 * extra[4]  # 8 microbatches against 2: several times the fixed costs
    # here the fixed costs turn the order: micro batch 1 wins on bandwidth alone, micro batch 4 with latencies
    assert got["free", 1] < got["free", 4] and got["lat", 1] > got["lat", 4]


def test_the_cluster_file_round_trips_the_latencies_and_old_files_keep_the_defaults(tmp_path) -> None:
    c = ClusterSpec(2, 4, intra_latency_s=3e-5, nic_latency_s=4e-4, collective_latency_s=6e-4, action_overhead_s=7e-4,
                    send_post_s=9e-4)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cluster_to_json(c)))
    assert load_cluster(str(path)) == c
    path.write_text(json.dumps({"format": CLUSTER_FORMAT, "hosts": 2, "devices_per_host": 4}))
    assert load_cluster(str(path)) == ClusterSpec(2, 4)
    path.write_text(json.dumps({"format": CLUSTER_FORMAT, "hosts": 2, "devices_per_host": 4, "nic_latency_s": -1}))
    with pytest.raises(ValueError, match="nic_latency_s = -1 is not a positive number"):
        load_cluster(str(path))


def test_a_dp_ring_loads_a_nic_once_per_edge_that_leaves_the_host() -> None:
    from megareshard.parallel import Topology
    from megareshard.planner.search import _dp_ring_cross

    # dp 8 in rank order on 4 hosts of 2: the ring leaves each host once (not once per rank of the host)
    topo = Topology(8, tp=1, pp=1, nproc_per_node=2, order=("tp", "dp", "pp"))
    assert _dp_ring_cross(topo, [(1, 8)], 2) == [(True, 1)]
    # tp 2 × dp 4 on 2 hosts of 4: two rings (one per tp rank), each leaving each host once
    topo = Topology(8, tp=2, pp=1, nproc_per_node=4, order=("tp", "dp", "pp"))
    assert _dp_ring_cross(topo, [(2, 4)], 4) == [(True, 2)]
    # dp inside a host: no NIC
    topo = Topology(8, tp=1, pp=4, nproc_per_node=2, order=("tp", "dp", "pp"))
    assert _dp_ring_cross(topo, [(1, 2)] * 4, 2) == [(False, 0)] * 4
    # and the stage's NIC bytes follow: the ring's 2·(dp−1)/dp of the gradients, times the edges
    c = ClusterSpec(4, 2, **ZERO)
    kw = KW | {"dp_crosses_hosts": True}
    one = stage_costs(SMALL, c, tp=1, dp=8, sequence_parallel=False, **kw | {"dp_ring_edges_per_nic": 1})
    two = stage_costs(SMALL, c, tp=1, dp=8, sequence_parallel=False, **kw | {"dp_ring_edges_per_nic": 2})
    assert one.dp_nic_bytes == int(2 * 7 / 8 * 4 * one.params) and two.dp_nic_bytes == 2 * one.dp_nic_bytes


def test_every_step_ends_with_the_trainers_small_all_reduces() -> None:
    """tp 1, pp 4, dp 2 on 4 hosts × 2 (dp inside a host): the loss over the pipeline group (4 ranks on 4 hosts),
    the norm over the model-parallel group (the same 4), the non-finite check over all 8 (two hosts' NICs), the
    loss's dp mean over 2 ranks of one host."""
    from megareshard.parallel import Topology
    from megareshard.planner.search import _Shape, step_sync_s

    c = ClusterSpec(4, 2, intra_latency_s=1e-3, nic_latency_s=1e-2, collective_latency_s=0.1, action_overhead_s=0.0)
    topo = Topology(8, tp=1, pp=4, nproc_per_node=2, order="tp-dp-pp")
    sh = _Shape(1, 4, 2, 1, 4, False, False, 0, topo, [], (1, 1, 1, 1))
    pp4 = 0.1 + 2 * 3 * 1e-2
    assert step_sync_s(c, sh) == pytest.approx((0.1 + 2 * 7 * 1e-2) + 2 * pp4 + (0.1 + 2 * 1e-3))
    # pp inside the order's first places: a pipeline group (ranks 0-3) still spans two hosts, and the dp mean
    # (ranks 0 and 4) now crosses a NIC
    across = _Shape(1, 4, 2, 1, 4, False, False, 0, Topology(8, tp=1, pp=4, nproc_per_node=2, order="tp-pp-dp"),
                    [], (1, 1, 1, 1))
    assert step_sync_s(c, across) - step_sync_s(c, sh) == pytest.approx(2 * (1e-2 - 1e-3))
    # per-stage meshes: the loss and the norm go over the world too (no one-rank-per-stage groups)
    per_stage = _Shape(1, 2, 4, 1, 2, False, False, 0, None, [], (2, 2), layouts=((2, 2), (1, 4)))
    assert step_sync_s(c, per_stage) == pytest.approx(3 * (0.1 + 2 * 7 * 1e-2))
    # one process: nothing to agree on
    alone = ClusterSpec(1, 1, collective_latency_s=0.1)
    assert step_sync_s(alone, _Shape(1, 1, 1, 1, 4, False, False, 0, Topology(1), [], (4,))) == 0.0


def test_reductions_across_hosts_run_at_the_measured_share_of_the_nic() -> None:
    c = ClusterSpec(4, 2, nic_gbps=1.0, **ZERO)
    slow = dataclasses.replace(c, ring_efficiency=0.8)
    for dp, eff in ((4, 0.8), (2, 0.8)):  # two ranks too: exchanges beside each other share the network
        kw = KW | {"dp_ring_edges_per_nic": 1}
        a = stage_costs(SMALL, c, tp=1, dp=dp, sequence_parallel=False, dp_crosses_hosts=True, **kw)
        b = stage_costs(SMALL, slow, tp=1, dp=dp, sequence_parallel=False, dp_crosses_hosts=True, **kw)
        assert b.dp_seconds == pytest.approx(a.dp_seconds / eff) and a.dp_nic_bytes == b.dp_nic_bytes
    inside = stage_costs(SMALL, slow, tp=1, dp=4, sequence_parallel=False, dp_crosses_hosts=False, **KW)
    assert inside.dp_seconds == stage_costs(SMALL, c, tp=1, dp=4, sequence_parallel=False, dp_crosses_hosts=False,
                                            **KW).dp_seconds  # a ring inside a host never touches a NIC


def test_posting_sends_and_receives_costs_pipelined_layouts_only() -> None:
    """`send_post_s` / `recv_post_s` reach the simulator as each SEND / RECV holding its program: the search's
    pipeline is the simulator's with those posts, and a layout without a pipeline pays nothing."""
    f, b, e = (1.0, 1.2), (2.0, 2.4), 0.1
    got, _ = _pipeline("1f1b", False, 2, 6, f, b, e, {}, 1, 0.0, None, (0.3, 0.2))
    want = simulate(generate("1f1b", 2, 6), costs=Costs(f=list(f), b=list(b), comm=e, send_post=0.3,
                                                          recv_post=0.2)).makespan
    assert got == pytest.approx(want, rel=1e-12) and got > _pipeline("1f1b", False, 2, 6, f, b, e, {})[0]
    free = ClusterSpec(4, 2, nic_gbps=0.2, intra_gbps=10, **ZERO)
    posting = dataclasses.replace(free, send_post_s=2e-3, recv_post_s=1e-3)
    kw = dict(micro_batches=(1, 2), zero_stages=(0,), recompute_options=(False,), schedules=["1f1b"],
              strategies=["sendrecv"], stage_meshes=False, top_shapes=50, keep=None)
    step = {name: {(c.tp, c.pp, c.dp, c.micro_batch, c.delay_wgrad): c.step_s
                   for c in plan_layouts(SMALL, cl, 8, **kw) if c.layers_per_stage is None and c.breakdown}
            for name, cl in (("free", free), ("posting", posting))}
    assert step["free"].keys() == step["posting"].keys()
    piped = [k for k in step["free"] if k[1] > 1]
    assert piped and all(step["posting"][k] > step["free"][k] for k in piped)
    # in these 1f1b pipelines the posts are far from hidden: at least half of one mesh's (a send and a receive
    # per microbatch)
    for k in piped:
        m = 8 // (k[2] * k[3])
        assert step["posting"][k] - step["free"][k] >= m * (2e-3 + 1e-3) / 2 - 1e-12, k
    assert all(step["posting"][k] == step["free"][k] for k in step["free"] if k[1] == 1)
