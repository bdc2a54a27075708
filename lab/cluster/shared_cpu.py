"""The cores an emulated cluster's hosts share: a step's CPU work over them bounds the step (pure).

On a real cluster every host has cores of its own, and this bound does not exist: the product's planner
knows nothing of it. An emulated cluster — one network namespace per host on one machine — runs every rank's
work on the same few cores: the compute the emulated devices pace, the passes over the gradients, and the
network, whose packets the kernel moves on those cores too (about 10 ns of CPU per byte sent through a
rate-limited veth pair on the development machines, sender, bridge and receiver together). Eight emulated
hosts at 300 Mbit/s each can ask more of two cores than they have: there the data-parallel configurations
measured 1.1–1.3× the simulated step while the configurations without data parallelism measured at it, and
their CPU time summed over ranks came within a few per cent of their step × cores.

`SharedCores` holds the calibrated rates (`calibration_shared.py` measures them); `shared_cpu_s` adds up a
candidate's CPU seconds per step from them; `SharedCoresTerm` is the planner's extra cost term
(`megareshard.planner.terms`): the step is at least that CPU work over the shared cores, and below that bound
the simulated step plus the waits that CPU work causes (`SharedCores.cpu_contention` per second of it over the
cores: a rank that a message or its pacing sleep wakes finds the cores taken by the others' work;
`on_shared_cores`). `EmulatedCluster` is a cluster file as the lab reads it: the product's `ClusterSpec` and,
beside it in the same JSON, the ``"lab": {"shared_cores": {...}}`` section (older files: the same rates at the
top level, as `ClusterSpec` fields; `read_cluster` converts them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from megareshard.pipeline.meshes import stage_mesh
from megareshard.planner.cluster_file import cluster_from_json, cluster_to_json, read_cluster_json
from megareshard.planner.costs import ClusterSpec, ModelShape
from megareshard.planner.terms import TermInput, TermStep, register_cost_term

__all__ = ["SharedCores", "SharedCoresTerm", "EmulatedCluster", "shared_cpu_s", "on_shared_cores", "read_cluster",
           "load_cluster", "write_cluster", "SHARED_CPU", "WAITING", "BOTTLENECK"]

SHARED_CPU = "shared_cpu_s"
"""The term's name: its quantity in `Candidate.terms` is a step's CPU seconds on the shared cores."""
WAITING = "waiting for the shared cores"
"""The breakdown entry of what the term adds to a step."""
BOTTLENECK = "the cores every host shares (CPU)"


@dataclass(frozen=True)
class SharedCores:
    """The cores every host of an emulated cluster shares, and the CPU rates of a step's work on them."""

    cores: float
    """Cores every host of this cluster shares for all the CPU work of its ranks: the compute, the passes over the
    gradients, and the network's packets, which the kernel moves on those cores too. Calibrated where every rank
    reports one kernel (boot id): the machine's cores less what it keeps busy while the ranks idle."""
    compute_cpu_share: float = 1.0
    """CPU seconds per second of device compute: on the emulated cluster a device second is CPU time stretched by
    the ranks' load (and the emulation's pace margin), so less than 1."""
    cpu_s_per_param: float = 0.0
    """CPU seconds per parameter a device holds, each step: the passes over the gradients and the optimizer step
    (calibrated on the trainer's own `ZeroOptimizer`, CPU time, not wall)."""
    cpu_s_per_action: float = 0.0
    """CPU seconds of the pipeline runtime's own work per compute action (dispatch, the sends and receives it
    posts, autograd's bookkeeping past the layer); calibrated from a real pipeline of one small layer per rank at
    two microbatch counts, less that layer's own CPU time."""
    cpu_s_per_step: float = 0.0
    """CPU seconds of each rank's fixed work per training step (the step's closing collectives, the optimizer's
    bookkeeping); calibrated with `cpu_s_per_action`."""
    cpu_s_per_nic_byte: float = 0.0
    """CPU seconds per byte a rank sends across a NIC in a reduction (sender, kernel and receiver together);
    calibrated with every host in a two-host all-reduce at once."""
    cpu_s_per_intra_byte: float = 0.0
    """The same per byte a rank sends to another of its host (loopback)."""
    cpu_contention: float = 0.0
    """Seconds a step waits per second of its CPU work over `cores`, below saturation: a rank woken by a message or
    by its pacing sleep finds the cores busy with the other ranks' work more often the more of it there is (the
    step is max(simulated + this × CPU / cores, CPU / cores)). Calibrated with a pipeline of one layer per rank
    paced as the emulated device paces: its step's growth per microbatch beyond the simulated one, over the CPU
    each microbatch adds per core."""


