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
"""
from __future__ import annotations

from .topology import Topology, TopologyError

__all__ = ["EXPERT_FAMILIES", "check_expert_layout", "expert_coords", "expert_groups"]

EXPERT_FAMILIES = ("ep", "etp", "edp", "etp_ep")
_KEY = {"ep": ("pp", "etp", "edp"), "etp": ("pp", "ep", "edp"), "edp": ("pp", "etp", "ep"), "etp_ep": ("pp", "edp")}


def check_expert_layout(topology, ep: int, etp: int) -> None:
    """One line with the numbers when ``ep × etp`` cannot tile a stage's ``tp × dp`` ranks."""
    for name, v in (("expert-model-parallel-size", ep), ("expert-tensor-parallel-size", etp)):
        if not isinstance(v, int) or v < 1:
            raise TopologyError(f"{name} must be a positive integer, got {v!r}")
    if ep == 1 and etp == getattr(topology, "tp", None):
        return
    if getattr(topology, "per_stage", False):
        raise TopologyError(f"expert parallelism (ep {ep}, etp {etp}) with per-stage layouts is not supported; "
                            "use a uniform layout")
    tp, dp = topology.tp, topology.dp
    if (tp * dp) % (ep * etp):
        raise TopologyError(f"expert-model-parallel-size {ep} × expert-tensor-parallel-size {etp} = {ep * etp} does "
                            f"not divide the {tp * dp} ranks of a pipeline stage (tp {tp} × dp {dp})")
    order = tuple(topology.order)
    if tp > 1 and dp > 1 and order.index("dp") < order.index("tp"):
        raise TopologyError(f"expert parallelism needs tp placed inside dp (rank order {'-'.join(order)} puts dp "
                            "inside tp); use an order with tp before dp, e.g. tp-dp-pp")


def expert_coords(topology: Topology, rank: int, ep: int, etp: int) -> dict[str, int]:
    """``{"pp", "etp", "ep", "edp"}`` of ``rank`` in the expert grid."""
    c = topology.coords(rank)
    j = c.dp * topology.tp + c.tp
    return {"pp": c.pp, "etp": j % etp, "ep": (j // etp) % ep, "edp": j // (etp * ep)}


def expert_groups(topology: Topology, ep: int, etp: int) -> dict[str, list[tuple[int, ...]]]:
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
