"""Per-stage layouts: every pipeline stage has its own (tp, dp). Pure Python.

``--stage-layouts "tp1dp4,tp2dp2,tp2dp2,tp1dp4"`` gives one ``tpXdpY`` entry per stage.
Placement (docs/design.md §1, by volume): stage ``i`` occupies a *contiguous* block of
``tp_i × dp_i`` ranks starting after the previous stage's block (so stages sit on
consecutive hosts and the pipeline axis is outermost), and inside its block tp is
innermost (stride 1) then dp::

    rank = offset_i + dp · tp_i + tp

Group families (the same names as the uniform `Topology`, so `ParallelContext` builds
from either):

* ``tp``    — one stage, one dp coordinate, all tp ranks;
* ``dp``    — one stage, one tp coordinate, all dp ranks (each stage's dp group reduces
  its own gradients);
* ``stage`` — all ranks of one stage;
* ``pp`` and ``mp`` — with stages of different shapes there is no "one rank per stage"
  group, so both are the whole world: every cross-stage reduction (pipeline loss,
  gradient norm) is a world all-reduce in which each quantity is contributed exactly once
  (see `ParallelContext.sum_over_model_parallel`);
* ``embedding`` — the ranks of the first and the last stage together (the tied word
  embedding's gradient is exchanged there, resharded between the two tp layouts).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from .topology import RankCoords, TopologyError, format_rank_table

__all__ = ["StageTopology", "parse_stage_layouts"]

_ENTRY = re.compile(r"tp(\d+)dp(\d+)")


def parse_stage_layouts(text: str) -> tuple[tuple[int, int], ...]:
    """``"tp1dp4,tp2dp2"`` -> ``((1, 4), (2, 2))``; every entry ``tp<N>dp<M>`` with N, M >= 1."""
    entries = [t.strip().lower() for t in str(text).split(",")]
    out = []
    for i, t in enumerate(entries):
        m = _ENTRY.fullmatch(t)
        if not m:
            raise TopologyError(f"--stage-layouts {text!r}: entry {i} {t!r} is not of the form tp<N>dp<M> "
                                "(e.g. tp2dp2); give one entry per pipeline stage, comma-separated")
        tp, dp = int(m[1]), int(m[2])
        if tp < 1 or dp < 1:
            raise TopologyError(f"--stage-layouts {text!r}: entry {i} {t!r} needs tp >= 1 and dp >= 1")
        out.append((tp, dp))
    return tuple(out)


@dataclass(frozen=True)
class StageTopology:
    """Pipeline stages with their own (tp, dp), on contiguous rank blocks, tp innermost."""

    world_size: int
    layouts: tuple[tuple[int, int], ...]
    nproc_per_node: int | None = None

    per_stage = True  # marker: ParallelContext and the pipeline runtime branch on it

    def __post_init__(self) -> None:
        lay = self.layouts
        if isinstance(lay, str):
            lay = parse_stage_layouts(lay)
        lay = tuple((int(t), int(d)) for t, d in lay)
        object.__setattr__(self, "layouts", lay)
        if not lay:
            raise TopologyError("--stage-layouts needs at least one stage")
        if self.nproc_per_node is None:
            object.__setattr__(self, "nproc_per_node", self.world_size)
        total = sum(t * d for t, d in lay)
        if total != self.world_size:
            parts = " + ".join(f"{t}×{d}" for t, d in lay)
            raise TopologyError(f"--stage-layouts {self.spec()}: the stages need {parts} = {total} ranks but the "
                                f"world size is {self.world_size}")
        if self.world_size % self.nproc_per_node:
            raise TopologyError(f"world size {self.world_size} is not a multiple of nproc-per-node "
                                f"{self.nproc_per_node} (every host runs the same number of processes)")

    # ---- sizes --------------------------------------------------------------------------
    def spec(self) -> str:
        return ",".join(f"tp{t}dp{d}" for t, d in self.layouts)

    @property
    def pp(self) -> int:
        return len(self.layouts)

    def tp_of(self, stage: int) -> int:
        return self.layouts[stage][0]

    def dp_of(self, stage: int) -> int:
        return self.layouts[stage][1]

    @property
    def max_dp(self) -> int:
        return max(d for _, d in self.layouts)

    @property
    def tp(self) -> int:
        """The largest stage tp (for messages; ask `tp_of` for a stage's own)."""
        return max(t for t, _ in self.layouts)

    @property
    def dp(self) -> int:
        """The largest stage dp: the global microbatch is micro batch × this."""
        return self.max_dp

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.nproc_per_node

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, o = [], 0
        for t, d in self.layouts:
            out.append(o)
            o += t * d
        return tuple(out)

    # ---- rank <-> coordinates ------------------------------------------------------------------
    def rank_of(self, *, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        if not 0 <= pp < self.pp:
            raise TopologyError(f"pp coordinate {pp} is outside 0..{self.pp - 1}")
        t, d = self.layouts[pp]
        if not 0 <= tp < t or not 0 <= dp < d:
            raise TopologyError(f"(tp {tp}, dp {dp}) is outside stage {pp}'s tp{t}dp{d}")
        return self.offsets[pp] + dp * t + tp

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside 0..{self.world_size - 1}")
        pp = max(i for i, o in enumerate(self.offsets) if o <= rank)
        t = self.layouts[pp][0]
        local = rank - self.offsets[pp]
        return RankCoords(rank=rank, host=rank // self.nproc_per_node, local_rank=rank % self.nproc_per_node,
                          tp=local % t, dp=local // t, pp=pp)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        t, d = self.layouts[stage]
        return tuple(range(self.offsets[stage], self.offsets[stage] + t * d))

    # ---- groups ---------------------------------------------------------------------------------
    def groups(self, axes: str | tuple[str, ...]) -> list[tuple[int, ...]]:
        """Groups of a family (see the module docstring), sorted, in one order on every process."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        key = frozenset(axes)
        if "pp" in key:
            return [tuple(range(self.world_size))]
        out = []
        for s, (t, d) in enumerate(self.layouts):
            if key == {"tp"}:
                out += [tuple(self.rank_of(tp=i, dp=j, pp=s) for i in range(t)) for j in range(d)]
            elif key == {"dp"}:
                out += [tuple(self.rank_of(tp=i, dp=j, pp=s) for j in range(d)) for i in range(t)]
            elif key == {"tp", "dp"}:
                out.append(self.stage_ranks(s))
            else:
                raise TopologyError(f"unknown group family {axes}")
        return sorted(tuple(sorted(g)) for g in out)

    def group_of(self, axes: str | tuple[str, ...], rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups(axes) if rank in g)

    def embedding_groups(self) -> list[tuple[int, ...]]:
        """The first and last stage's ranks together (one group; the stage itself when pp is 1)."""
        return [tuple(sorted(set(self.stage_ranks(0)) | set(self.stage_ranks(self.pp - 1))))]

    def hosts_of(self, ranks: tuple[int, ...]) -> set[int]:
        return {r // self.nproc_per_node for r in ranks}

    def mp_rank(self, rank: int) -> int:
        return rank

    def stage_dp_rank(self, rank: int) -> int:
        return rank - self.offsets[self.coords(rank).pp]

    # ---- printing -------------------------------------------------------------------------------
    def records(self, sagemaker: bool = False) -> list[dict[str, int]]:
        out = []
        for r in range(self.world_size):
            c = self.coords(r)
            out.append({"rank": r, "host": c.host, "local_rank": c.local_rank, "pp_rank": c.pp,
                        "tp_rank": c.tp, "dp_rank": c.dp, "stage_tp": self.tp_of(c.pp), "stage_dp": self.dp_of(c.pp)})
        return out

    def describe(self) -> str:
        stages = ", ".join(f"stage {i} tp{t}×dp{d} ranks {self.offsets[i]}..{self.offsets[i] + t * d - 1}"
                           for i, (t, d) in enumerate(self.layouts))
        return (f"world {self.world_size} in {self.pp} stage(s) with their own layouts ({stages}) on "
                f"{self.num_hosts} host(s) × {self.nproc_per_node} proc(s); tp innermost inside each stage")

    def table(self, sagemaker: bool = False) -> str:
        return format_rank_table(self.describe(), self.records(sagemaker))