_FIELDS = tuple(f.name for f in dataclasses.fields(SharedCores))
_OLD_NAMES = {"shared_cores": "cores"} | {k: k for k in _FIELDS if k != "cores"}
"""The `ClusterSpec` fields older cluster files held these rates in (top level), by their name here."""


def _mesh_hosts(sh: Any, cache: dict[tuple, Any]) -> list[frozenset[int]]:
    key = (SHARED_CPU, "mesh hosts", sh.layouts or (sh.tp, sh.pp, sh.order))
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


def shared_cpu_s(model: ModelShape, p: SharedCores, sh: Any, placement: Sequence[int], delay_wgrad: bool,
                 cache: dict[tuple, Any]) -> float:
    """CPU seconds one step of shape `sh` (the planner's; stages placed on meshes by `placement`) asks of every
    rank together, at the rates of `p`:

    * compute: each rank's microbatches × its stages' compute (`StageCosts.compute_s`) × `compute_cpu_share`;
    * per parameter held: the passes over the gradients and the optimizer step (`cpu_s_per_param`);
    * the runtime's own work: `cpu_s_per_step` per rank, `cpu_s_per_action` per compute action (F and B, or F, I
      and W under delayed weight gradients: `delay_wgrad`) with the communication it posts and waits for;
    * bytes sent: the tensor-parallel collectives, each stage's data-parallel ring (across a NIC where the
      ring leaves a host), and every stage-boundary activation and gradient (global microbatch, once each
      way), at `cpu_s_per_nic_byte` or `cpu_s_per_intra_byte`.

    The tied embedding's all-reduce and the one-element all-reduces a step ends with are left out (a
    vocabulary × hidden table on two ranks; a few bytes)."""
    layouts = sh.mesh_layouts()
    total = 0.0
    for (tp, dp), g in zip(layouts, sh.per_mesh(tuple(placement))):
        per_rank = sh.m * sum(st.compute_s for st in g) * p.compute_cpu_share
        per_rank += p.cpu_s_per_step + sh.m * len(g) * (3 if delay_wgrad else 2) * p.cpu_s_per_action
        per_rank += sum(st.params for st in g) * p.cpu_s_per_param
        per_rank += sh.m * sum(st.tp_bytes_per_mb for st in g) * p.cpu_s_per_intra_byte
        for st in g:
            rate = p.cpu_s_per_nic_byte if st.dp_nic_bytes else p.cpu_s_per_intra_byte
            per_rank += _ring_sent(dp, 4.0 * st.params) * rate
        total += tp * dp * per_rank
    hosts = _mesh_hosts(sh, cache)
    max_dp = max(dp for _, dp in layouts)
    act = sh.b * max_dp * model.seq_length * model.hidden_size * model.dtype_bytes  # the global microbatch
    for a, b in zip(placement, placement[1:]):
        if a != b:
            rate = p.cpu_s_per_nic_byte if hosts[a] != hosts[b] else p.cpu_s_per_intra_byte
            total += 2 * sh.m * act * rate
    return total


