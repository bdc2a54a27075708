"""The search's enumeration (pure): the layouts it considers, each with its per-stage costs.

A `_Shape` is a layout without its schedule and strategy: tp, pp, dp, the micro batch and microbatch count,
sequence parallelism, recomputation, ZeRO, the rank topology (placed by communication volume, tp innermost)
and the `StageCosts` of every stage. ``_shapes`` yields the uniform layouts (tp × pp × micro batch × sequence
parallelism × recomputation × ZeRO × layer split), ``_stage_mesh_shapes`` the per-stage meshes near one of
them, ``_virtualize`` a shape with several stages per mesh, ``_schedule_options`` the (schedule, virtual stages)
pairs a shape admits. `search.py` prunes, estimates and scores them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..parallel import CommVolume, Topology
from ..parallel.stage_topology import StageTopology
from ..pipeline.schedules import get_schedule
from .costs import ClusterSpec, ModelShape, StageCosts, stage_costs
from .variants import balanced_split, stage_layout_variants, virtual_options


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class _Shape:
    """A layout without its schedule and strategy: what memory and the stage costs depend on."""

    tp: int
    pp: int
    dp: int
    b: int
    m: int
    sp: bool
    recompute: bool
    zero: int
    topo: Any  # Topology, or StageTopology for per-stage meshes
    stages: list[StageCosts]  # one per pipeline stage (model chunk)
    layers: tuple[int, ...]
    layouts: tuple[tuple[int, int], ...] | None = None
    virtual: int = 1
    uneven: bool = False
    cross: list[tuple[bool, int]] = field(default_factory=list)  # per mesh: dp leaves a host, ring edges per NIC

    @property
    def order(self) -> str:
        return "stage-blocks" if self.layouts else "-".join(self.topo.order)

    def per_mesh(self, placement: tuple[int, ...]) -> list[list[StageCosts]]:
        out: list[list[StageCosts]] = [[] for _ in range(self.pp)]
        for st, p in zip(self.stages, placement):
            out[p].append(st)
        return out

    def mesh_layouts(self) -> list[tuple[int, int]]:
        """(tp, dp) of every mesh."""
        return list(self.layouts) if self.layouts else [(self.tp, self.dp)] * self.pp


_stage_costs = functools.lru_cache(maxsize=1 << 16)(stage_costs)


def _stage_list(model: ModelShape, cluster: ClusterSpec, layers: tuple[int, ...], mesh_of: list[int],
                layouts: list[tuple[int, int]], cross: list[tuple[bool, int]], b: int, max_dp: int, sp: bool,
                rc: bool, zero: int) -> list[StageCosts]:
    S = len(layers)
    out = []
    tied_copy = mesh_of[0] != mesh_of[-1]  # one mesh with both ends holds one tied Parameter (zbv's V)
    for i, n in enumerate(layers):
        tp, dp = layouts[mesh_of[i]]
        crosses, per_host = cross[mesh_of[i]]
        out.append(_stage_costs(model, cluster, layers=n, first=i == 0, last=i == S - 1, tp=tp, dp=dp,
                                micro_batch=b * max_dp // dp, sequence_parallel=sp and tp > 1, recompute=rc,
                                zero=zero if dp > 1 else 0, dp_crosses_hosts=crosses, dp_ring_edges_per_nic=per_host,
                                tied_copy=tied_copy))
    return out


def _dp_ring_cross(topo: Any, layouts: Sequence[tuple[int, int]], D: int) -> list[tuple[bool, int]]:
    """Per stage: does a dp ring leave a host, and the most ring edges (over the stage's tp rings, each in dp
    order as gloo's and NCCL's rings run) that leave one host: what that host's NIC carries."""
    out = []
    for s, (tp, dp) in enumerate(layouts):
        leaving: dict[int, int] = {}
        for t in range(tp):
            hosts = [topo.rank_of(tp=t, dp=d, pp=s) // D for d in range(dp)]
            for d in range(dp if dp > 1 else 0):
                if hosts[d] != hosts[(d + 1) % dp]:
                    leaving[hosts[d]] = leaving.get(hosts[d], 0) + 1
        out.append((bool(leaving), max(leaving.values(), default=0)))
    return out


def _tp_ok(model: ModelShape, tp: int) -> bool:
    return model.num_attention_heads % tp == 0 and model.groups % tp == 0


def _splits(model: ModelShape, pp: int, uneven: bool, build) -> list[tuple[int, ...]]:
    """The even split where pp divides the layers, and the balanced one (`variants.balanced_split`)."""
    L = model.num_layers
    out = [(L // pp,) * pp] if L % pp == 0 else []
    if uneven and pp > 1:
        one = build((1,) * pp)
        per = [st.forward_s + st.backward_s for st in one]
        two = build((2,) * pp)
        per_layer = two[pp // 2].forward_s + two[pp // 2].backward_s - per[pp // 2]
        if per_layer > 0:
            bal = balanced_split(L, pp, per_layer, [x - per_layer for x in per])
            if bal not in out:
                out.append(bal)
    return out


def _shapes(model: ModelShape, cluster: ClusterSpec, global_batch: int, micro_batches: Iterable[int],
            zero_stages: Iterable[int], recompute_options: Iterable[bool], uneven: bool) -> Iterable[_Shape]:
    """Uniform layouts: tp × pp × micro batch × sequence parallelism × recomputation × ZeRO × layer split."""
    D, N, L = cluster.devices_per_host, cluster.world, model.num_layers
    micro_batches = list(micro_batches)
    for tp in [t for t in _divisors(D) if _tp_ok(model, t)]:
        for pp in _divisors(N // tp):
            if pp > L:
                continue
            dp = N // (tp * pp)
            volume = CommVolume.for_gpt(model.hidden_size, model.seq_length, 1, tp=tp, dp=dp, pp=pp)
            # tp innermost (inside a host: its collectives are costed on the intra-host link), then dp and
            # pp by communication volume
            order = ("tp",) + tuple(a for a in volume.order() if a != "tp")
            topo = Topology(N, tp=tp, pp=pp, nproc_per_node=D, order=order)
            cross = _dp_ring_cross(topo, [(tp, dp)] * pp, D)
            for b in micro_batches:
                if global_batch % (b * dp):
                    continue
                m = global_batch // (b * dp)
                for sp in ((False, True) if tp > 1 else (False,)):
                    for rc in recompute_options:
                        for z in (zero_stages if dp > 1 else (0,)):
                            def build(layers: tuple[int, ...]) -> list[StageCosts]:
                                return _stage_list(model, cluster, layers, list(range(pp)), [(tp, dp)] * pp, cross,
                                                   b, dp, sp, rc, z)
                            for split in _splits(model, pp, uneven, build):
                                yield _Shape(tp, pp, dp, b, m, sp, rc, z, topo, build(split), split,
                                             uneven=len(set(split)) > 1, cross=cross)


def _stage_mesh_shapes(model: ModelShape, cluster: ClusterSpec, global_batch: int, base: _Shape,
                       uneven: bool, topos: dict[tuple, tuple[Any, list]]) -> Iterable[_Shape]:
    """Per-stage meshes near a uniform shape (`variants.stage_layout_variants`), same batch, sp, recompute, ZeRO."""
    D, N = cluster.devices_per_host, cluster.world
    allowed = [t for t in _divisors(D) if _tp_ok(model, t)]
    for lay in stage_layout_variants(base.tp, base.pp, N // base.pp, allowed):
        if lay not in topos:
            st = StageTopology(N, lay, nproc_per_node=D)
            topos[lay] = (st, _dp_ring_cross(st, st.layouts, D))
        topo, cross = topos[lay]
        max_dp = max(d for _, d in lay)
        if global_batch % (base.b * max_dp):
            continue
        sp = base.sp and max(t for t, _ in lay) > 1

        def build(layers: tuple[int, ...]) -> list[StageCosts]:
            return _stage_list(model, cluster, layers, list(range(base.pp)), list(lay), cross, base.b, max_dp, sp,
                               base.recompute, base.zero)
        for split in _splits(model, base.pp, uneven, build):
            yield _Shape(max(t for t, _ in lay), base.pp, max_dp, base.b, global_batch // (base.b * max_dp), sp,
                         base.recompute, base.zero, topo, build(split), split, lay, uneven=len(set(split)) > 1,
                         cross=cross)


def _virtualize(model: ModelShape, cluster: ClusterSpec, sh: _Shape, v: int, placement: tuple[int, ...]) -> _Shape:
    """The same shape with v stages per mesh (layers / (pp·v) each; uniform meshes only), stage s on mesh
    `placement[s]` (the schedule's: interleaved round robin, or zbv's V, whose first mesh holds both ends)."""
    S = sh.pp * v
    n = model.num_layers // S
    lay = sh.mesh_layouts()
    stages = _stage_list(model, cluster, (n,) * S, list(placement), lay, sh.cross, sh.b,
                         sh.dp, sh.sp, sh.recompute, sh.zero)
    return _Shape(sh.tp, sh.pp, sh.dp, sh.b, sh.m, sh.sp, sh.recompute, sh.zero, sh.topo, stages, (n,) * S,
                  None, v, cross=sh.cross)


def _schedule_options(names: list[str], sh: _Shape, num_layers: int) -> list[tuple[str, int]]:
    out = []
    single = next((n for n in names if get_schedule(n).stages_per_mesh == 1), None)
    for name in names:
        if sh.pp == 1 and name != single:
            continue  # one stage: every one-stage-per-mesh schedule is the same run
        for v in virtual_options(name, sh.pp, num_layers, sh.m):
            if v > 1 and (sh.layouts or sh.uneven):
                continue  # virtual stages on uniform meshes with an even split only
            out.append((name, v))
    return out
