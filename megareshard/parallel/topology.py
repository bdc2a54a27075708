"""Rank placement: global rank <-> (pp, dp, tp) coordinates and hosts. Pure Python.

An *order string* such as ``tp-dp-pp`` lists the parallel axes from innermost (stride 1)
to outermost, like Megatron-Core's ``RankGenerator``: with ``tp-dp-pp`` consecutive
ranks differ in tp, so a tp group sits inside one host whenever tp divides the number
of processes per host.

The default order is chosen by communication volume (docs/design.md §1, after Narayanan
et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM"): the axis that moves the most bytes per Transformer layer goes innermost,
on the fast intra-host links.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

AXES = ("tp", "dp", "pp")
DEFAULT_ORDER = ("tp", "dp", "pp")


class TopologyError(ValueError):
    """An impossible or inconsistent parallel layout; the message names the numbers."""


def parse_order(order: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``"tp-dp-pp"`` -> ``("tp", "dp", "pp")``; every axis exactly once."""
    tokens = tuple(t.strip().lower() for t in (order.split("-") if isinstance(order, str) else order))
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise TopologyError(f"unknown axis {unknown[0]!r} in order {'-'.join(tokens)!r}; "
                            f"the axes are {', '.join(AXES)}")
    if sorted(tokens) != sorted(AXES):
        missing = [a for a in AXES if a not in tokens]
        repeated = sorted({t for t in tokens if tokens.count(t) > 1})
        why = (f"missing {', '.join(missing)}" if missing else "") + \
              ("; " if missing and repeated else "") + (f"repeated {', '.join(repeated)}" if repeated else "")
        raise TopologyError(f"order {'-'.join(tokens)!r} must name each of tp, dp, pp exactly once ({why})")
    return tokens


