"""The planner's new search dimensions (pure): uneven layer splits, per-stage meshes, virtual-stage and
zero-bubble schedules, and the activation bounds that prune them before simulation."""
from __future__ import annotations

import itertools
import random

import pytest

from megareshard.arguments import parse_args
from megareshard.pipeline import generate, simulate
from megareshard.pipeline.schedules import get_schedule, schedule_names
from megareshard.planner import ClusterSpec, ModelShape, plan_layouts
from megareshard.planner.variants import balanced_split, live_bound, stage_layout_variants, virtual_options

# the output layer of a large vocabulary weighs several layers: the last stage is the heavy one
BIG_VOCAB = ModelShape(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=512, vocab_size=65536)


def _brute(L: int, extra: list[float], c: float) -> float:
    P = len(extra)
    best = float("inf")
    for cut in itertools.combinations(range(1, L), P - 1):
        split = [b - a for a, b in zip((0,) + cut, cut + (L,))]
        best = min(best, max(n * c + e for n, e in zip(split, extra)))
    return best


def test_balanced_split_is_optimal() -> None:
    rng = random.Random(3)
    for _ in range(40):
        P, L = rng.randint(1, 4), rng.randint(4, 10)
        if P > L:
            continue
        extra = [round(rng.uniform(0, 3), 2) for _ in range(P)]
        split = balanced_split(L, P, 1.0, extra)
        assert len(split) == P and sum(split) == L and min(split) >= 1
        assert max(n + e for n, e in zip(split, extra)) == pytest.approx(_brute(L, extra, 1.0)), (L, extra, split)
    with pytest.raises(ValueError, match="pp 5 <= layers 4"):
        balanced_split(4, 5, 1.0, [0] * 5)


def test_stage_layout_variants() -> None:
    got = stage_layout_variants(2, 3, 4, [1, 2, 4])
    assert ((2, 2), (2, 2), (2, 2)) not in got  # the uniform layout is not a variant
    assert ((1, 4), (2, 2), (4, 1)) in got and ((4, 1), (2, 2), (2, 2)) in got
    assert all(mid == (2, 2) and t * d == 4 for lay in got for mid in lay[1:-1] for t, d in lay)
    assert len(got) == 8
    assert stage_layout_variants(2, 1, 4, [1, 2, 4]) == []


def test_virtual_options() -> None:
    assert virtual_options("interleaved-1f1b", 2, 8, 4) == [2, 4]
    assert virtual_options("interleaved-1f1b", 2, 8, 3) == []  # microbatches not a multiple of pp
    assert virtual_options("zbv", 2, 8, 3) == [2] and virtual_options("zbv", 2, 6, 4) == []
    assert virtual_options("zb-h1", 4, 8, 5) == [1] and virtual_options("1f1b", 1, 8, 5) == [1]
    assert virtual_options("zbv", 1, 8, 5) == []


@pytest.mark.parametrize("name", schedule_names())
def test_live_bound_covers_the_simulated_peak(name) -> None:
    """The pre-simulation memory bound must not be below what the schedule really keeps live (else pruning
    would let a layout through that does not fit)."""
    for P in (2, 3, 4):
        for m in (P, 2 * P, 2 * P + 1):
            for v in virtual_options(name, P, 4 * P, m):
                for dw in ((True,) if get_schedule(name).zero_bubble else (False, True)):
                    sched = generate(name, P, m, dw, virtual_stages=v if get_schedule(name).stages_per_mesh is None
                                     else None)
                    peak = simulate(sched, costs={"f": 1.0, "b": 2.0, "comm": 0.3}).peak_activations
                    bound = live_bound(name, dw, P, m, v)
                    assert all(b >= p for b, p in zip(bound, peak)), (name, P, m, v, dw, bound, peak)


SMALL = ClusterSpec(hosts=2, devices_per_host=2, nic_gbps=100)
MBS = (1, 2)


@pytest.fixture(scope="module")
def full():
    return plan_layouts(BIG_VOCAB, SMALL, 16, micro_batches=MBS, zero_stages=(0,))