def on_shared_cores(step_s: float, bound_s: float, p: SharedCores) -> float:
    """The step of a simulated `step_s` whose CPU work over the shared cores is `bound_s`: the simulated step plus
    `cpu_contention` × `bound_s` of waiting for a core, and never less than the bound itself; `step_s` where no
    CPU work is counted."""
    if not bound_s:
        return step_s
    return max(step_s + p.cpu_contention * bound_s, bound_s)


@register_cost_term
@dataclass(frozen=True)
class SharedCoresTerm:
    """The planner's extra cost term (`megareshard.planner.terms.CostTerm`) of the shared cores `p`."""

    p: SharedCores
    name: str = SHARED_CPU

    def measure(self, at: TermInput) -> float:
        """The step's CPU seconds on the shared cores (`shared_cpu_s`)."""
        return shared_cpu_s(at.model, self.p, at.shape, at.placement, at.delay_wgrad, at.cache)

    def apply(self, step_s: float, quantity: float, at: TermInput) -> TermStep:
        cpu = quantity / self.p.cores
        shared = on_shared_cores(step_s, cpu, self.p)
        if not shared > step_s:
            return TermStep(step_s)
        # the ranks wait for the cores; where the step's CPU work does not fit on them in the simulated time,
        # they are the bottleneck
        return TermStep(shared, {WAITING: shared - step_s}, BOTTLENECK if cpu >= shared else None)


@dataclass(frozen=True)
class EmulatedCluster:
    """A cluster as the lab plans it: the product's `ClusterSpec` and, where its hosts share cores, `shared`."""

    cluster: ClusterSpec
    shared: SharedCores | None = None

    def terms(self) -> tuple[SharedCoresTerm, ...]:
        """The planner's extra cost terms (`plan_layouts(..., terms=...)`): none where every host has its cores."""
        return (SharedCoresTerm(self.shared),) if self.shared else ()


def _shared_from(section: dict[str, Any], names: dict[str, str], path: str) -> SharedCores | None:
    kw = {new: section[old] for old, new in names.items() if old in section}
    if kw.get("cores") is None:
        return None  # every host has cores of its own
    for k, v in kw.items():
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 if k == "cores" else v >= 0)
        if not ok:
            raise ValueError(f"cluster file {path}: shared cores' {k} = {v!r} is not a "
                             f"{'positive' if k == 'cores' else 'non-negative'} number")
    return SharedCores(**kw)


def read_cluster(data: Any, path: str, hosts: int | None = None, devices_per_host: int | None = None
                 ) -> EmulatedCluster:
    """The cluster JSON `data` (read from `path`) as the lab plans it: the product's `cluster_from_json` (`hosts` and
    `devices_per_host` replace the file's) and the shared cores of its ``"lab": {"shared_cores": {...}}`` section,
    or, in files written before that section (the validation runs' recorded calibrations among them), of the
    top-level ``shared_cores`` and CPU-rate fields. Raises ValueError (one line) on a bad value."""
    cluster = cluster_from_json(data, path, hosts, devices_per_host)
    lab = data.get("lab")
    if lab is not None:
        if not isinstance(lab, dict) or not isinstance(lab.get("shared_cores", {}), dict):
            raise ValueError(f"cluster file {path}: \"lab\" must be an object whose \"shared_cores\" is an object")
        return EmulatedCluster(cluster, _shared_from(lab.get("shared_cores", {}), {k: k for k in _FIELDS}, path))
    return EmulatedCluster(cluster, _shared_from(data, _OLD_NAMES, path))


def load_cluster(path: str, hosts: int | None = None, devices_per_host: int | None = None) -> EmulatedCluster:
    """`read_cluster` of the file at `path`."""
    return read_cluster(read_cluster_json(path), path, hosts, devices_per_host)


def write_cluster(em: EmulatedCluster, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cluster JSON of `em`: the product's (`cluster_to_json`, which the product's tools read as a real
    cluster), plus the ``lab`` section with the shared cores where there are some."""
    out = cluster_to_json(em.cluster, measured)
    if em.shared is not None:
        out["lab"] = {"shared_cores": dataclasses.asdict(em.shared)}
    return out
