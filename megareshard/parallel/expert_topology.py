"""Expert parallelism's layout inside a pipeline stage (Megatron-Core's expert rank generator). Pure Python.

The ``tp × dp`` ranks of a stage are numbered ``j = dp · tp_size + tp`` (Megatron's ``tp-dp`` order, which
our default placement ``tp-dp-pp`` also gives physically) and re-read as the expert grid
``etp`` innermost, then ``ep``, then ``edp``::

    etp = j % ETP,   ep = (j // ETP) % EP,   edp = j // (ETP · EP)

Megatron-Core's ``RankGenerator(tp=ETP, ep=EP, dp=EDP, order="tp-ep-dp-pp")`` over the same ranks. With
``ETP == tp`` an expert-tensor group is the tensor-parallel group, an expert-parallel group runs along dp
(consecutive dp ranks), and the expert-data-parallel group holds the replicas of the same experts, over
which expert gradients are reduced (and over nothing else).

Group families (members sorted by global rank, groups by first member — one global creation order):

* ``ep``     — same pp, etp, edp: the ranks that split the experts between them (the all-to-all);
* ``etp``    — same pp, ep, edp: the ranks that split each expert's width (column/row parallel);
* ``edp``    — same pp, etp, ep: the replicas of the same expert shards (gradient reduction);
* ``etp_ep`` — same pp, edp: ``ETP × EP`` ranks, ep-major (the all-gather dispatcher, the token counts).

A group's rank order (torch sorts a group's members) must be its grid order; that holds when tp sits
inside dp in the placement order (``tp`` before ``dp`` in ``--rank-order``), or one of them is 1.

Per-stage layouts (``StageTopology``: every stage its own tp × dp, tp innermost in its block) read each stage's
ranks the same way with the stage's own tp, one ep for the model and ``ETP`` given or, when None, each stage's
tp; ``EDP`` is then per stage too (a stage's ranks / (ETP · EP)).
"""
from __future__ import annotations

from .topology import Topology, TopologyError

__all__ = ["EXPERT_FAMILIES", "check_expert_layout", "expert_coords", "expert_groups"]

EXPERT_FAMILIES = ("ep", "etp", "edp", "etp_ep")
_KEY = {"ep": ("pp", "etp", "edp"), "etp": ("pp", "ep", "edp"), "edp": ("pp", "etp", "ep"), "etp_ep": ("pp", "edp")}


def _stage_tp(topology, stage: int) -> int:
    return topology.tp_of(stage) if getattr(topology, "per_stage", False) else topology.tp


def _stage_dp(topology, stage: int) -> int:
    return topology.dp_of(stage) if getattr(topology, "per_stage", False) else topology.dp


def check_expert_layout(topology, ep: int, etp: int | None) -> None:
    """One line with the numbers when ``ep × etp`` cannot tile a stage's ``tp × dp`` ranks (``etp`` None: each
    stage's tp)."""
    for name, v in (("expert-model-parallel-size", ep), ("expert-tensor-parallel-size", etp)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise TopologyError(f"{name} must be a positive integer, got {v!r}")
    per_stage = getattr(topology, "per_stage", False)
    for stage in range(topology.pp if per_stage else 1):
        tp, dp = _stage_tp(topology, stage), _stage_dp(topology, stage)
        e = tp if etp is None else etp
        if ep == 1 and e == tp:
            continue
        if (tp * dp) % (ep * e):
            where = f"stage {stage} (tp {tp} × dp {dp})" if per_stage else f"a pipeline stage (tp {tp} × dp {dp})"
            raise TopologyError(f"expert-model-parallel-size {ep} × expert-tensor-parallel-size {e} = {ep * e} does "
                                f"not divide the {tp * dp} ranks of {where}")
        order = tuple(getattr(topology, "order", ("tp", "dp", "pp")))
        if tp > 1 and dp > 1 and order.index("dp") < order.index("tp"):
            raise TopologyError(f"expert parallelism needs tp placed inside dp (rank order {'-'.join(order)} puts dp "
                                "inside tp); use an order with tp before dp, e.g. tp-dp-pp")


def expert_coords(topology, rank: int, ep: int, etp: int | None) -> dict[str, int]:
    """``{"pp", "etp", "ep", "edp"}`` of ``rank`` in the expert grid (``etp`` None: its stage's tp)."""
    c = topology.coords(rank)
    tp = _stage_tp(topology, c.pp)
    e = tp if etp is None else etp
    j = c.dp * tp + c.tp
    return {"pp": c.pp, "etp": j % e, "ep": (j // e) % ep, "edp": j // (e * ep)}


def expert_groups(topology: Topology, ep: int, etp: int | None) -> dict[str, list[tuple[int, ...]]]:
    """Every group of every expert family (`EXPERT_FAMILIES` order), members sorted, groups by first member."""
    check_expert_layout(topology, ep, etp)
    coords = [expert_coords(topology, r, ep, etp) for r in range(topology.world_size)]
    out: dict[str, list[tuple[int, ...]]] = {}
    for fam in EXPERT_FAMILIES:
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r, c in enumerate(coords):
            buckets.setdefault(tuple(c[a] for a in _KEY[fam]), []).append(r)
        out[fam] = sorted(tuple(sorted(m)) for m in buckets.values())
    return out