def test_search_has_the_new_dimensions_and_they_only_help(full) -> None:
    c = SMALL
    plain = plan_layouts(BIG_VOCAB, c, 16, micro_batches=MBS, zero_stages=(0,), uneven_splits=False,
                         stage_meshes=False, schedules=[n for n in schedule_names() if get_schedule(n).stages_per_mesh == 1])
    assert any(x.layers_per_stage for x in full) and any(x.stage_layouts for x in full)
    assert any(x.virtual_stages > 1 for x in full) and not any(x.virtual_stages > 1 for x in plain)
    assert not any(x.layers_per_stage or x.stage_layouts for x in plain)
    # a superset of layouts, the same scoring: the best can only get faster
    assert full[0].step_s <= plain[0].step_s * (1 + 1e-9)
    # the heavy last stage gets fewer layers in the balanced split
    split = next(x.layers_per_stage for x in full if x.layers_per_stage and x.pp == 2)
    assert split[-1] < split[0]
    # the runtime executes every registered schedule: every candidate runs
    assert all(x.runtime for x in full) and {x.schedule for x in full} == set(schedule_names())


def test_new_dimensions_prune_by_memory_and_their_flags_parse(full) -> None:
    # a device between the smallest and the largest footprint: some layouts go, every one kept fits
    need = sorted(max(x.memory_gib) for x in full)
    c = ClusterSpec(hosts=2, devices_per_host=2, nic_gbps=100,
                    device_memory_gib=(need[0] + need[-1]) / 2 / (1 - SMALL.memory_reserve))
    stats: dict[str, int] = {}
    ranked = plan_layouts(BIG_VOCAB, c, 16, micro_batches=MBS, zero_stages=(0,), stats=stats)
    assert stats["pruned_memory"] > 0 and all(max(x.memory_gib) <= c.memory_bytes / 2**30 for x in ranked)
    model = ["--mock-data", "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
             "--seq-length", "512", "--vocab-size", "65536", "--global-batch-size", "16", "--train-iters", "5",
             "--lr", "1e-4"]
    for pick in (lambda x: x.stage_layouts, lambda x: x.layers_per_stage):
        cand = next(x for x in full if pick(x) and x.runtime)
        cfg = parse_args(model + cand.flags(8).split(), world_size=4)
        assert cfg.pp == cand.pp and cfg.training.micro_batch_size == cand.micro_batch
        if cand.stage_layouts:
            assert cfg.parallel.stage_layouts == cand.stage_layouts
        if cand.layers_per_stage:
            assert cfg.pipeline.num_layers_per_stage == ",".join(map(str, cand.layers_per_stage))


def test_boundaries_that_cross_hosts_cost_more_than_those_inside_one() -> None:
    """2 hosts × 2 devices, pp 4: stages 0-1 share a host and 2-3 the other, so only boundary 1 -> 2 crosses
    a NIC (a layout that is uniform in tp and dp, not in where its boundaries run)."""
    from megareshard.planner.search import _edge_seconds, _shapes

    model = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=2048, vocab_size=256)
    c = ClusterSpec(hosts=2, devices_per_host=2, nic_gbps=1, intra_gbps=100)
    sh = next(s for s in _shapes(model, c, 8, (1,), (0,), (False,), False) if (s.tp, s.pp) == (1, 4))
    edges, _, _ = _edge_seconds(model, c, sh, "broadcast", {})
    assert set(edges) == {"0->1", "1->2", "2->3"}
    assert edges["1->2"] > 10 * edges["0->1"] and edges["0->1"] == edges["2->3"]


def test_no_estimated_layout_ranks_below_a_slower_simulated_one() -> None:
    """NIC-bound (1 Gbit/s, negligible compute): zbv sends two transfers per microbatch where 1F1B sends one;
    the pre-rank must count them, and a shape whose estimate beats the best simulated step gets simulated."""
    import dataclasses

    c = ClusterSpec(hosts=2, devices_per_host=2, nic_gbps=1)
    # untied: tied, zbv's V (both ends on one mesh) would also skip 1F1B's embedding all-reduce across the NIC
    untied = dataclasses.replace(BIG_VOCAB, untied=True)
    ranked = plan_layouts(untied, c, 16, micro_batches=(1,), zero_stages=(0,), recompute_options=(False,))
    assert ranked[0].breakdown and ranked[0].step_s <= min(x.step_s for x in ranked) * (1 + 1e-9)
    zbv = [x.step_s for x in ranked if x.schedule == "zbv"]
    one = [x.step_s for x in ranked if x.schedule == "1f1b" and x.pp == 2]
    assert zbv and one and min(zbv) > 1.5 * min(one)  # twice the transfers on the critical NIC


