"""The cores an emulated cluster's hosts share (`SharedCores`, the planner's extra cost term `SharedCoresTerm`): a
step's CPU work over them bounds the step, and below the bound the ranks wait for them (`cpu_contention`). Each
CPU term is checked against its arithmetic on one-term rates; without the term the plans are the same bit for bit
(rates or not); the runtime probe's fits recover known rates; cluster files carry the shared cores beside the
product's fields, and the older layout still reads."""
from __future__ import annotations

import dataclasses
import json

import pytest

from lab.cluster.calibration_shared import fit_contention, fit_runtime_cpu
from lab.cluster.shared_cpu import (BOTTLENECK, SHARED_CPU, WAITING, EmulatedCluster, SharedCores, load_cluster,
                                    on_shared_cores, read_cluster, write_cluster)
from megareshard.planner import ClusterSpec, ModelShape, plan_layouts
from megareshard.planner.cluster_file import cluster_from_json, cluster_to_json
from megareshard.planner.costs import stage_costs
from megareshard.planner.search import pipeline_makespan

MODEL = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128,
                   dtype_bytes=4)
BASE = ClusterSpec(hosts=2, devices_per_host=1, device_memory_gib=4.0, device_tflops=0.02, efficiency=1.0,
                   nic_gbps=0.2, intra_gbps=20.0, optimizer_s_per_param=2e-8, grad_pass_s_per_param=3e-8,
                   action_overhead_s=1e-4, layer_overhead_s=1e-3)
NO_CPU = dict(compute_cpu_share=0.0, cpu_s_per_param=0.0, cpu_s_per_nic_byte=0.0, cpu_s_per_intra_byte=0.0,
              cpu_s_per_action=0.0, cpu_s_per_step=0.0)


def _plan(cluster: ClusterSpec, global_batch: int = 8, model: ModelShape = MODEL, shared: SharedCores | None = None):
    return plan_layouts(model, cluster, global_batch, micro_batches=(1, 2), zero_stages=(0,),
                        recompute_options=(False,), stage_meshes=False, runtime_only=True, top_shapes=10**6,
                        keep=None, terms=EmulatedCluster(cluster, shared).terms())


def _pick(ranked, pp: int, dp: int, mb: int, schedule: str | None = None, dw: bool = False,
          strategy: str = "allgather"):
    """The one candidate of these degrees (pp 1: its one schedule)."""
    (c,) = [c for c in ranked if (c.pp, c.dp, c.micro_batch, c.delay_wgrad) == (pp, dp, mb, dw) and c.tp == 1
            and (schedule is None or c.schedule == schedule) and c.strategy == strategy and c.virtual_stages == 1]
    return c


def _one_term(**term):
    # cores so few that every candidate is bound by them: its step is its CPU seconds over them
    return _plan(BASE, shared=SharedCores(cores=1e-6, **(NO_CPU | term)))


def _one_stage(dp: int, b: int):
    return stage_costs(MODEL, BASE, layers=MODEL.num_layers, first=True, last=True, tp=1, dp=dp, micro_batch=b,
                       sequence_parallel=False, recompute=False, zero=0, dp_crosses_hosts=dp > 1,
                       dp_ring_edges_per_nic=1)


