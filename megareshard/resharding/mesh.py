"""Device meshes: a 2-D array of global ranks, each rank living on a host.

The planner works at host granularity (one NIC per host is the bottleneck, paper §3),
so a mesh carries the rank -> host map alongside the rank grid.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Union

HostMap = Union[Mapping[int, int], Sequence[int]]

_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


class Mesh:
    """An immutable, hashable 2-D mesh of global ranks with their hosts.

    Two meshes are equal when they have the same rank grid and the same host for every
    rank, so meshes can key plan caches.
    """

    __slots__ = ("_ranks", "_flat", "_hosts", "_coords", "_host_of")

    def __init__(self, ranks: Sequence[Sequence[int]], hosts: HostMap) -> None:
        rows = tuple(tuple(int(r) for r in row) for row in ranks)
        if not rows or not rows[0]:
            raise ValueError("a mesh needs at least one rank (got an empty rank grid)")
        width = len(rows[0])
        for i, row in enumerate(rows):
            if len(row) != width:
                raise ValueError(
                    f"mesh rows must have equal length: row 0 has {width} ranks, row {i} has {len(row)}"
                )
        flat = tuple(r for row in rows for r in row)
        if len(set(flat)) != len(flat):
            dup = sorted({r for r in flat if flat.count(r) > 1})
            raise ValueError(f"mesh lists rank(s) {dup} more than once")
        if min(flat) < 0:
            raise ValueError(f"mesh ranks must be >= 0, got {min(flat)}")
        host_of: dict[int, int] = {}
        for r in flat:
            try:
                host_of[r] = int(hosts[r])
            except (KeyError, IndexError):
                n = len(hosts)
                raise ValueError(f"rank {r} has no host (the host map covers {n} ranks)") from None
        object.__setattr__(self, "_ranks", rows)
        object.__setattr__(self, "_flat", flat)
        object.__setattr__(self, "_hosts", tuple(host_of[r] for r in flat))
        object.__setattr__(
            self, "_coords", {r: (i, j) for i, row in enumerate(rows) for j, r in enumerate(row)}
        )
        object.__setattr__(self, "_host_of", host_of)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Mesh is immutable")

    def __reduce__(self):
        # rebuild through __init__ (slots + a raising __setattr__ defeat default pickling)
        return (Mesh, (self._ranks, self._host_of))

    # --- basic views -------------------------------------------------------------------
    @property
    def ranks(self) -> tuple[tuple[int, ...], ...]:
        return self._ranks

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self._ranks), len(self._ranks[0]))

    @property
    def flat_ranks(self) -> tuple[int, ...]:
        """Ranks in row-major order."""
        return self._flat

    @property
    def size(self) -> int:
        return len(self._flat)

    def __contains__(self, rank: object) -> bool:
        return rank in self._host_of

    def host_of(self, rank: int) -> int:
        try:
            return self._host_of[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not in mesh {self} (ranks {list(self._flat)})") from None

    def coords(self, rank: int) -> tuple[int, int] | None:
        return self._coords.get(rank)

    def host_ids(self) -> tuple[int, ...]:
        """Distinct hosts of the mesh, in order of first appearance (row-major)."""
        return tuple(dict.fromkeys(self._hosts))

    def ranks_on_host(self, host: int) -> tuple[int, ...]:
        return tuple(r for r, h in zip(self._flat, self._hosts) if h == host)

    # --- construction ------------------------------------------------------------------
    @classmethod
    def grid(
        cls, num_hosts: int, devices_per_host: int, first_rank: int = 0, first_host: int = 0
    ) -> "Mesh":
        """The usual `HxD` mesh: row h is host `first_host + h` with D consecutive ranks."""
        if num_hosts < 1 or devices_per_host < 1:
            raise ValueError(
                f"a grid mesh needs >= 1 host and >= 1 device per host, got {num_hosts}x{devices_per_host}"
            )
        ranks = [
            [first_rank + h * devices_per_host + d for d in range(devices_per_host)]
            for h in range(num_hosts)
        ]
        hosts = {r: first_host + h for h, row in enumerate(ranks) for r in row}
        return cls(ranks, hosts)

    @classmethod
    def parse(cls, text: str, first_rank: int = 0, first_host: int = 0) -> "Mesh":
        """Parse `"2x4"` (2 hosts x 4 devices) into `Mesh.grid(2, 4, ...)`."""
        m = _SHAPE_RE.match(text)
        if not m:
            raise ValueError(f"cannot parse mesh {text!r}: expected HOSTSxDEVICES such as '2x4'")
        return cls.grid(int(m.group(1)), int(m.group(2)), first_rank, first_host)

    # --- dunder ------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._ranks == other._ranks and self._hosts == other._hosts

    def __hash__(self) -> int:
        return hash((self._ranks, self._hosts))

    def __str__(self) -> str:
        m0, m1 = self.shape
        return f"{m0}x{m1}"

    def __repr__(self) -> str:
        return f"Mesh(ranks={[list(r) for r in self._ranks]}, hosts={dict(self._host_of)})"
