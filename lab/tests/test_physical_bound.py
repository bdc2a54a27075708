"""The physical bound (lab/bench/physical_bound.py) on cases computed by hand, the void rule against it, and the
grid's operating points (lab/bench/grid_points.py). Pure: no processes."""
from __future__ import annotations

import pytest

from megareshard.pipeline import Costs, generate
from lab.bench.grid_points import classify, parse_points
from lab.bench.physical_bound import critical_path_ms, fill, nic_ms, physical_bound, wire_ms

GBPS = 1.0  # 1 Gbit/s: 125 000 bytes per ms
HALF_MS = 62_500  # bytes that take 0.5 ms


def test_two_stages_without_transfers_is_1f1bs_own_makespan():
    # F 1, B 2 on both stages, 2 microbatches: stage 1 starts after stage 0's F (1), computes 2 x 3, and its last
    # gradient still has to pass stage 0's B (2): 1 + 6 + 2 = 9 — what 1F1B takes here (0-1 F0, ... 7-9 B1 on stage 0)
    sched = generate("1f1b", 2, 2)
    pb = physical_bound(sched, Costs(f=1.0, b=2.0), {}, {}, 2, GBPS, burst_bytes=0)
    assert (pb.compute_ms, pb.nic_ms, pb.critical_path_ms) == (6.0, 0.0, 9.0)
    assert pb.bound_ms == 9.0 and pb.binding == "critical path" and pb.free_transfers_ms == 9.0


def test_transfers_lengthen_fill_and_drain_and_load_the_nics():
    sched = generate("1f1b", 2, 2)
    wire = {"0->1": HALF_MS}  # 0.5 ms each way
    side = {"h0 out": HALF_MS, "h1 in": HALF_MS, "h1 out": HALF_MS, "h0 in": HALF_MS}  # one microbatch
    pb = physical_bound(sched, Costs(f=1.0, b=2.0), wire, side, 2, GBPS, burst_bytes=0)
    # head 1 + 0.5, then 2 x (1 + 2), then back: 0.5 + stage 0's B 2 -> 10; NIC: 2 x 62 500 bytes = 1 ms
    assert pb.critical_path_ms == 10.0 and pb.nic_ms == 1.0 and pb.bound_ms == 10.0
    # one microbatch's round trip alone: 1 + 1 + 2 + 2 + 2 x 0.5 = 7
    assert critical_path_ms(generate("1f1b", 2, 1), Costs(f=1.0, b=2.0), {"0->1": 0.5}, 1) == 7.0


def test_delayed_weight_gradients_leave_the_drain_early():
    # I 1 and W 1 (B 2): stage 1's last I ends after head 1.5 + 2 x (F + I) = 5.5; then the gradient (0.5),
    # stage 0's I (1) and its last W (1): 8. All of stage 1's compute after its head: 1.5 + 6 = 7.5
    sched = generate("1f1b", 2, 2, delay_wgrad=True)
    pb = physical_bound(sched, Costs(f=1.0, b=2.0, i=1.0, w=1.0), {"0->1": HALF_MS}, {}, 2, GBPS, burst_bytes=0)
    assert pb.critical_path_ms == 8.0 and pb.compute_ms == 6.0


def test_nic_term_counts_the_token_buckets_burst_once():
    # 8 microbatches of 1 MB out of one host at 10 Mbit/s, the emulator's 32 000-byte burst: (8 MB - 32 kB) / rate
    ms, side = nic_ms({"h1 out": 1_000_000, "h0 in": 10}, 8, 0.01, burst_bytes=32_000)
    assert side == "h1 out" and ms == pytest.approx((8_000_000 - 32_000) * 8 / 1e7 * 1e3)
    assert wire_ms(10_000, 0.01, burst_bytes=32_000) == 0.0  # a transfer within the burst passes at once
    assert wire_ms(HALF_MS, GBPS, burst_bytes=0) == 0.5


def test_virtual_stages_share_their_mesh_and_local_edges_are_free():
    # zbv on 2 meshes: stages 0 and 3 on mesh 0, 1 and 2 on mesh 1; 1->2 is a local hand-off
    sched = generate("zbv", 2, 2)
    pb = physical_bound(sched, Costs(f=1.0, b=2.0, i=1.0, w=1.0), {"0->1": HALF_MS, "1->2": HALF_MS,
                                                                   "2->3": HALF_MS}, {}, 2, GBPS, burst_bytes=0)
    assert pb.compute_ms == 12.0  # 2 stages x 2 microbatches x (F + I + W)
    # round trip: 4 F + 4 I + mesh hops 0->1 and 2->3 each way (1->2 local) + stage 0's W = 4 + 4 + 2 + 1 = 11;
    # mesh 1 starts after stage 0's F and its transfer: 1.5 + 12 = 13.5
    assert pb.critical_path_ms == 13.5


