"""Sharding specs (`S1,S0,R`) and the local region each rank holds.

Uneven dimensions split like `torch.tensor_split` (the first shards are one larger), so
layouts that Alpa rejects (it asserts even splits) are still describable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .mesh import Mesh

# Tokens and the mesh axes they shard over, major axis first.
_TOKENS: dict[str, tuple[int, ...]] = {"R": (), "S0": (0,), "S1": (1,), "S01": (0, 1), "S10": (1, 0)}
_NAMES: dict[tuple[int, ...], str] = {v: k for k, v in _TOKENS.items()}


class ShardingSpec:
    """Immutable, hashable: per tensor dim, the mesh axes it is sharded over (major first)."""

    __slots__ = ("_entries",)

    def __init__(self, entries: Iterable[Iterable[int]]) -> None:
        ents = tuple(tuple(int(a) for a in e) for e in entries)
        seen: dict[int, int] = {}
        for dim, e in enumerate(ents):
            if e not in _NAMES:
                raise ValueError(
                    f"dim {dim}: mesh axes {e} are not a sharding; allowed: "
                    + ", ".join(f"{k}={v}" for k, v in _TOKENS.items())
                )
            for a in e:
                if a in seen:
                    raise ValueError(
                        f"mesh axis {a} is used twice (dims {seen[a]} and {dim}) in spec "
                        + ",".join(_NAMES[x] for x in ents)
                    )
                seen[a] = dim
        object.__setattr__(self, "_entries", ents)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ShardingSpec is immutable")

    def __reduce__(self):
        return (ShardingSpec, (self._entries,))

    @property
    def entries(self) -> tuple[tuple[int, ...], ...]:
        return self._entries

    @property
    def ndim(self) -> int:
        return len(self._entries)

    @classmethod
    def parse(cls, text: str) -> "ShardingSpec":
        """Parse `"S1,S0,R"`; tokens are R, S0, S1, S01, S10 (case-insensitive)."""
        if not text or not text.strip():
            raise ValueError("empty sharding spec: expected comma-separated R/S0/S1/S01/S10")
        entries = []
        for pos, raw in enumerate(text.split(",")):
            tok = raw.strip().upper()
            if tok not in _TOKENS:
                raise ValueError(
                    f"bad token {raw.strip()!r} at position {pos} of spec {text!r}; "
                    f"allowed: {', '.join(_TOKENS)}"
                )
            entries.append(_TOKENS[tok])
        return cls(entries)

    def num_shards(self, mesh: Mesh, dim: int) -> int:
        n = 1
        for a in self._entries[dim]:
            n *= mesh.shape[a]
        return n

    def shard_index(self, mesh: Mesh, dim: int, coords: tuple[int, int]) -> int:
        """Which shard of `dim` the device at `coords` holds (major axis first)."""
        idx = 0
        for a in self._entries[dim]:
            idx = idx * mesh.shape[a] + coords[a]
        return idx

    def check(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Validate `shape` against this spec; returns the shape as a tuple of ints."""
        shp = check_shape(shape)
        if len(shp) != self.ndim:
            raise ValueError(
                f"spec {self} has {self.ndim} entries but the tensor has {len(shp)} dims (shape {shp})"
            )
        return shp

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingSpec):
            return NotImplemented
        return self._entries == other._entries

    def __hash__(self) -> int:
        return hash(self._entries)

    def __str__(self) -> str:
        return ",".join(_NAMES[e] for e in self._entries)

    def __repr__(self) -> str:
        return f"ShardingSpec.parse({str(self)!r})"


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A tensor shape with at least one dim and every dim >= 1."""
    shp = tuple(int(s) for s in shape)
    if not shp:
        raise ValueError("cannot reshard a 0-dim tensor (shape ())")
    for d, s in enumerate(shp):
        if s < 1:
            raise ValueError(f"shape {shp} has size {s} at dim {d}; every dim must be >= 1")
    return shp


def split_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each part of `length` split like torch.tensor_split."""
    q, r = divmod(length, parts)
    out = []
    start = 0
    for k in range(parts):
        stop = start + q + (1 if k < r else 0)
        out.append((start, stop))
        start = stop
    return out


def local_slices(
    shape: Sequence[int], mesh: Mesh, spec: ShardingSpec, rank: int
) -> tuple[slice, ...] | None:
    """Slices of the global tensor that `rank` holds, or None if `rank` is not in `mesh`.

    Shards may be empty (slice(k, k)) when a dim is split over more devices than its size.
    """
    shp = spec.check(shape)
    coords = mesh.coords(rank)
    if coords is None:
        return None
    out = []
    for d, length in enumerate(shp):
        n = spec.num_shards(mesh, d)
        q, r = divmod(length, n)
        k = spec.shard_index(mesh, d, coords)
        start = k * q + min(k, r)
        out.append(slice(start, start + q + (1 if k < r else 0)))
    return tuple(out)
