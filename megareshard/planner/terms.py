"""Extra cost terms: what the caller of `plan_layouts` adds to a candidate's step that the planner's own model
does not have (pure).

The planner's model (`costs.py`, the schedule simulator, the resharding planner) is that of a real cluster:
every host with its own cores, devices and NIC. A cluster that breaks one of those assumptions — the lab's
emulated cluster, whose hosts share one machine's few cores (`lab/cluster/shared_cpu.py`) — brings its own
term; the planner applies the terms it is given, in order, and none by default. A term sees one candidate
(`TermInput`) and does two things:

* `measure`: its quantity for the candidate, worked out once per shape × placement × delayed weight
  gradients (not per resharding strategy), and recorded in `Candidate.terms` under the term's `name`;
* `apply`: the step with the term, from the step without it and that quantity. The search applies it to the
  analytic estimate that pre-ranks the shapes and decides which are simulated (a term that can make a step
  slower makes its estimate slower too, or the search would simulate the wrong shapes) and to the simulated
  step that ranks the best ones; for the latter the term also names the breakdown entries of what it adds
  and, where it dominates, the candidate's bottleneck.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config.fields import ConfigError
from ..registry import Registry
from .costs import ClusterSpec, ModelShape

__all__ = ["TermInput", "TermStep", "CostTerm", "COST_TERMS", "register_cost_term", "check_terms"]


@dataclass(frozen=True)
class TermInput:
    """One candidate as a cost term sees it (read-only)."""

    model: ModelShape
    cluster: ClusterSpec
    shape: Any
    """The search's shape: ``tp``, ``pp``, ``dp``, ``b`` (micro batch), ``m`` (microbatches), ``virtual``,
    ``topo`` (its `Topology` or `StageTopology`), ``stages`` (one `StageCosts` per pipeline stage),
    ``mesh_layouts()`` ((tp, dp) per mesh), ``per_mesh(placement)`` (each mesh's stages), ``layouts`` and
    ``order`` (what identifies its rank placement)."""
    placement: tuple[int, ...]
    """The mesh of every pipeline stage (the schedule's: round robin when interleaved, zbv's V)."""
    delay_wgrad: bool
    """Delayed weight gradients: every backward runs as two compute actions (I and W)."""
    cache: dict[tuple, Any]
    """A dict shared by one `plan_layouts` call, for what a term works out once per plan (key it by the term)."""


@dataclass(frozen=True)
class TermStep:
    """A step with a term applied."""

    step_s: float
    """The step's seconds with the term."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Entries the term adds to the candidate's breakdown (what it added, by cause)."""
    bottleneck: str | None = None
    """The candidate's bottleneck where the term is it (None: the planner's own stands)."""


class CostTerm(Protocol):
    """A cost the planner's model leaves out (module docstring)."""

    name: str
    """The key of its quantity in `Candidate.terms`."""

    def measure(self, at: TermInput) -> float:
        """The term's quantity for this candidate (the lab's shared cores: the step's CPU seconds)."""
        ...

    def apply(self, step_s: float, quantity: float, at: TermInput) -> TermStep:
        """The step of `step_s` seconds without the term, with it."""
        ...


#: the kinds of cost term (their classes), by the name their class gives its terms (a term's ``name``, the key of
#: its quantity in ``Candidate.terms``; one kind may make terms of other names): the one registry rule
#: (`megareshard.registry`). `plan_layouts` takes terms of registered kinds only.
COST_TERMS: Registry[type] = Registry("cost term", key=lambda kind: getattr(kind, "name", ""))


def register_cost_term(kind: type) -> type:
    """Register a cost term's class (its default ``name`` a class attribute); returns it, so it can decorate."""
    return COST_TERMS.register(kind)


def check_terms(terms: Any) -> None:
    """Every term is of a registered kind (a ConfigError naming it and listing the registered kinds else)."""
    kinds = COST_TERMS.items()
    for term in terms:
        if not isinstance(term, kinds):
            raise ConfigError(f"unknown cost term {term.name!r} (a {type(term).__name__}); registered: "
                              f"{', '.join(COST_TERMS.names()) or 'none'} (planner.terms.register_cost_term)")