def test_the_calibrated_optimizer_step_is_added_per_updated_parameter() -> None:
    import dataclasses

    from megareshard.planner.costs import stage_costs

    c = dataclasses.replace(SMALL, optimizer_s_per_param=1e-9)
    kw = dict(layers=2, first=True, last=True, tp=1, dp=4, micro_batch=1, sequence_parallel=False, recompute=False,
              dp_crosses_hosts=True, dp_ring_edges_per_nic=2)
    z0, z1 = stage_costs(BIG_VOCAB, c, zero=0, **kw), stage_costs(BIG_VOCAB, c, zero=1, **kw)
    assert z0.optimizer_s == pytest.approx(z0.params * 1e-9) and z1.optimizer_s == pytest.approx(z0.params / 4 * 1e-9)
    assert stage_costs(BIG_VOCAB, SMALL, zero=0, **kw).optimizer_s == 0.0
    # the passes over the gradients (check, packing, norm) see every local gradient, under ZeRO too
    g = dataclasses.replace(c, grad_pass_s_per_param=3e-9)
    g0, g1 = stage_costs(BIG_VOCAB, g, zero=0, **kw), stage_costs(BIG_VOCAB, g, zero=1, **kw)
    assert g0.optimizer_s == pytest.approx(z0.params * 4e-9) and g1.optimizer_s == pytest.approx(
        z0.params * (1e-9 / 4 + 3e-9))
    one = dict(micro_batches=(1,), zero_stages=(0,), recompute_options=(False,), stage_meshes=False,
               uneven_splits=False, schedules=["1f1b"], strategies=["broadcast"], top_shapes=10**6)  # all simulated
    plain = {x.name: x for x in plan_layouts(BIG_VOCAB, SMALL, 16, **one) if x.breakdown and x.pp == 1}
    timed = {x.name: x for x in plan_layouts(BIG_VOCAB, c, 16, **one) if x.breakdown and x.pp == 1}
    both = timed.keys() & plain.keys()  # (the optimizer term may reorder the tail that `keep` cuts)
    assert len(both) >= 2
    for name in sorted(both):  # one stage updates every parameter of its tp shard
        x = timed[name]
        params = stage_costs(BIG_VOCAB, c, layers=8, first=True, last=True, tp=x.tp, dp=x.dp, micro_batch=1,
                             sequence_parallel=x.sequence_parallel, recompute=False, zero=0,
                             dp_crosses_hosts=True, dp_ring_edges_per_nic=2).params
        assert x.step_s - plain[name].step_s == pytest.approx(params * 1e-9, rel=1e-6)
        assert x.breakdown["optimizer step"] == pytest.approx(params * 1e-9)


