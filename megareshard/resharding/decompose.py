"""Decompose a cross-mesh resharding into unit tasks (paper §2.2, appendix B).

Per tensor dim, the cut points of all source and destination shards split the dim into
intervals; the cartesian product of the intervals gives data slices, each held whole by
some source ranks and needed whole by some destination ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import prod
from typing import Sequence

from .mesh import Mesh
from .spec import ShardingSpec, local_slices


@dataclass
class UnitTask:
    """One data slice and who has / needs it.

    A destination rank that also holds the slice as a source (overlapping meshes) is
    still listed as a receiver; the executor copies locally when it is the sender.
    """

    index: int  # position in decomposition order
    slice: tuple[slice, ...]  # region of the global tensor
    senders: tuple[int, ...]  # source ranks holding the whole region (sorted)
    receivers: tuple[int, ...]  # destination ranks needing it (sorted)
    sender: int | None = None  # chosen sending rank (set by the scheduler)
    nbytes: int = 0  # numel(slice) * itemsize
    chunks: int = 1  # K of its pipelined broadcast chain (set by the planner; 1 unless broadcast)

    @property
    def numel(self) -> int:
        return prod(s.stop - s.start for s in self.slice)


def _regions(shape: tuple[int, ...], mesh: Mesh, spec: ShardingSpec) -> dict[int, list[tuple[int, int]]]:
    out = {}
    for r in mesh.flat_ranks:
        sl = local_slices(shape, mesh, spec, r)
        assert sl is not None
        out[r] = [(s.start, s.stop) for s in sl]
    return out


def decompose(
    shape: Sequence[int],
    src_mesh: Mesh,
    src_spec: ShardingSpec,
    dst_mesh: Mesh,
    dst_spec: ShardingSpec,
    itemsize: int = 4,
) -> list[UnitTask]:
    """Unit tasks in row-major order of their slices (empty shards produce no task)."""
    shp = src_spec.check(shape)
    dst_spec.check(shp)
    src = _regions(shp, src_mesh, src_spec)
    dst = _regions(shp, dst_mesh, dst_spec)
    tasks: list[UnitTask] = []
    for sl, senders, receivers in cells(shp, src, dst):
        # every element is held by some source rank: the source shards tile the tensor
        assert senders, "source layout does not cover the tensor"
        tasks.append(UnitTask(index=len(tasks), slice=sl, senders=tuple(sorted(senders)),
                              receivers=tuple(sorted(receivers)), nbytes=prod(s.stop - s.start for s in sl) * itemsize))
    return tasks


Region = Sequence[tuple[int, int]]


def cells(shape: Sequence[int], src: dict[int, Region], dst: dict[int, Region]):
    """The cut-point decomposition (paper §2.2) over regions, each rank's box as one ``(start, stop)`` per dim: per
    dim the cut points of every source and destination region split it; yields ``(slices, holders, needers)`` for
    each cell, in row-major order, that some destination region contains (``holders`` may be empty where the
    sources do not cover it: the caller says what that means)."""
    intervals: list[list[tuple[int, int]]] = []
    holders: list[list[frozenset[int]]] = []  # per dim, per interval: src ranks containing it
    needers: list[list[frozenset[int]]] = []  # per dim, per interval: dst ranks containing it
    for d, length in enumerate(shape):
        cuts = {0, length}
        for regs in (src, dst):
            for reg in regs.values():
                cuts.update(reg[d])
        pts = sorted(cuts)
        ivs = [(a, b) for a, b in zip(pts, pts[1:]) if b > a]
        intervals.append(ivs)
        holders.append([frozenset(r for r, reg in src.items() if reg[d][0] <= a and b <= reg[d][1]) for a, b in ivs])
        needers.append([frozenset(r for r, reg in dst.items() if reg[d][0] <= a and b <= reg[d][1]) for a, b in ivs])
    for combo in product(*(range(len(iv)) for iv in intervals)):
        receivers = frozenset.intersection(*(needers[d][k] for d, k in enumerate(combo))) if combo else frozenset()
        if receivers:
            yield (tuple(slice(*intervals[d][k]) for d, k in enumerate(combo)),
                   frozenset.intersection(*(holders[d][k] for d, k in enumerate(combo))), receivers)