def test_each_cpu_term_is_its_arithmetic() -> None:
    # the data-parallel ring across the NIC: each of 2 ranks sends 2·(2−1)/2 of its fp32 gradients
    st = _one_stage(dp=2, b=2)
    c = _pick(_one_term(cpu_s_per_nic_byte=1e-9), pp=1, dp=2, mb=2)
    assert c.terms[SHARED_CPU] == pytest.approx(2 * (4 * st.params) * 1e-9, rel=1e-12)
    # a stage boundary across the NIC: the global microbatch's activation forward, its gradient backward, per mb
    m = 8 // 2
    act = 2 * MODEL.seq_length * MODEL.hidden_size * 4
    c = _pick(_one_term(cpu_s_per_nic_byte=1e-9), pp=2, dp=1, mb=2, schedule="1f1b", dw=False)
    assert c.terms[SHARED_CPU] == pytest.approx(2 * m * act * 1e-9, rel=1e-12)
    # parameters held: every rank its own (two replicas hold the model twice)
    c = _pick(_one_term(cpu_s_per_param=1e-8), pp=1, dp=2, mb=2)
    assert c.terms[SHARED_CPU] == pytest.approx(2 * st.params * 1e-8, rel=1e-12)
    # compute: every rank's microbatches × its stage's F + B compute, at the share
    c = _pick(_one_term(compute_cpu_share=0.5), pp=1, dp=2, mb=2)
    assert c.terms[SHARED_CPU] == pytest.approx(2 * (8 // (2 * 2)) * st.compute_s * 0.5, rel=1e-12)
    # the runtime's own work: per rank and step, per compute action (F, B; F, I, W under delayed weight gradients)
    ranked = _one_term(cpu_s_per_action=1e-3, cpu_s_per_step=1e-2)
    for dw, k in ((False, 2), (True, 3)):
        c = _pick(ranked, pp=2, dp=1, mb=2, schedule="1f1b", dw=dw)
        assert c.terms[SHARED_CPU] == pytest.approx(2 * 1e-2 + 2 * m * k * 1e-3, rel=1e-12)


def test_compute_part_is_the_stage_compute_without_collectives() -> None:
    st = _one_stage(dp=1, b=2)
    assert st.compute_s == pytest.approx(st.forward_s + st.backward_s, rel=1e-12)  # tp 1: no collective
    tp2 = stage_costs(MODEL, BASE, layers=2, first=False, last=False, tp=2, dp=1, micro_batch=2,
                      sequence_parallel=False, recompute=False, zero=0, dp_crosses_hosts=False, dp_ring_edges_per_nic=0)
    assert 0 < tp2.compute_s < tp2.forward_s + tp2.backward_s


def test_without_shared_cores_the_plans_are_the_products_bit_for_bit() -> None:
    plain = plan_layouts(MODEL, BASE, 8, micro_batches=(1, 2), zero_stages=(0,), recompute_options=(False,),
                         stage_meshes=False, runtime_only=True, top_shapes=10**6, keep=None)  # no term
    assert EmulatedCluster(BASE).terms() == () and all(c.terms == {} for c in plain)

    def seen(ranked):
        return [(c.name, c.step_s, c.estimate_s, c.breakdown, c.bottleneck) for c in ranked]

    assert seen(_plan(BASE)) == seen(plain)
    # a term that counts no CPU work changes nothing either, whatever its contention
    idle = _plan(BASE, shared=SharedCores(cores=2.0, cpu_contention=0.5, **NO_CPU))
    assert seen(idle) == seen(plain) and all(c.terms[SHARED_CPU] == 0 for c in idle)


def test_the_bound_is_the_step_at_least_and_reorders_data_parallel_layouts() -> None:
    model = ModelShape(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512,
                       dtype_bytes=4)
    cluster = dataclasses.replace(BASE, hosts=8, nic_gbps=0.3, device_tflops=0.015, layer_overhead_s=3e-3)
    plain = {c.name: c for c in _plan(cluster, model=model)}
    shared = SharedCores(cores=2.0, compute_cpu_share=0.2, cpu_s_per_param=2e-8, cpu_s_per_nic_byte=1.2e-8,
                         cpu_s_per_action=1e-3, cpu_s_per_step=1e-2)
    ranked = _plan(cluster, model=model, shared=shared)
    bound = 0
    for c in ranked:
        p = plain[c.name]
        assert c.step_s == pytest.approx(max(p.step_s, c.terms[SHARED_CPU] / 2.0), rel=1e-12)
        if c.terms[SHARED_CPU] / 2.0 > p.step_s:
            bound += 1
            assert c.bottleneck == BOTTLENECK
            assert c.breakdown[WAITING] == pytest.approx(c.step_s - p.step_s, rel=1e-9)
    assert bound > 0
    # data parallelism moves gradients through the shared cores: the bound falls hardest on it
    best_plain = min(plain.values(), key=lambda c: c.step_s)
    assert ranked[0].dp <= best_plain.dp
    dp8 = [c for c in ranked if c.dp == 8]
    assert dp8 and all(c.bottleneck == BOTTLENECK for c in dp8)


def test_waiting_for_the_shared_cores_adds_to_the_simulated_step_below_the_bound() -> None:
    cores = SharedCores(cores=2.0, cpu_contention=0.25)
    assert on_shared_cores(1.0, 0.0, cores) == 1.0  # no CPU work counted: the step itself
    assert on_shared_cores(1.0, 0.8, cores) == pytest.approx(1.2, rel=1e-12)  # 1 + 0.25 × 0.8
    assert on_shared_cores(1.0, 1.5, cores) == 1.5  # the bound: the work does not fit in 1 + 0.25 × 1.5
    no_rate = SharedCores(cores=2.0)
    assert on_shared_cores(1.0, 0.8, no_rate) == 1.0 and on_shared_cores(1.0, 1.5, no_rate) == 1.5
    # every candidate of a plan: its step without the cores, plus the rate × its CPU work over them
    model = ModelShape(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512,
                       dtype_bytes=4)
    rates = dict(cores=2.0, compute_cpu_share=0.2, cpu_s_per_param=2e-8, cpu_s_per_nic_byte=1.2e-8,
                 cpu_s_per_action=1e-3, cpu_s_per_step=1e-2)
    cluster = dataclasses.replace(BASE, hosts=8, nic_gbps=0.3, device_tflops=0.015, layer_overhead_s=3e-3)
    plain = {c.name: c for c in _plan(cluster, model=model)}
    ranked = _plan(cluster, model=model, shared=SharedCores(cpu_contention=0.3, **rates))
    below = 0
    for c in ranked:
        p, cpu = plain[c.name], c.terms[SHARED_CPU] / 2.0
        assert c.step_s == pytest.approx(max(p.step_s + 0.3 * cpu, cpu), rel=1e-12)
        assert c.breakdown[WAITING] == pytest.approx(c.step_s - p.step_s, rel=1e-9)
        if cpu < p.step_s + 0.3 * cpu:
            below += 1
            assert c.bottleneck != BOTTLENECK
    assert below > 0


def test_the_contention_fit_recovers_its_rate() -> None:
    # a pipeline whose every microbatch takes its simulated period plus 0.2 × its CPU over 2 cores
    world, budget, per_mb, rate, cores = 4, 5e-3, 0.03, 0.2, 2.0

    def simulated(m: int) -> float:
        return pipeline_makespan("1f1b", True, world, m, budget, 2 * budget, budget, 3e-4, 1e-4)

    period = (simulated(24) - simulated(8)) / 16
    assert period == pytest.approx(3 * (budget + 1e-4), rel=1e-9)  # steady 1f1b: F, I and W per microbatch
    seen = []

    def step_cpu(m: int, pace: float | None = None) -> tuple[float, float]:
        seen.append((m, pace))
        return 0.01 + m * per_mb, 0.07 + m * (period + rate * per_mb / cores)

    fit = fit_contention(step_cpu, world, budget, simulated, per_mb, cores)
    assert seen == [(8, budget), (24, budget)]
    assert fit["cpu_contention"] == pytest.approx(rate, rel=1e-9)
    # a pipeline at its simulated pace: no waiting (never negative)
    fit = fit_contention(lambda m, pace=None: (1.0, 0.5 + m * period * 0.99), world, budget, simulated, per_mb,
                         cores)
    assert fit["cpu_contention"] == 0.0


def test_the_runtime_probe_fit_recovers_its_rates() -> None:
    world, per_step, per_action, idle = 8, 0.009, 0.0008, 0.2
    layer = {"forward_cpu_s": 1e-4, "input_grad_cpu_s": 1.5e-4, "weight_grad_cpu_s": 0.5e-4}

    def step_cpu(m: int) -> tuple[float, float]:
        wall = 0.01 * m + 0.05
        busy = world * (per_step + m * (3 * per_action + sum(layer.values()))) + idle * wall
        return busy, wall

    fit = fit_runtime_cpu(step_cpu, world, layer, idle)
    assert fit["cpu_s_per_action"] == pytest.approx(per_action, rel=1e-9)
    assert fit["cpu_s_per_step"] == pytest.approx(per_step, rel=1e-9)


def test_cluster_files_carry_the_shared_cores_beside_the_products(tmp_path) -> None:
    shared = SharedCores(cores=1.8, compute_cpu_share=0.25, cpu_s_per_param=2e-8, cpu_s_per_nic_byte=1.2e-8,
                         cpu_s_per_action=9e-4, cpu_s_per_step=0.01, cpu_contention=0.27)
    data = json.loads(json.dumps(write_cluster(EmulatedCluster(BASE, shared), {"load": {"load": 2.0}})))
    assert data["lab"] == {"shared_cores": dataclasses.asdict(shared)} and data["measured"] == {"load": {"load": 2.0}}
    assert read_cluster(data, "x.json") == EmulatedCluster(BASE, shared)
    # the product reads the same file as a real cluster: its own fields, the lab's section left alone
    assert cluster_from_json(data, "x.json") == BASE and data == cluster_to_json(BASE, data["measured"]) | {
        "lab": data["lab"]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    assert load_cluster(str(path), hosts=4) == EmulatedCluster(dataclasses.replace(BASE, hosts=4), shared)
    plain = json.loads(json.dumps(write_cluster(EmulatedCluster(BASE))))
    assert "lab" not in plain and read_cluster(plain, "x.json") == EmulatedCluster(BASE)
    # the older layout (the validation runs' recorded calibrations): the rates as ClusterSpec fields at the top
    old = cluster_to_json(BASE) | {"shared_cores": 1.8} | {k: v for k, v in dataclasses.asdict(shared).items()
                                                              if k != "cores"}
    assert read_cluster(old, "x.json") == EmulatedCluster(BASE, shared) and cluster_from_json(old, "x.json") == BASE
    assert read_cluster(cluster_to_json(BASE) | {"shared_cores": None, "cpu_contention": 0.0}, "x.json").shared is None
    for bad, why in ((old | {"cpu_s_per_nic_byte": -1}, "shared cores' cpu_s_per_nic_byte = -1 is not a non-negative"),
                     (old | {"shared_cores": 0}, "shared cores' cores = 0 is not a positive number"),
                     (data | {"lab": {"shared_cores": {"cores": "2"}}}, "cores = '2' is not a positive number"),
                     (data | {"lab": []}, '"lab" must be an object')):
        with pytest.raises(ValueError, match=why):
            read_cluster(bad, "x.json")