@dataclass(frozen=True)
class CommVolume:
    """Bytes-ish moved per Transformer layer per step by each parallel axis (docs/design.md §1).

    TP: 4 collectives of b·s·h activations forward and backward -> 8·b·s·h;
    DP: one all-reduce of the 12·h² layer weights, ring cost ~ 16·h² (rounded as in docs/design.md §1), plus,
    with expert parallelism (ep > 1: the expert groups are cut from the data-parallel ranks, as Megatron-LM's),
    the MoE layers' token all-to-alls — dispatch and combine, forward and backward, top-k copies of each
    token: 4·k·b·s·h per MoE layer, times the share ``moe_share`` of the layers that are MoE;
    PP: the b·s·h activation forward and its gradient backward -> 2·b·s·h.
    An axis of degree 1 moves nothing.
    """

    tp: float
    dp: float
    pp: float

    @classmethod
    def for_gpt(cls, hidden_size: int, seq_length: int, micro_batch_size: int,
                tp: int = 2, dp: int = 2, pp: int = 2, *, ep: int = 1, topk: int = 0,
                moe_share: float = 0.0) -> "CommVolume":
        bsh = micro_batch_size * seq_length * hidden_size
        a2a = 4.0 * topk * bsh * moe_share if ep > 1 else 0.0
        return cls(tp=8.0 * bsh if tp > 1 else 0.0,
                   dp=(16.0 * hidden_size ** 2 if dp > 1 else 0.0) + a2a,
                   pp=2.0 * bsh if pp > 1 else 0.0)

    def order(self) -> tuple[str, ...]:
        """Axes by decreasing volume (innermost first); ties keep the tp, dp, pp order."""
        return tuple(sorted(AXES, key=lambda a: (-getattr(self, a), AXES.index(a))))

    def describe(self) -> str:
        parts = [f"{a}={getattr(self, a):.3g}" for a in self.order()]
        return "per-layer volume " + " > ".join(parts) + f" -> order {'-'.join(self.order())}"


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits."""

    rank: int
    host: int
    local_rank: int
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Topology:
    """A uniform (tp, dp, pp) layout of ``world_size`` ranks over hosts of ``nproc_per_node``."""

    world_size: int
    tp: int = 1
    pp: int = 1
    nproc_per_node: int | None = None
    order: tuple[str, ...] = DEFAULT_ORDER
    keep_tp_in_host: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", parse_order(self.order))
        if self.nproc_per_node is None:
            object.__setattr__(self, "nproc_per_node", self.world_size)
        for name in ("world_size", "tp", "pp", "nproc_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size % (self.tp * self.pp):
            raise TopologyError(f"world size {self.world_size} is not divisible by tp {self.tp} × pp {self.pp} "
                                f"= {self.tp * self.pp}")
        if self.world_size % self.nproc_per_node:
            raise TopologyError(f"world size {self.world_size} is not a multiple of nproc-per-node "
                                f"{self.nproc_per_node} (every host runs the same number of processes)")
        if self.keep_tp_in_host:
            if self.nproc_per_node % self.tp:
                raise TopologyError(f"tp {self.tp} does not divide nproc-per-node {self.nproc_per_node}, "
                                    "so a tensor-parallel group cannot stay inside one host")
            if self.order[0] != "tp" and self.tp > 1:
                raise TopologyError(f"order {'-'.join(self.order)} does not put tp innermost, so tensor-parallel "
                                    "groups would span hosts; use an order starting with tp")

    # ---- sizes -------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.nproc_per_node

    def degree(self, axis: str) -> int:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp}[axis]

    @cached_property
    def strides(self) -> dict[str, int]:
        strides, s = {}, 1
        for axis in self.order:
            strides[axis] = s
            s *= self.degree(axis)
        return strides

    # ---- rank <-> coordinates -----------------------------------------------------
    def rank_of(self, *, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        coords = {"tp": tp, "dp": dp, "pp": pp}
        for axis, c in coords.items():
            if not 0 <= c < self.degree(axis):
                raise TopologyError(f"{axis} coordinate {c} is outside 0..{self.degree(axis) - 1}")
        return sum(coords[a] * self.strides[a] for a in AXES)

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside 0..{self.world_size - 1}")
        c = {a: (rank // self.strides[a]) % self.degree(a) for a in AXES}
        return RankCoords(rank=rank, host=rank // self.nproc_per_node, local_rank=rank % self.nproc_per_node,
                          tp=c["tp"], dp=c["dp"], pp=c["pp"])

    # ---- groups ---------------------------------------------------------------------
    def groups(self, axes: str | tuple[str, ...]) -> list[tuple[int, ...]]:
        """All groups in which ranks differ only along ``axes`` (e.g. ``"tp"`` or ``("tp", "pp")``).

        Each group is sorted by global rank; groups are listed in order of their first rank,
        which is the same on every process (groups must be created in one global order).
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        fixed = [a for a in AXES if a not in axes]
        out = []
        for fixed_coords in itertools.product(*(range(self.degree(a)) for a in fixed)):
            base = dict(zip(fixed, fixed_coords))
            members = []
            for var_coords in itertools.product(*(range(self.degree(a)) for a in axes)):
                members.append(self.rank_of(**base, **dict(zip(axes, var_coords))))
            out.append(tuple(sorted(members)))
        return sorted(out)

    def group_of(self, axes: str | tuple[str, ...], rank: int) -> tuple[int, ...]:
        c = self.coords(rank)
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        fixed = {a: getattr(c, a) for a in AXES if a not in axes}
        members = [self.rank_of(**fixed, **dict(zip(axes, v)))
                   for v in itertools.product(*(range(self.degree(a)) for a in axes))]
        return tuple(sorted(members))

    def embedding_groups(self) -> list[tuple[int, ...]]:
        """First and last pipeline stage of every pipeline group (tied embeddings sync here)."""
        out = []
        for g in self.groups("pp"):
            first = next(r for r in g if self.coords(r).pp == 0)
            last = next(r for r in g if self.coords(r).pp == self.pp - 1)
            out.append(tuple(sorted({first, last})))
        return sorted(out)

    # ---- the SageMaker model parallelism library's names ----------------------------------
    def mp_rank(self, rank: int) -> int:
        """Rank inside the model-parallel (tp × pp) group, ordered by global rank."""
        return self.group_of(("tp", "pp"), rank).index(rank)

    def stage_dp_rank(self, rank: int) -> int:
        """SageMaker's ``dp_rank``: rank among all ranks of the same pipeline stage (tp × dp)."""
        return self.group_of(("tp", "dp"), rank).index(rank)

    def hosts_of(self, ranks: tuple[int, ...]) -> set[int]:
        return {r // self.nproc_per_node for r in ranks}

    # ---- printing ---------------------------------------------------------------------------
    def records(self, sagemaker: bool = False) -> list[dict[str, int]]:
        out = []
        for r in range(self.world_size):
            c = self.coords(r)
            if sagemaker:
                out.append({"rank": r, "host": c.host, "local_rank": c.local_rank, "pp_rank": c.pp,
                            "tp_rank": c.tp, "rdp_rank": c.dp, "dp_rank": self.stage_dp_rank(r),
                            "mp_rank": self.mp_rank(r)})
            else:
                out.append({"rank": r, "host": c.host, "local_rank": c.local_rank, "tp_rank": c.tp,
                            "pp_rank": c.pp, "dp_rank": c.dp, "mp_rank": self.mp_rank(r)})
        return out

    def describe(self) -> str:
        return (f"world {self.world_size} = tp {self.tp} × dp {self.dp} × pp {self.pp} on {self.num_hosts} "
                f"host(s) × {self.nproc_per_node} proc(s), order {'-'.join(self.order)} (innermost first)")

    def table(self, sagemaker: bool = False) -> str:
        return format_rank_table(self.describe(), self.records(sagemaker))


def format_rank_table(title: str, records: list[dict[str, int]]) -> str:
    """``title`` over a right-aligned table of per-rank records (the rank map)."""
    cols = list(records[0].keys())
    widths = [max(len(c), *(len(str(r[c])) for r in records)) for c in cols]
    lines = [title, "  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)) for r in records]
    return "\n".join(lines)


def hosts_spanned(topo: Topology, axes: str | tuple[str, ...]) -> int:
    """Largest number of hosts any group of ``axes`` spans (1 = every group inside a host)."""
    return max(len(topo.hosts_of(g)) for g in topo.groups(axes))
