"""Calibration: measured on 2 local gloo ranks, the numbers are positive and sane, the JSON round-trips and
the planner (tools/plan_layout.py and --auto-layout) accepts it. What the lab adds for its emulated cluster (the
shared cores, the sleep overshoot, the paced probe) is tested in lab/tests/test_calibrate_emulated.py."""
from __future__ import annotations

import json

import pytest

from megareshard.arguments import ConfigError, parse_args
from megareshard.planner import ClusterSpec, ModelShape, plan_layouts
from megareshard.planner.calibration import (CLUSTER_FORMAT, calibrate, cluster_to_json, fit_fixed_and_scaling,
                                            load_cluster)
from tests.harness import run_ranks

MODEL = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)


def _calibrate(rank: int, world: int):
    cluster, measured = calibrate(MODEL, 2, devices_per_host=world, device_memory_gib=1.0, iters=2,
                                  target_s=0.05)
    return cluster, measured


def test_two_local_ranks_measure_sane_numbers_the_planner_accepts(tmp_path) -> None:
    (cluster, measured), _ = run_ranks(_calibrate, 2, timeout=90)
    assert (cluster.hosts, cluster.devices_per_host) == (1, 2)
    # a CPU core: between 10 MFLOP/s and 10 TFLOP/s; a layer never beats its own matmul rate by much
    assert 1e-5 < cluster.device_tflops < 10 and 0 < cluster.efficiency <= 1
    assert cluster.device_tflops * cluster.efficiency * 1e12 == pytest.approx(measured["layer"]["achieved_flops"])
    assert 0.5 < cluster.backward_factor < 20
    # an Adam step touches ~16 bytes per parameter: between 0.01 ns and 10 µs per parameter on any CPU
    # the trainer's own optimizer over ≥ 1 Mi parameters shaped as layers: the step and the gradient passes
    opt = measured["optimizer"]
    assert 1e-11 < cluster.optimizer_s_per_param < 1e-5 and opt["params"] >= 1 << 20
    assert 1e-11 < cluster.grad_pass_s_per_param < 1e-5 and cluster.grad_pass_s_per_param == opt["grad_pass_s_per_param"]
    lay = measured["layer"]
    assert lay["forward_s"] > 0 and lay["backward_s"] > 0
    assert lay["forward_cpu_s"] > 0 and lay["backward_cpu_s"] > 0
    load = measured["load"]["load"]
    # the window every rank computes through: two ranks on any machine run at most a few times their CPU time
    assert measured["load"]["window_s"] >= 0.3 and measured["load"]["matmuls"] > 0 and 0.5 < load < 50
    assert measured["matmul"]["seconds"] == pytest.approx(measured["matmul"]["cpu_seconds"] * load)
    assert lay["under_load_forward_s"] == pytest.approx(lay["forward_cpu_s"] * load)
    # the layer at twice and four times the micro batch: a line through the three splits its forward into a
    # fixed part and a part that scales
    fit = fit_fixed_and_scaling([(1, lay["forward_cpu_s"]), (2, lay["double_micro_batch"]["forward_cpu_s"]),
                                 (4, lay["quadruple_micro_batch"]["forward_cpu_s"])])
    assert (lay["fixed_forward_cpu_s"], lay["scaling_forward_cpu_s"]) == fit
    assert lay["fixed_forward_cpu_s"] >= 0 and lay["scaling_forward_cpu_s"] > 0
    assert lay["achieved_flops"] == pytest.approx(lay["flops"] / (lay["scaling_forward_cpu_s"] * load))
    assert cluster.layer_overhead_s == pytest.approx(lay["fixed_forward_cpu_s"] * load)
    assert cluster.backward_factor == pytest.approx(lay["backward_cpu_s"] / lay["forward_cpu_s"])
    # the backward run split as delayed weight gradients run it: W's share of I + W
    assert lay["input_grad_cpu_s"] > 0 and lay["weight_grad_cpu_s"] > 0
    assert 0 < cluster.wgrad_fraction < 1 and cluster.wgrad_fraction == pytest.approx(
        lay["weight_grad_cpu_s"] / (lay["input_grad_cpu_s"] + lay["weight_grad_cpu_s"]))
    # loopback between two processes: faster than 10 Mbit/s, slower than 10 Tbit/s
    assert 0.01 < cluster.intra_gbps < 10_000 and measured["intra"]["bytes"] >= 256 << 10
    # one host: no NIC to measure, the defaults said so
    assert measured["not_measured"] == ["nic_gbps", "nic_latency_s"]
    # loopback latencies: a one-element message or all-reduce between 0.1 µs and 1 s; an autograd step likewise
    assert 1e-7 < measured["intra_latency"]["seconds"] < 1 and cluster.intra_latency_s == \
        measured["intra_latency"]["seconds"]
    assert 1e-7 < measured["small_allreduce"]["seconds"] < 1 and 0 <= cluster.collective_latency_s < 1
    assert 1e-7 < cluster.action_overhead_s < 1 and cluster.nic_latency_s == ClusterSpec(1, 1).nic_latency_s
    # the tp all-reduce under load: one pair, the bigger of the two fixed costs is the planner's
    loaded = measured["loaded_allreduce"]
    assert loaded["pairs"] == [[0, 1]] and loaded["bytes"] == 32 * 2 * 64 * 4
    assert 0 <= loaded["fixed_s"] <= loaded["seconds"] and loaded["with_allreduce_s"] > 0 and loaded["alone_s"] > 0
    assert cluster.collective_latency_s == max(loaded["fixed_s"], max(0.0, measured["small_allreduce"]["seconds"]
                                                                      - 2 * cluster.intra_latency_s))
    # a real cluster's terms only: what the lab measures on its emulated cluster is not here (it reads the
    # optimizer's CPU time per parameter, recorded raw)
    assert "sleep_overshoot" not in measured and "shared_cpu" not in measured
    assert 1e-12 < opt["cpu_s_per_param"] < 1e-5
    assert (cluster.send_post_s, cluster.recv_post_s) == (0.0, 0.0)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster_to_json(cluster, measured)))
    again = load_cluster(str(path), hosts=2)
    assert again.hosts == 2 and again.device_tflops == cluster.device_tflops
    assert again.action_overhead_s == cluster.action_overhead_s
    ranked = plan_layouts(MODEL, again, 8, micro_batches=(1, 2), zero_stages=(0,), recompute_options=(False,))
    assert ranked and ranked[0].step_s > 0
    # the planner's layer forward is the measured one under load (its efficiency is the layer's rate over the
    # matmul's, in CPU time; the load is the matmul's wall over CPU time):
    # one stage of every layer at micro batch 2, the calibrated one, takes at least the layers' forwards on the
    # line fitted to the three measured ones (not the measured forward itself: a line through three noisy
    # timings can pass below it)
    one = [c for c in ranked if c.pp == 1 and c.tp == 1 and c.micro_batch == 2]
    on_line = (lay["fixed_forward_cpu_s"] + lay["scaling_forward_cpu_s"]) * load
    assert one and one[0].stage_f_s[0] >= MODEL.num_layers * on_line * (1 - 1e-9)
    assert again.layer_overhead_s == cluster.layer_overhead_s
    argv = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
            "4", "--seq-length", "32", "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-3",
            "--auto-layout", "--nproc-per-node", "2", "--auto-layout-cluster", str(path)]
    cfg = parse_args(argv, world_size=4)
    assert f"from measured cluster {path}" in cfg.plan.auto_layout
    with pytest.raises(ConfigError, match="drop --auto-layout-nic-gbps"):
        parse_args(argv + ["--auto-layout-nic-gbps", "1"], world_size=4)


