"""ParallelContext: the one explicit object holding this process's parallel state.

No module-level globals (Megatron's ``parallel_state`` getters are what we avoid): code
that needs a group receives the context. All process groups are created eagerly, in
one global order, identical on every rank — lazily created communicators in
rank-dependent order are a classic source of deadlocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .stage_topology import StageTopology
from .topology import RankCoords, Topology

# Group families, in creation order. Each maps to the axes along which members differ.
_FAMILIES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "mp": ("tp", "pp"),       # model parallel: together they hold one full model replica
    "stage": ("tp", "dp"),    # all ranks of one pipeline stage (SageMaker's DP_GROUP)
}


@dataclass
class ParallelContext:
    """Process groups and rank queries for one process of a (tp, dp, pp) layout.

    The topology is a uniform `Topology` or a `StageTopology` (every stage its own tp, dp):
    then ``tp_size`` / ``dp_size`` are this rank's stage's, and the ``pp`` / ``mp`` groups
    are the whole world (see `sum_over_model_parallel`).
    """

    topology: Topology | StageTopology
    rank: int
    groups: dict[str, object] = field(default_factory=dict, repr=False)
    group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def create(cls, topology: Topology, *, expert_model_parallel_size: int = 1,
               expert_tensor_parallel_size: int | None = None) -> "ParallelContext":
        """Collective over the default group: every rank must call it, with the same topology.

        ``expert_model_parallel_size`` (ep) and ``expert_tensor_parallel_size`` (etp, default tp): the expert
        groups ``ep``, ``etp``, ``edp``, ``etp_ep`` (parallel/expert_topology.py), created after the others in the
        same global order; a family equal to an existing one (etp = tp, edp = dp at ep 1) reuses its groups, so
        the defaults create no communicator more than before."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelContext.create needs torch.distributed initialised first "
                               "(torchrun sets it up through megareshard.training or dist.init_process_group)")
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(f"the process group has {world} ranks but the topology describes "
                             f"{topology.world_size} ({topology.describe()})")
        ctx = cls(topology=topology, rank=dist.get_rank())
        # middle pipeline stages belong to no embedding group
        ctx.groups["embedding"], ctx.group_ranks["embedding"] = None, ()
        families = {name: topology.groups(axes) for name, axes in _FAMILIES.items()}
        families["embedding"] = topology.embedding_groups()
        # Every rank walks every group of every family in the same order; new_group is
        # collective over the default group even for ranks that are not members.
        for name, all_groups in families.items():
            for members in all_groups:
                handle = dist.new_group(list(members))
                if ctx.rank in members:
                    ctx.groups[name] = handle
                    ctx.group_ranks[name] = members
        ctx._create_expert_groups(families, expert_model_parallel_size, expert_tensor_parallel_size)
        return ctx

    def _create_expert_groups(self, families: dict, ep: int, etp: int | None) -> None:
        from .expert_topology import EXPERT_FAMILIES, check_expert_layout, expert_groups

        etp = self.topology.tp if etp is None and not self.per_stage_layouts else etp
        if self.per_stage_layouts and ep == 1 and etp is None:
            fams = {"ep": [(r,) for r in range(self.world_size)], "etp": families["tp"], "edp": families["dp"],
                    "etp_ep": families["tp"]}
        else:
            check_expert_layout(self.topology, ep, etp)
            fams = expert_groups(self.topology, ep, etp)
        for name in EXPERT_FAMILIES:
            all_groups = fams[name]
            same = next((f for f in ("tp", "dp") if list(families[f]) == list(all_groups)), None)
            if same is not None:
                self.groups[name], self.group_ranks[name] = self.groups[same], self.group_ranks[same]
                continue
            for members in all_groups:
                handle = None if len(members) == 1 else dist.new_group(list(members))
                if self.rank in members:
                    self.groups[name], self.group_ranks[name] = handle, members

    def destroy(self) -> None:
        """Destroy every communicator `create` made for this rank (each once). A process that builds
        contexts one after another (the planner's validation, tests) must: gloo keeps each group's
        worker threads and connections until then, and they slow the later runs down. Every rank calls it,
        after the last operation on these groups has completed."""
        for g in {id(g): g for g in self.groups.values() if g is not None}.values():
            dist.destroy_process_group(g)
        self.groups = {name: None for name in self.groups}

    @classmethod
    def single_process(cls) -> "ParallelContext":
        """A context for one process without torch.distributed (reference runs, tools)."""
        topo = Topology(world_size=1)
        ranks = {name: (0,) for name in (*_FAMILIES, "embedding", "ep", "etp", "edp", "etp_ep")}
        return cls(topology=topo, rank=0, groups={name: None for name in ranks}, group_ranks=ranks)

    # ---- coordinates --------------------------------------------------------------
    @property
    def coords(self) -> RankCoords:
        return self.topology.coords(self.rank)

    def tp_rank(self) -> int:
        return self.coords.tp

    def pp_rank(self) -> int:
        return self.coords.pp

    def dp_rank(self) -> int:
        return self.coords.dp

    def mp_rank(self) -> int:
        """Rank inside the model-parallel (tp × pp) group."""
        return self.group_ranks["mp"].index(self.rank)

    def rdp_rank(self) -> int:
        """SageMaker's reduced-data-parallel rank: same as our ``dp_rank``."""
        return self.dp_rank()

    def smp_dp_rank(self) -> int:
        """SageMaker's ``dp_rank``: rank among all ranks of the same pipeline stage."""
        return self.group_ranks["stage"].index(self.rank)

    # ---- sizes and groups -------------------------------------------------------------
    @property
    def per_stage_layouts(self) -> bool:
        """True when stages may have different (tp, dp) (a `StageTopology`)."""
        return getattr(self.topology, "per_stage", False)

    @property
    def tp_size(self) -> int:
        if self.per_stage_layouts:
            return self.topology.tp_of(self.pp_rank())
        return self.topology.tp

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    @property
    def dp_size(self) -> int:
        if self.per_stage_layouts:
            return self.topology.dp_of(self.pp_rank())
        return self.topology.dp

    def sum_over_model_parallel(self, value) -> None:
        """In place: sum a per-rank partial (e.g. a squared gradient norm) over tp and pp, once per dp replica.

        ``value`` must already be identical over this rank's dp group (reduced over dp, or
        computed from dp-reduced gradients). Uniform layouts: all-reduce over the tp × pp
        group. Per-stage layouts: stages have different dp sizes, so only dp rank 0 of every
        stage contributes and the sum runs over the world — each element counted once.
        """
        if self.per_stage_layouts:
            if self.world_size > 1:
                if self.dp_rank() != 0:
                    value.zero_()
                dist.all_reduce(value)
        elif self.tp_size * self.pp_size > 1:
            dist.all_reduce(value, group=self.mp_group)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    # ---- expert parallelism (parallel/expert_topology.py); a context without them reads as ep 1, etp = tp ----
    def _expert(self, name: str, fallback: str | None) -> tuple[object, tuple[int, ...]]:
        if name in self.group_ranks:
            return self.groups.get(name), self.group_ranks[name]
        if fallback is None:
            return None, (self.rank,)
        return self.groups.get(fallback), self.group_ranks.get(fallback, (self.rank,))

    @property
    def ep_size(self) -> int:
        return len(self._expert("ep", None)[1])

    @property
    def etp_size(self) -> int:
        return len(self._expert("etp", "tp")[1])

    @property
    def edp_size(self) -> int:
        return len(self._expert("edp", "dp")[1])

    def ep_rank(self) -> int:
        return self._expert("ep", None)[1].index(self.rank)

    def etp_rank(self) -> int:
        return self._expert("etp", "tp")[1].index(self.rank)

    def edp_rank(self) -> int:
        return self._expert("edp", "dp")[1].index(self.rank)

    @property
    def ep_group(self):
        """The ranks that split the experts between them (the dispatcher's all-to-all)."""
        return self._expert("ep", None)[0]

    @property
    def etp_group(self):
        """The ranks that split each expert's width (expert tensor parallelism)."""
        return self._expert("etp", "tp")[0]

    @property
    def edp_group(self):
        """The replicas of this rank's expert shards: expert gradients are reduced here only."""
        return self._expert("edp", "dp")[0]

    @property
    def etp_ep_group(self):
        """etp × ep ranks, ep-major (Megatron's ``tp_ep`` group: the all-gather dispatcher, token counts)."""
        return self._expert("etp_ep", "tp")[0]

    @property
    def etp_ep_size(self) -> int:
        return len(self._expert("etp_ep", "tp")[1])

    @property
    def tp_group(self):
        return self.groups["tp"]

    @property
    def pp_group(self):
        return self.groups["pp"]

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def mp_group(self):
        return self.groups["mp"]

    @property
    def stage_group(self):
        return self.groups["stage"]

    @property
    def embedding_group(self):
        """First + last stage of this pipeline (tied embeddings); None on middle stages."""
        return self.groups["embedding"]

    def is_first_stage(self) -> bool:
        return self.pp_rank() == 0

    def is_last_stage(self) -> bool:
        return self.pp_rank() == self.pp_size - 1

    def stage_neighbour(self, offset: int) -> int | None:
        """Global rank of the same (tp, dp) position ``offset`` stages away, or None past the ends."""
        pp = self.pp_rank() + offset
        if not 0 <= pp < self.pp_size:
            return None
        c = self.coords
        return self.topology.rank_of(tp=c.tp, dp=c.dp, pp=pp)
