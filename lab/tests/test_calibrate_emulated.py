"""The emulated cluster's calibration (`lab.cluster.calibrate_emulated`): what it adds to the product's calibration
(tests/planner/test_calibration.py runs that) — the sleep overshoot, the shared cores, the runtime probe and the
paced contention probe with its trainers — measured for real on 2 local gloo ranks (one kernel: the cores are
shared), from the product's measurements given (a layer of 2 ms under load, so the paced budgets stay small
whatever the machine's load). The fits themselves are tested in test_shared_cpu.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megareshard.planner import ClusterSpec, ModelShape
from megareshard.planner.cluster_file import load_cluster as load_real_cluster
from tests.harness import run_ranks

MODEL = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
CLUSTER = ClusterSpec(1, 2, device_memory_gib=1.0, device_tflops=0.01, intra_gbps=8.0, action_overhead_s=1e-4)
"""What the product's calibration found on one host of 2 ranks (`measured` below holds its raw numbers)."""


def _product_measured() -> dict:
    return {"layer": {"under_load_forward_s": 2e-3, "forward_cpu_s": 4e-4, "input_grad_cpu_s": 4e-4,
                      "weight_grad_cpu_s": 3e-4},
            "action_overhead": {"seconds": 1e-4}, "load": {"load": 2.5}, "optimizer": {"cpu_s_per_param": 3e-9},
            "intra": {"Bps": 1e9}, "intra_latency": {"seconds": 5e-5}, "not_measured": ["nic_gbps"]}


def _calibrate(rank: int, world: int):
    from lab.cluster.calibrate_emulated import measure_emulation, probe_step_cpu
    from lab.cluster.calibration_shared import measure_shared_cpu

    em, measured = measure_emulation(MODEL, 2, CLUSTER, _product_measured(), iters=1, target_s=0.02,
                                     pace_margin=1.25, runtime_step_cpu=probe_step_cpu(world))
    # the same ranks as one rank per host: the pattern across the "NIC" (hosts 0 and 1)
    across = measure_shared_cpu(1, nic_Bps=measured["intra"]["Bps"], intra_Bps=None, target_s=0.03, iters=1)
    return em, measured, across


def test_two_local_ranks_calibrate_the_shared_cores_and_the_paced_probe(tmp_path) -> None:
    results = run_ranks(_calibrate, 2, timeout=120)
    em, measured, across = results[0]
    assert all(r[0] == em for r in results)  # every number is the same on every rank
    cluster, shared = em.cluster, em.shared
    assert shared is not None
    # the product's cluster, but for what posting a send and a receive costs (below)
    assert cluster == dataclasses.replace(CLUSTER, send_post_s=cluster.send_post_s, recv_post_s=cluster.recv_post_s)
    assert {k: measured[k] for k in _product_measured()} == _product_measured()
    # a paced action's closing sleep wakes late by 0..1 s, at the budget of a layer's forward paced 1.25x slower
    sleep = measured["sleep_overshoot"]
    assert 0 <= sleep["seconds"] < 1 and 0 <= sleep["median_s"] < 1 and sleep["reps"] == 40
    assert 0 < sleep["cpu_s"] <= sleep["chunk_s"] and 0 <= sleep["sleeps"] <= 2 * 40  # two ranks
    assert sleep["chunk_s"] == pytest.approx(2e-3 * 1.25) and sleep["cpu_s"] == 4e-4
    # local ranks run on one kernel: the cores they share and the CPU rates of a step
    sh = measured["shared_cpu"]
    load = 2.5
    assert sh["cores"] >= 1 and 0 <= sh["idle_busy_cores"] <= sh["cores"] / 2
    assert shared.cores == pytest.approx(max(0.5, sh["cores"] - sh["idle_busy_cores"]))
    assert shared.compute_cpu_share == pytest.approx(min(1.0, 1.0 / load))
    assert shared.cpu_s_per_param == 3e-9
    assert sh["intra"]["pairs"] == [[0, 1]] and "nic" not in sh  # one host: pairs inside it only
    assert shared.cpu_s_per_intra_byte == sh["intra"]["cpu_s_per_byte"] >= 0 and shared.cpu_s_per_nic_byte == 0.0
    # one rank per host: the pair crosses the "NIC", and nothing is inside a host
    assert across["nic"]["pairs"] == [[0, 1]] and "intra" not in across and across["nic"]["cpu_s_per_byte"] >= 0
    # the runtime probe (one PROBE layer per rank, unpaced, 4 and 20 microbatches) and the paced contention probe
    # (one of the model's layers per rank, 2 × world and 6 × world microbatches)
    rt, ct = sh["runtime"], sh["contention"]
    assert rt["microbatches"] == [4, 20] and ct["microbatches"] == [4, 12] and ct["budget_s"] == sleep["chunk_s"]
    assert (shared.cpu_s_per_action, shared.cpu_s_per_step) == (rt["cpu_s_per_action"], rt["cpu_s_per_step"])
    assert shared.cpu_s_per_action >= 0 and shared.cpu_s_per_step >= 0
    assert shared.cpu_contention == ct["cpu_contention"] >= 0
    assert all(w > 0 for w in rt["step_wall_s"] + ct["step_wall_s"])
    # 12 paced microbatches through two stages take at least their budgets: F, I and W each per microbatch
    assert ct["step_wall_s"][1] >= 12 * 3 * ct["budget_s"]
    # what posting a send and a receive held a rank's program, counted over every rank in the paced step of 4
    # microbatches: 2 stages post 4 activations and 4 gradients, each sent once and received once; and the mean
    # CPU time of its compute actions per kind (F, I and W), each a real thread time inside one step
    posts = sh["posts"]
    assert posts["sends"] == posts["recvs"] == 8
    wall = ct["step_wall_s"][0]
    assert 0 < posts["send_s"] < wall / 8 and 0 < posts["recv_s"] < wall / 8
    assert (cluster.send_post_s, cluster.recv_post_s) == (posts["send_s"], posts["recv_s"])
    assert sorted(posts["compute_cpu_s"]) == ["F", "I", "W"] and all(0 < v < wall
                                                                    for v in posts["compute_cpu_s"].values())
    # the file: the product reads it as a real cluster (the shared cores in the lab's section), the lab with them
    from lab.cluster.shared_cpu import load_cluster, write_cluster

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(write_cluster(em, measured)))
    assert load_cluster(str(path)) == em and load_real_cluster(str(path)) == cluster
