"""The collectives around the pipeline, costed per step (pure): the tied word embedding's gradient all-reduce
between the first and the last stage, and the one-element all-reduces every training step ends with.

`sh` is a layout of the search (`shapes.py`'s `_Shape`: tp, pp, dp, the topology or per-stage layouts).
"""
from __future__ import annotations

import functools
from typing import Any

from ..pipeline.meshes import stage_mesh
from .costs import ClusterSpec, ModelShape, collective_latency

__all__ = ["tied_embedding_s", "step_sync_s"]


def tied_embedding_s(model: ModelShape, cluster: ClusterSpec, sh: Any, first_mesh: int, last_mesh: int,
                     cache: dict[tuple, Any]) -> float:
    """The tied word embedding's gradient all-reduce between the first and the last stage, as the trainer runs
    it: Megatron's rank pairs on uniform meshes, one full-table ring on per-stage meshes. 0 with untied
    embeddings or when one mesh holds both ends (one stage, or zbv's V)."""
    if model.untied or first_mesh == last_mesh:
        return 0.0
    key = ("tied", sh.layouts or (sh.tp, sh.pp, sh.order), first_mesh, last_mesh)
    if key not in cache:
        src, dst = stage_mesh(sh.topo, first_mesh), stage_mesh(sh.topo, last_mesh)
        cache[key] = (_tied_ring_s if sh.layouts else _tied_pairs_s)(model, cluster, sh, src, dst)
    return cache[key]


def _tied_pairs_s(model: ModelShape, cluster: ClusterSpec, sh: Any, src: Any, dst: Any) -> float:
    """Uniform meshes (Megatron's embedding group: rank k of the first stage's mesh with rank k of the last's):
    a ring of two moves the V·h/tp fp32 gradient once each way; a host's NIC carries it for every pair that
    leaves the host."""
    nbytes = 4 * model.vocab_size * model.hidden_size / sh.tp  # uniform: every mesh has tp ranks per row
    out_of: dict[int, float] = {}
    inside = False
    for a, b in zip((r for row in src.ranks for r in row), (r for row in dst.ranks for r in row)):
        ha, hb = src.host_of(a), dst.host_of(b)
        if ha == hb:
            inside = True
        else:
            out_of[ha] = out_of.get(ha, 0.0) + nbytes
            out_of[hb] = out_of.get(hb, 0.0) + nbytes
    t = (max(out_of.values()) / cluster.nic_Bps + cluster.collective_latency_s + 2 * cluster.nic_latency_s
         if out_of else 0.0)
    if inside:
        t = max(t, nbytes / cluster.intra_Bps + cluster.collective_latency_s + 2 * cluster.intra_latency_s)
    return t


def _tied_ring_s(model: ModelShape, cluster: ClusterSpec, sh: Any, src: Any, dst: Any) -> float:
    """Per-stage meshes (`reduce_tied_grad_across_layouts`): one ring over all the ranks of both stages, in rank
    order, of the full V·h fp32 table; a host's NIC carries 2·(n−1)/n of it per ring edge leaving the host."""
    host = {r: m.host_of(r) for m in (src, dst) for row in m.ranks for r in row}
    ring = sorted(host)
    n = len(ring)
    per_edge = 2 * (n - 1) / n * 4 * model.vocab_size * model.hidden_size
    leaving: dict[int, int] = {}
    for i, r in enumerate(ring):
        if host[r] != host[ring[(i + 1) % n]]:
            leaving[host[r]] = leaving.get(host[r], 0) + 1
    t = per_edge / cluster.intra_Bps + cluster.collective_latency_s + 2 * (n - 1) * cluster.intra_latency_s
    if leaving:
        t = max(t, max(leaving.values()) * per_edge / cluster.ring_nic_Bps(n) + cluster.collective_latency_s
                + 2 * (n - 1) * cluster.nic_latency_s)
    return t


def step_sync_s(cluster: ClusterSpec, sh: Any) -> float:
    """The one-element all-reduces every training step ends with, as the trainer issues them (latency alone):
    the loss over the pipeline group (pp > 1), the gradient norm over the model-parallel group (tp × pp), the
    non-finite check over the world, the loss's mean over the data-parallel group (dp > 1); with per-stage
    meshes the loss and the norm go over the world and the mean is not needed. Each pays
    `collective_latency` at the slowest link it crosses."""
    world = collective_latency(cluster, cluster.world, cluster.hosts > 1)
    if sh.layouts:  # the loss (pp > 1), the norm and the check, each over the world
        return world * (3 if sh.pp > 1 else 2)
    def group(axes: tuple[str, ...]) -> float:
        return collective_latency(cluster, *_group_span(sh.topo, axes))

    t = world  # the non-finite check
    if sh.pp > 1:
        t += group(("pp",))
    t += group(("tp", "pp"))
    if sh.dp > 1:
        t += group(("dp",))
    return t


@functools.lru_cache(maxsize=4096)
def _group_span(topo: Any, axes: tuple[str, ...]) -> tuple[int, bool]:
    """(size, whether it spans hosts) of rank 0's group over `axes` (the search asks for one topology's
    groups thousands of times)."""
    g = topo.group_of(axes, 0)
    return len(g), len(topo.hosts_of(g)) > 1
