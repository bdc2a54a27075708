"""Extra cost terms (`planner/terms.py`): the planner applies what a caller gives, in order, to every estimate and
simulated step; with none a plan is its own (pure: no processes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from megareshard.planner import ClusterSpec, CostTerm, ModelShape, TermInput, TermStep, plan_layouts
from megareshard.planner.terms import register_cost_term

MODEL = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
CLUSTER = ClusterSpec(hosts=2, devices_per_host=2, device_memory_gib=4.0, device_tflops=0.05, nic_gbps=1.0,
                      intra_gbps=20.0)
KW = dict(micro_batches=(1, 2), zero_stages=(0,), recompute_options=(False,), runtime_only=True, keep=None)


@register_cost_term
@dataclass
class PerAction:
    """A toy term: `seconds` per compute action a rank of the busiest mesh runs (F and B, or F, I and W), as a
    slow host's runtime would add; the bottleneck past `dominates` of the step."""

    seconds: float
    name: str = "actions"
    dominates: float = 0.5
    seen: list[tuple] = field(default_factory=list)

    def measure(self, at: TermInput) -> float:
        self.seen.append((id(at.shape), at.placement, at.delay_wgrad))
        per_mesh = [len(g) for g in at.shape.per_mesh(at.placement)]
        return at.shape.m * max(per_mesh) * (3 if at.delay_wgrad else 2)

    def apply(self, step_s: float, quantity: float, at: TermInput) -> TermStep:
        extra = quantity * self.seconds
        return TermStep(step_s + extra, {f"{self.name} (toy)": extra},
                        "the toy term" if extra > self.dominates * (step_s + extra) else None)


def _actions(c) -> int:
    """The toy term's quantity of a candidate: its microbatches × stages per mesh × actions per stage."""
    return c.num_microbatches * (len(c.stage_f_s) // c.pp) * (3 if c.delay_wgrad else 2)


def test_terms_apply_to_the_simulated_steps_in_order() -> None:
    plain = {c.name: c for c in plan_layouts(MODEL, CLUSTER, 8, top_shapes=3, **KW)}
    assert all(c.terms == {} for c in plain.values())
    small, big = PerAction(1e-4), PerAction(1.0, name="slow")
    terms: list[CostTerm] = [small, big]
    ranked = plan_layouts(MODEL, CLUSTER, 8, top_shapes=3, terms=terms, **KW)
    assert small.seen == big.seen  # both measured, in the order given
    simulated = [c for c in ranked if c.breakdown]
    assert len(simulated) > 1
    for c in simulated:
        q = _actions(c)
        assert c.terms == {"actions": q, "slow": q}
        assert c.breakdown["actions (toy)"] == q * 1e-4 and c.breakdown["slow (toy)"] == q * 1.0
        assert c.bottleneck == "the toy term"  # a second per action dominates these millisecond steps
        p = plain.get(c.name)
        if p is not None and p.breakdown:  # simulated without the terms too: the same step, then each term
            assert c.step_s == (p.step_s + q * 1e-4) + q * 1.0
            assert {k: v for k, v in c.breakdown.items() if "toy" not in k} == p.breakdown
    # the ranking follows the terms: the fewest actions per step first
    assert ranked[0].terms["slow"] == min(c.terms["slow"] for c in simulated)


def test_terms_apply_to_the_estimates_measured_once_per_shape() -> None:
    """Nothing simulated (top_shapes 0): every candidate is its estimate with the terms; a term measures once per
    shape × placement × delayed W, not once per resharding strategy."""
    plain = {c.name: c for c in plan_layouts(MODEL, CLUSTER, 8, top_shapes=0, **KW)}
    one, three = PerAction(1e-3), PerAction(1e-3)
    ranked = plan_layouts(MODEL, CLUSTER, 8, top_shapes=0, terms=[three], **KW)
    plan_layouts(MODEL, CLUSTER, 8, top_shapes=0, strategies=("allgather",), terms=[one], **KW)
    assert len(three.seen) == len(one.seen) < len(ranked) and any(c.pp > 1 for c in ranked)
    assert {c.name for c in ranked} == set(plain)
    for c in ranked:
        assert not c.breakdown and c.terms == {} and c.step_s == c.estimate_s
        assert c.estimate_s == plain[c.name].estimate_s + _actions(c) * 1e-3


def test_no_terms_is_the_plain_plan() -> None:
    def seen(ranked):
        return [(c.name, c.step_s, c.estimate_s, c.breakdown, c.bottleneck, c.terms) for c in ranked]

    assert seen(plan_layouts(MODEL, CLUSTER, 8, top_shapes=3, terms=(), **KW)) == seen(
        plan_layouts(MODEL, CLUSTER, 8, top_shapes=3, **KW))
