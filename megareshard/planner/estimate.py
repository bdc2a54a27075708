"""The search's analytic side (pure, no simulation): memory per mesh and the pre-rank's step estimate.

``_memory`` (GiB per mesh: static state, live activations, logits) prunes; ``_estimate`` ranks, from
``_estimate_parts`` (compute per microbatch and the data-parallel reduction at the slowest mesh) and
``_edge_bound``, a quick bound on the slowest stage-boundary transfer over the mesh boundaries of
``_boundaries`` (also what `search._edge_seconds` plans the resharding of).
"""
from __future__ import annotations

from typing import Any

from ..pipeline.meshes import stage_mesh
from ..pipeline.schedules import get_schedule
from ..resharding import get_strategy
from .costs import ClusterSpec, ModelShape
from .shapes import _Shape


def _boundaries(sh: _Shape, cache: dict[tuple, list]) -> list[tuple[int, int, tuple, Any, Any]]:
    """Every mesh boundary i -> i+1 with its host pattern (the two meshes' host grids, hosts renamed in order
    of appearance: boundaries with one pattern cost the same) and the two meshes."""
    key = ("boundaries", sh.layouts or (sh.tp, sh.pp, sh.order))
    if key not in cache:
        out = []
        for i in range(sh.pp - 1):
            src, dst = stage_mesh(sh.topo, i), stage_mesh(sh.topo, i + 1)
            names: dict[int, int] = {}
            pattern = tuple(tuple(names.setdefault(m.host_of(r), len(names)) for r in row)
                            for m in (src, dst) for row in m.ranks)
            out.append((i, i + 1, (src.shape, dst.shape, pattern), src, dst))
        cache[key] = out
    return cache[key]


def _edge_bound(model: ModelShape, cluster: ClusterSpec, sh: _Shape, strategy: str,
                cache: dict[tuple, Any]) -> float:
    """A quick estimate of the slowest stage-boundary transfer for the pre-rank (no resharding plan): every
    receiving host takes the rows (dp slices) of the tensor its ranks hold through its NIC (each tp rank
    its own copy under sendrecv without sequence parallelism), the sending hosts share the total."""
    if sh.pp == 1:
        return 0.0
    copies = get_strategy(strategy).copy_per_receiver and not sh.sp
    key = ("bound", sh.layouts or (sh.tp, sh.pp, sh.order), copies)
    if key not in cache:  # (share of the tensor through the busiest NIC, True if any NIC) of the worst boundary
        worst = (0.0, False)
        for i, j, pattern, src, dst in _boundaries(sh, cache):
            src_hosts = set(src.host_ids())
            need: dict[int, float] = {}
            for row in dst.ranks:
                hosts = [dst.host_of(r) for r in row]
                for h in set(hosts):
                    need[h] = need.get(h, 0.0) + (hosts.count(h) if copies else 1) / len(dst.ranks)
            remote = {h: x for h, x in need.items() if h not in src_hosts}
            share = (max(max(remote.values()), sum(remote.values()) / len(src_hosts)), True) if remote else \
                (max(need.values()), False)
            if (share[1], share[0]) > (worst[1], worst[0]):
                worst = share
        cache[key] = worst
    share, nic = cache[key]
    max_dp = max(d for _, d in sh.mesh_layouts())
    nbytes = model.seq_length * sh.b * max_dp * model.hidden_size * model.dtype_bytes
    # + at least one message's latency (the simulation counts the plan's messages)
    return share * nbytes / (cluster.nic_Bps if nic else cluster.intra_Bps) + \
        (cluster.nic_latency_s if nic else cluster.intra_latency_s)


def _mesh_static(sh: _Shape, placement: tuple[int, ...]) -> list[tuple[float, float]]:
    """Per mesh: (static + extra bytes of its stages, the largest activation of one of its stages)."""
    return [(sum(st.static_bytes + st.extra_bytes for st in g), max(st.activation_bytes_per_mb for st in g))
            for g in sh.per_mesh(placement)]


def _memory(sh: _Shape, placement: tuple[int, ...], live: list[int]) -> list[float]:
    """GiB per mesh: its stages' static state, `live` activations of its largest stage, the logits."""
    return [(a + k * x) / 2**30 for (a, x), k in zip(_mesh_static(sh, placement), live)]


def _estimate_parts(sh: _Shape, overhead: float = 0.0, post: float = 0.0) -> tuple[float, float]:
    """(one mesh's compute per microbatch at its slowest, with `overhead` per F and B action and, pipelined,
    `post` per stage (a send and a receive posted: what every mesh's stage posts at least), its data-parallel
    reduction and optimizer step at their slowest)."""
    groups = sh.per_mesh(tuple(s % sh.pp for s in range(len(sh.stages))))
    post = post if sh.pp > 1 else 0.0
    fb = max(sum(st.forward_s + st.backward_s + 2 * overhead + post for st in g) for g in groups)
    return fb, max(sum(st.dp_seconds + st.optimizer_s for st in g) for g in groups)


def _estimate(sh: _Shape, parts: tuple[float, float], edge_s: float, schedule: str) -> float:
    fb, dp = parts
    fill = (sh.pp - 1) * fb / (sh.virtual * (2 if get_schedule(schedule).zero_bubble else 1))
    # every mesh sends (and receives) one activation and one gradient per microbatch for each of its stages
    # whose neighbour lies on another mesh: V of them under interleaving and in zbv's V
    return max(sh.m * fb, 2 * sh.m * sh.virtual * edge_s) + fill + dp