def test_bad_cluster_files_are_named(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match=f"bad.json: expected \"format\": \"{CLUSTER_FORMAT}\""):
        load_cluster(str(bad))
    bad.write_text(json.dumps({"format": CLUSTER_FORMAT, "hosts": 1, "devices_per_host": 2, "nic_gbps": -1}))
    with pytest.raises(ValueError, match="nic_gbps = -1 is not a positive number"):
        load_cluster(str(bad))
    with pytest.raises(ValueError, match="missing.json: No such file"):
        load_cluster(str(tmp_path / "missing.json"))


def _calibrate_one_per_host(rank: int, world: int):
    return calibrate(MODEL, 1, devices_per_host=1, device_memory_gib=1.0, iters=1, target_s=0.02)


def test_one_rank_per_host_measures_the_collective_and_the_ring_across_the_nic() -> None:
    (cluster, measured), *_ = run_ranks(_calibrate_one_per_host, 3, timeout=90)
    assert (cluster.hosts, cluster.devices_per_host) == (3, 1)
    # no two ranks share a host: nothing intra-host is measured, the collectives run across the "NIC"
    assert "intra" not in measured and "nic" in measured
    assert measured["small_allreduce"]["ranks"] == [0, 1] and measured["loaded_allreduce"]["pairs"] == [[0, 1]]
    nic_alpha = measured["nic_latency"]["seconds"]
    loaded = measured["loaded_allreduce"]
    assert loaded["fixed_s"] == max(0.0, loaded["seconds"] - 2 * nic_alpha - loaded["bytes"] / measured["nic"]["Bps"])
    small = measured["small_allreduce"]["seconds"] - 2 * nic_alpha
    assert cluster.collective_latency_s == max(loaded["fixed_s"], small, 0.0)
    assert measured["not_measured"] == ["intra_gbps", "intra_latency_s"]
    # more than two hosts: a ring over one rank per host, against the ring model at the measured NIC rate
    ring = measured["ring_allreduce"]
    assert ring["ranks"] == [0, 1, 2]
    assert ring["model_s"] == pytest.approx(4 / 3 * ring["bytes"] / measured["nic"]["Bps"])
    assert 0 < cluster.ring_efficiency <= 1 and cluster.ring_efficiency == min(1.0, ring["model_s"] / ring["seconds"])


def test_the_layer_line_is_fitted_to_every_micro_batch() -> None:
    # a line recovers itself; noise on the middle point moves it less than a two-point difference would
    assert fit_fixed_and_scaling([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0), rel=1e-12)
    fixed, per = fit_fixed_and_scaling([(1, 3.0), (2, 6.0), (4, 9.0)])  # 2 one unit high
    assert per == pytest.approx(2.0 - 1 / 14, rel=1e-12) and fixed == pytest.approx(1.5, rel=1e-12)
    assert fixed + 4 * per < 6.0 + 2 * (6.0 - 3.0)  # the two-point extrapolation to 4: 12
    # a negative intercept: the line through the origin
    fixed, per = fit_fixed_and_scaling([(1, 1.0), (2, 3.0), (4, 7.0)])
    assert fixed == 0.0 and per == pytest.approx((1 + 6 + 28) / 21, rel=1e-12)
    # no growth (or less): the per-unit part is floored, the rest fixed
    fixed, per = fit_fixed_and_scaling([(1, 2.0), (2, 2.0), (4, 1.9)])
    assert per == pytest.approx(2e-3) and fixed == pytest.approx((2.0 + 2.0 + 1.9) / 3 - 2e-3 * 7 / 3)
