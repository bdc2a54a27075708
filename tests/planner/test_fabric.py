"""The fabric's capacity (`ClusterSpec.fabric_gbps`): data-parallel reductions that run at once at the end of a
step share what the network carries in all (pure: no processes)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megareshard.planner.cluster_file import CLUSTER_FORMAT, cluster_to_json, load_cluster
from megareshard.planner.costs import ClusterSpec, StageCosts
from megareshard.planner.search import _reductions_end


def _stage(dp_seconds: float, nic_bytes: int) -> StageCosts:
    return StageCosts(forward_s=0.0, backward_s=0.0, params=0, static_bytes=0, activation_bytes_per_mb=0,
                      extra_bytes=0, tp_bytes_per_mb=0, dp_seconds=dp_seconds, dp_nic_bytes=nic_bytes,
                      optimizer_s=0.0)


def test_reductions_at_once_share_the_fabric() -> None:
    # 4 meshes of a pp 4 × dp 2 pipeline on 8 hosts × 1: each a pair across two hosts (2 ring edges leave a host,
    # 1 per NIC), 1.6 MB per edge, 0.05 s alone
    groups = [[_stage(0.05, 1_600_000)] for _ in range(4)]
    cross = [(True, 1, 2)] * 4
    free = ClusterSpec(8, 1, nic_gbps=0.3)
    assert _reductions_end(groups, [0.0] * 4, cross, free) == 0.05  # non-blocking: each alone
    # a fabric of 1.6 Gbit/s (200 MB/s) carries the 4 × 2 × 1.6 MB in 64 ms
    tight = dataclasses.replace(free, fabric_gbps=1.6)
    assert _reductions_end(groups, [0.0] * 4, cross, tight) == pytest.approx(8 * 1.6e6 / 200e6)
    # one that carries every NIC at once changes nothing
    assert _reductions_end(groups, [0.0] * 4, cross, dataclasses.replace(free, fabric_gbps=2.4)) == 0.05
    # staggered starts: only the reductions that start at t or later count after t — the last two (at 0.2 s)
    # carry 6.4 MB (32 ms), not all four
    starts = [0.0, 0.0, 0.2, 0.2]
    assert _reductions_end(groups, starts, cross, tight) == pytest.approx(0.25)  # each alone: 0.2 + 0.05
    slow = dataclasses.replace(free, fabric_gbps=0.8)  # 100 MB/s: the last two need 64 ms after 0.2
    assert _reductions_end(groups, starts, cross, slow) == pytest.approx(max(0.2 + 0.064, 0.128))
    # a mesh whose ring stays inside hosts puts nothing on the fabric
    inside = [[_stage(0.05, 0)] for _ in range(4)]
    assert _reductions_end(inside, [0.0] * 4, [(False, 0, 0)] * 4, slow) == 0.05


def test_the_fabric_round_trips_in_the_cluster_file_and_old_files_are_non_blocking(tmp_path) -> None:
    c = ClusterSpec(8, 1, nic_gbps=0.3, fabric_gbps=1.6)
    assert c.fabric_Bps == pytest.approx(200e6)
    assert ClusterSpec(8, 1, nic_gbps=0.3).fabric_Bps == pytest.approx(8 * 0.3e9 / 8)  # non-blocking
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cluster_to_json(c)))
    assert load_cluster(str(path)) == c
    path.write_text(json.dumps(cluster_to_json(ClusterSpec(2, 4))))  # a two-host calibration writes null
    assert load_cluster(str(path)).fabric_gbps is None
    path.write_text(json.dumps({"format": CLUSTER_FORMAT, "hosts": 8, "devices_per_host": 1, "fabric_gbps": 0}))
    with pytest.raises(ValueError, match="fabric_gbps = 0 is not a positive number"):
        load_cluster(str(path))


def test_a_tight_fabric_slows_the_layouts_whose_reductions_cross_it_and_no_other() -> None:
    from megareshard.planner import ModelShape, plan_layouts

    model = ModelShape(8, 128, 4, 64, 512, dtype_bytes=4)
    free = ClusterSpec(8, 1, device_tflops=0.02, efficiency=1.0, nic_gbps=0.3, device_memory_gib=4.0)
    kw = dict(micro_batches=(2,), zero_stages=(0,), recompute_options=(False,), runtime_only=True,
              schedules=("1f1b",), strategies=("allgather",), top_shapes=10**6, keep=None, stage_meshes=False,
              uneven_splits=False)
    before = {c.name: c.step_s for c in plan_layouts(model, free, 8, **kw)}
    after = {c.name: c.step_s for c in plan_layouts(model, dataclasses.replace(free, fabric_gbps=0.6), 8, **kw)}
    assert before.keys() == after.keys()
    for name in before:
        if " dp1 " in name:  # no reduction: the fabric is idle at the step's end
            assert after[name] == before[name], name
        else:  # pp 1 × dp 8 and pp 2 × dp 4 and pp 4 × dp 2 all send every host's gradients at once
            assert after[name] > before[name], name