def test_void_and_fractions_against_the_physical_bound():
    recs = [{"config": "1f1b+allgather", "strategy": "allgather", "ms_per_iter": 200.0, "physical": {"bound_ms": 150.0}},
            {"config": "eager-1f1b+broadcast+dw", "strategy": "broadcast", "ms_per_iter": 160.0,
             "physical": {"bound_ms": 120.0}},
            {"config": "1f1b+sendrecv", "strategy": "sendrecv", "ms_per_iter": 150.0, "physical": {"bound_ms": 180.0}},
            {"config": "1f1b+signal", "strategy": "signal", "ms_per_iter": 100.0, "physical": {"bound_ms": 100.0}}]
    fill(recs, "1f1b+allgather")
    base, meth, fast, sig = recs
    assert base["physical_fraction"] == 0.75 and base["physical_gap_closure"] is None and not base["physical_void"]
    assert meth["physical_fraction"] == 0.75 and meth["physical_gap_closure"] == pytest.approx(40 / 80)
    assert fast["physical_void"]  # faster than its physical bound: no correct measurement can be
    assert sig["physical_fraction"] is None and not sig["physical_void"]


def test_operating_points():
    pts = parse_points("10,20:m=16,40:seq=512:tp=2")
    assert [(p["rate_mbit"], p["overrides"]) for p in pts] == [
        (10, {}), (20, {"microbatches": 16}), (40, {"seq_length": 512, "tp": 2})]
    assert [p["label"] for p in pts] == ["10", "20 m 16", "40 seq 512 tp 2"]
    for bad in ("", "x", "10:q=3", "0", "10,10", "10:m=0"):
        with pytest.raises(ValueError, match="--points"):
            parse_points(bad)
    rec = {"physical_fraction": 0.7, "physical": {"bound_ms": 100.0, "free_transfers_ms": 50.0}}
    assert classify(rec) == "comm"
    assert classify({"physical_fraction": 0.98, "physical": {"bound_ms": 100.0, "free_transfers_ms": 97.0}}) == "compute"
    assert classify({"physical_fraction": 0.95, "physical": {"bound_ms": 100.0, "free_transfers_ms": 60.0}}) == "between"


def test_peers_verdict_says_when_the_target_is_physically_out_of_reach():
    from lab.bench import peers_report as rep

    def rec(name, fw, strategy, ms, bound):
        return {"name": name, "framework": fw, "status": "ok", "strategy": strategy, "ms_per_iter": ms,
                "signal_name": None, "physical": {"bound_ms": bound, "binding": "NIC (h1 in)"}}

    # torch at 788 ms; our best 884 ms; the baseline at 884 of a 629 ms bound (comm matters), our least bound 629
    recs = [rec("1f1b+allgather", "megareshard", "allgather", 884.0, 629.0), rec("torch Schedule1F1B", "torch", "p2p",
                                                                                  788.0, 629.0)]
    sm = rep.fill_ratios(recs, None)
    assert sm["baseline_physical_fraction"] == pytest.approx(629 / 884) and sm["physical_best_ratio"] == pytest.approx(
        788 / 629)
    v = rep.verdict(sm)
    assert v.startswith("not met (need >= 1.2x)") and "physically out of reach" not in v  # 788/629 = 1.25: reachable
    recs[1]["ms_per_iter"] = 700.0
    v = rep.verdict(rep.fill_ratios(recs, None))
    assert "physically out of reach: megareshard's physical bound (629 ms, 1f1b+allgather) is only 1.11x" in v
    recs[1]["ms_per_iter"] = 600.0  # faster than its own physical bound: void, never torch's best
    sm = rep.fill_ratios(recs, None)
    assert recs[1]["void"] and sm["torch_best"] is None


def test_refill_is_one_burst_at_the_rate_with_a_margin():
    from lab.bench.physical_bound import TBF_BURST_BYTES, refill_s

    # 256 KiB at 10 Mbit/s: 0.2097 s of line time; a tenth more so the bucket is surely full
    assert refill_s(0.01) == pytest.approx(1.1 * TBF_BURST_BYTES * 8 / 1e7)
    assert 0.23 < refill_s(0.01) < 0.231
    assert refill_s(1.0) == pytest.approx(refill_s(0.01) / 100)
