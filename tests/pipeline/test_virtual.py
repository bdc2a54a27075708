"""Virtual stages (several stages per mesh): interleaved 1F1B, its eager variant, ZB-H1 and ZB-V.

Pure: generated, lowered, validated and simulated on CPU (the runtime runs them:
`test_runtime_virtual.py`; start-up checks and deadlock freedom per allowed microbatch count:
`test_virtual_config.py`).
"""
from __future__ import annotations

import itertools

import pytest

from megareshard.pipeline import (Action, ActionKind, Costs, PipelineGraph, Schedule, ScheduleError, generate,
                                  get_schedule, lower, placement_of, schedule_names, simulate, validate)

K = ActionKind
VIRTUAL = [n for n in schedule_names() if get_schedule(n).warmup is None]


def test_registry_lists_every_kind() -> None:
    assert set(schedule_names()) == {"gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b", "eager-interleaved-1f1b", "zb-h1",
                             "zbv"}
    assert placement_of("zbv", 3) == (0, 1, 2, 2, 1, 0)
    assert placement_of("interleaved-1f1b", 2, 3) == (0, 1, 0, 1, 0, 1)


def test_every_virtual_schedule_validates_after_lowering() -> None:
    n = 0
    for name in VIRTUAL:
        kind = get_schedule(name)
        for P, V, delay in itertools.product(range(1, 6), (2, 3), (False, True)):
            if kind.stages_per_mesh and V != kind.stages_per_mesh and V == 3:
                continue
            for m in range(1, 11):
                if kind.microbatch_multiple_of_pp and m % P:
                    continue
                s = generate(name, P, m, delay, virtual_stages=None if kind.stages_per_mesh else V)
                validate(s)
                low = lower(s)
                validate(low)
                assert Schedule.loads(low.dumps()) == low and Schedule.from_csv(low.to_csv()) == low
                n += 1
    assert n > 150


def test_interleaved_follows_megatrons_warmup() -> None:
    P, V, m = 4, 2, 8
    s = generate("interleaved-1f1b", P, m, virtual_stages=V)
    for p, acts in enumerate(s.actions):
        first_b = next(i for i, a in enumerate(acts) if a.kind == K.B)
        assert first_b == 2 * (P - p - 1) + (V - 1) * P + 1  # Megatron's warm-up, then its first forward
        assert {a.stage for a in acts} == {p, p + P}
        # forwards go through the chunks in groups of P microbatches, backwards through them in reverse
        fw = [(a.stage, a.mb) for a in acts if a.kind == K.F][:2 * P]
        assert fw == [(p, j) for j in range(P)] + [(p + P, j) for j in range(P)]
    all_f = generate("interleaved-1f1b", P, P, virtual_stages=V)  # m = P: every forward first
    assert all(acts[P * V].kind == K.B for acts in all_f.actions)
    with pytest.raises(ValueError, match="6 microbatches are not a multiple of the 4 pipeline stages"):
        generate("interleaved-1f1b", 4, 6)


def test_fewer_bubbles_at_the_same_compute() -> None:
    """No communication, the work of a mesh the same in every schedule (a chunk costs 1/V of a stage):
    interleaving and the zero-bubble schedules shrink 1F1B's bubble."""
    P, m = 4, 8
    bubble = {}
    for name, dw in (("1f1b", False), ("1f1b", True), ("interleaved-1f1b", False), ("zb-h1", True), ("zbv", True)):
        s = generate(name, P, m, dw)
        V = s.num_stages // P
        bubble[name, dw] = simulate(s, costs=Costs(f=1 / V, b=2 / V)).bubble_fraction
    assert bubble["1f1b", False] == pytest.approx((P - 1) / (m + P - 1))
    assert bubble["interleaved-1f1b", False] < bubble["1f1b", False]
    assert bubble["zb-h1", True] <= bubble["1f1b", True]
    assert bubble["zbv", True] < bubble["interleaved-1f1b", False] < bubble["1f1b", False]


def test_zero_bubble_keeps_1f1b_memory() -> None:
    P, m = 4, 12
    peak_1f1b = simulate(generate("1f1b", P, m), costs=Costs()).peak_activations
    assert simulate(generate("zb-h1", P, m), costs=Costs()).peak_activations == peak_1f1b
    # zbv: 2P live chunks per mesh, each half a stage: 1F1B's first-stage memory everywhere
    assert max(simulate(generate("zbv", P, m), costs=Costs()).peak_activations) <= 2 * P


def test_zbv_turn_is_a_local_hand_off() -> None:
    P = 3
    low = lower(generate("zbv", P, 4))
    turn = [e for e in low.graph.edges if e.src == P - 1 and e.dst == P][0]
    assert low.is_local(turn)
    assert not any(a.edge == turn for acts in low.actions for a in acts)
    # a local consumer before its producer is refused
    bad = Schedule(PipelineGraph(2), 1, [[Action(K.F, 0, 1), Action(K.F, 0, 0), Action(K.B, 0, 1),
                                          Action(K.B, 0, 0)]], placement=(0, 0))
    with pytest.raises(ScheduleError, match=r"F0@1 before F0@0, the local producer of edge 0->1"):
        validate(lower(bad))