def test_the_tied_embedding_all_reduce_crosses_the_nic_once_per_pair_and_zbv_skips_it() -> None:
    import dataclasses

    from megareshard.planner.search import tied_embedding_s

    c = ClusterSpec(hosts=2, devices_per_host=2, nic_gbps=1, nic_latency_s=1e-4, collective_latency_s=1e-3)
    one = dict(micro_batches=(1,), zero_stages=(0,), recompute_options=(False,), stage_meshes=False,
               uneven_splits=False, strategies=["broadcast"])
    def best(model, schedule):
        return min((x for x in plan_layouts(model, c, 16, schedules=[schedule], **one)
                    if x.tp == 1 and x.pp == 2 and (schedule == "zbv" or not x.delay_wgrad)), key=lambda x: x.step_s)

    untied_model = dataclasses.replace(BIG_VOCAB, untied=True)
    # tp 1 × pp 2 × dp 2: each stage on its own host, 2 pairs leave each host, V·h fp32 each way per pair;
    # the dp reductions (inside the hosts, under a millisecond) wait for it
    expect = 2 * 4 * BIG_VOCAB.vocab_size * BIG_VOCAB.hidden_size / c.nic_Bps + 1e-3 + 2 * 1e-4
    tied, untied = best(BIG_VOCAB, "1f1b"), best(untied_model, "1f1b")
    assert tied.step_s - untied.step_s == pytest.approx(expect, rel=1e-3)
    assert tied.breakdown["dp reduction + tied embedding (exposed)"] > expect
    # zbv's first and last stage share mesh 0: nothing to send; the trainer keeps one Parameter there, so tied, mesh
    # 0 holds (and reduces, and steps) V·h parameters fewer than untied: weight, fp32 gradient and Adam state
    # (2 + 4 + 12 bytes each, bf16 weights) less memory and a shorter step (its dp reduction runs inside the hosts)
    tied_v, untied_v = best(BIG_VOCAB, "zbv"), best(untied_model, "zbv")
    per_param = BIG_VOCAB.dtype_bytes + 4 + 12
    assert untied_v.memory_gib[0] - tied_v.memory_gib[0] == pytest.approx(
        per_param * BIG_VOCAB.vocab_size * BIG_VOCAB.hidden_size / 2**30, abs=0.011)  # memory_gib: 2 decimals
    assert untied_v.memory_gib[1] == tied_v.memory_gib[1]
    assert tied_v.step_s < untied_v.step_s
    sh = type("Sh", (), {})  # the cost function alone: both ends on one mesh, or an untied model, cost nothing
    assert tied_embedding_s(BIG_VOCAB, c, sh, 0, 0, {}) == 0.0
    assert tied_embedding_s(dataclasses.replace(BIG_VOCAB, untied=True), c, sh, 0, 1, {}) == 0.0


def test_per_stage_meshes_reduce_the_tied_embedding_in_one_ring_of_the_full_table() -> None:
    """--stage-layouts: the trainer all-reduces a full [V, h] fp32 buffer over every rank of the first and the
    last stage (`reduce_tied_grad_across_layouts`); the planner charges that ring, not Megatron's pairs."""
    from megareshard.parallel.stage_topology import StageTopology
    from megareshard.planner.search import _Shape, tied_embedding_s

    c = ClusterSpec(hosts=4, devices_per_host=2, nic_gbps=1, nic_latency_s=0.0, collective_latency_s=0.0,
                    intra_latency_s=0.0)
    lay = ((2, 1), (1, 2), (1, 2), (2, 1))  # first and last stage: tp 2 on hosts 0 and 3
    sh = _Shape(2, 4, 2, 1, 4, False, False, 0, StageTopology(8, lay, nproc_per_node=2), [], (2, 2, 2, 2), lay)
    full = 4 * BIG_VOCAB.vocab_size * BIG_VOCAB.hidden_size
    # ring 0 → 1 → 6 → 7 → 0 over 4 ranks: each edge carries 2·3/4 of the table; one edge leaves host 0
    assert tied_embedding_s(BIG_VOCAB, c, sh, 0, 3, {}) == pytest.approx(1.5 * full / c.nic_Bps)


def test_layers_that_pp_does_not_divide_still_pipeline() -> None:
    """5 layers on 4 hosts × 1: pp 2 and pp 4 take uneven splits (3,2 / 2,1,1,1) under every one-stage-per-mesh
    schedule; zbv (two stages per mesh, an even split) cannot run them. Before session 8 the schedules of one
    stage per mesh required pp to divide the layers, so such a model had no pipelined layout at all."""
    five = ModelShape(num_layers=5, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256)
    ranked = plan_layouts(five, ClusterSpec(hosts=4, devices_per_host=1), 8, micro_batches=(1,), zero_stages=(0,),
                          recompute_options=(False,), keep=None)
    by_pp = {p: {c.schedule for c in ranked if c.pp == p} for p in (2, 4)}
    one_per_mesh = {n for n in schedule_names() if get_schedule(n).stages_per_mesh == 1}
    assert by_pp[2] == by_pp[4] == one_per_mesh, by_pp
    assert {tuple(c.layers_per_stage) for c in ranked if c.pp == 4} == {(2, 1, 1, 1)}
    assert virtual_options("zbv", 2, 5, 8) == [] and virtual_options("1f1b", 2, 5, 8) == [1]
