"""The cores an emulated cluster's hosts share: a step's CPU work over them bounds the step (pure).

On a real cluster every host has cores of its own, and this bound does not exist (`ClusterSpec.shared_cores`
None). An emulated cluster — one network namespace per host on one machine — runs every rank's work on the
same few cores: the compute the emulated devices pace, the passes over the gradients, and the network,
whose packets the kernel moves on those cores too (about 10 ns of CPU per byte sent through a rate-limited
veth pair on the development machines, sender, bridge and receiver together). Eight emulated hosts at
300 Mbit/s each can ask more of two cores than they have: there the data-parallel configurations measured
1.1–1.3× the simulated step while the configurations without data parallelism measured at it, and their
CPU time summed over ranks came within a few per cent of their step × cores. This module adds up a
candidate's CPU seconds per step from calibrated rates; the search takes the step as at least that over the
shared cores, and below that bound as the simulated step plus the waits that CPU work causes
(`ClusterSpec.cpu_contention` per second of it over the cores: a rank that a message or its pacing sleep
wakes finds the cores taken by the others' work; `on_shared_cores`).
"""
from __future__ import annotations

from typing import Any, Sequence

from megareshard.pipeline.meshes import stage_mesh
from megareshard.planner.costs import ClusterSpec, ModelShape

__all__ = ["shared_cpu_s", "shared_cpu_bound_s", "on_shared_cores"]


def _mesh_hosts(sh: Any, cache: dict[tuple, Any]) -> list[frozenset[int]]:
    key = ("mesh hosts", sh.layouts or (sh.tp, sh.pp, sh.order))
    if key not in cache:
        out = []
        for i in range(sh.pp):
            mesh = stage_mesh(sh.topo, i)
            out.append(frozenset(mesh.host_of(r) for row in mesh.ranks for r in row))
        cache[key] = out
    return cache[key]


def _ring_sent(n: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring all-reduce of `nbytes` over `n` ranks."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def shared_cpu_s(model: ModelShape, cluster: ClusterSpec, sh: Any, placement: Sequence[int], delay_wgrad: bool,
                 cache: dict[tuple, Any]) -> float:
    """CPU seconds one step of shape `sh` (stages placed on meshes by `placement`) asks of every rank together:

    * compute: each rank's microbatches × its stages' compute (`StageCosts.compute_s`) × `compute_cpu_share`;
    * per parameter held: the passes over the gradients and the optimizer step (`cpu_s_per_param`);
    * the runtime's own work: `cpu_s_per_step` per rank, `cpu_s_per_action` per compute action (F and B, or F, I
      and W under delayed weight gradients: `delay_wgrad`) with the communication it posts and waits for;
    * bytes sent: the tensor-parallel collectives, each stage's data-parallel ring (across a NIC where the
      ring leaves a host), and every stage-boundary activation and gradient (global microbatch, once each
      way), at `cpu_s_per_nic_byte` or `cpu_s_per_intra_byte`.

    The tied embedding's all-reduce and the one-element all-reduces a step ends with are left out (a
    vocabulary × hidden table on two ranks; a few bytes)."""
    c = cluster
    layouts = sh.mesh_layouts()
    total = 0.0
    for (tp, dp), g in zip(layouts, sh.per_mesh(tuple(placement))):
        per_rank = sh.m * sum(st.compute_s for st in g) * c.compute_cpu_share
        per_rank += c.cpu_s_per_step + sh.m * len(g) * (3 if delay_wgrad else 2) * c.cpu_s_per_action
        per_rank += sum(st.params for st in g) * c.cpu_s_per_param
        per_rank += sh.m * sum(st.tp_bytes_per_mb for st in g) * c.cpu_s_per_intra_byte
        for st in g:
            rate = c.cpu_s_per_nic_byte if st.dp_nic_bytes else c.cpu_s_per_intra_byte
            per_rank += _ring_sent(dp, 4.0 * st.params) * rate
        total += tp * dp * per_rank
    hosts = _mesh_hosts(sh, cache)
    max_dp = max(dp for _, dp in layouts)
    act = sh.b * max_dp * model.seq_length * model.hidden_size * model.dtype_bytes  # the global microbatch
    for a, b in zip(placement, placement[1:]):
        if a != b:
            rate = c.cpu_s_per_nic_byte if hosts[a] != hosts[b] else c.cpu_s_per_intra_byte
            total += 2 * sh.m * act * rate
    return total


def shared_cpu_bound_s(model: ModelShape, cluster: ClusterSpec, sh: Any, placement: Sequence[int],
                       delay_wgrad: bool, cache: dict[tuple, Any]) -> float:
    """The least seconds a step of `sh` takes on the cores every host shares: its CPU work over them; 0 where the
    hosts have cores of their own (`ClusterSpec.shared_cores` None)."""
    if not cluster.shared_cores:
        return 0.0
    return shared_cpu_s(model, cluster, sh, placement, delay_wgrad, cache) / cluster.shared_cores


def on_shared_cores(step_s: float, bound_s: float, cluster: ClusterSpec) -> float:
    """The step of a simulated `step_s` whose CPU work over the shared cores is `bound_s`
    (`shared_cpu_bound_s`): the simulated step plus `cpu_contention` × `bound_s` of waiting for a core, and
    never less than the bound itself. `step_s` unchanged where the hosts have cores of their own."""
    if not bound_s:
        return step_s
    return max(step_s + cluster.cpu_contention * bound_s, bound_s)
