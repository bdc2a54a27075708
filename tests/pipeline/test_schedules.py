"""Pure pipeline engine: IR text form, generators, lowering, validator, simulator.

No processes, no torch.distributed; the whole file runs in a few seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megareshard.pipeline import (
    Action,
    ActionKind,
    Costs,
    Edge,
    PipelineGraph,
    Schedule,
    ScheduleError,
    forwards_before_first_backward,
    generate,
    get_schedule,
    lower,
    parse_action,
    schedule_names,
    simulate,
    validate,
)

WARMUP_SCHEDULES = tuple(n for n in schedule_names() if get_schedule(n).warmup is not None)  # one stage per mesh
from megareshard.pipeline.validate import dry_run

ROOT = Path(__file__).resolve().parents[2]
K = ActionKind


def _graph(P: int, skip: bool) -> PipelineGraph:
    return PipelineGraph(P, [(0, P - 1, "skip")] if skip and P > 2 else [])


# ------------------------------------------------------------------------- IR / text
def test_action_text_round_trip():
    e = Edge(0, 3, "skip")
    cases = [
        (Action(K.F, 3, 1), "F3"), (Action(K.W, 0, 2), "W0"), (Action(K.I, 5, 0), "I5"),
        (Action(K.SEND_F, 3, 0, edge=Edge(0, 1)), "SF3->1"),
        (Action(K.RECV_F, 3, 1, edge=Edge(0, 1)), "RF3<-0"),
        (Action(K.WAIT_B, 2, 0, edge=Edge(0, 1)), "WB2<-1"),
        (Action(K.SEND_B, 2, 3, edge=e), "SB2->0:skip"),
        (Action(K.RECV_F, 4, 3, edge=e), "RF4<-0:skip"),
    ]
    for a, text in cases:
        assert str(a) == text
        assert parse_action(text, a.stage) == a


def test_bad_action_text_and_edges():
    with pytest.raises(ScheduleError, match="cannot parse"):
        parse_action("X3", 0)
    with pytest.raises(ScheduleError, match="sends use"):
        parse_action("SF3<-1", 0)
    with pytest.raises(ScheduleError, match="src < dst"):
        Edge(2, 1)
    with pytest.raises(ScheduleError, match="does not exist"):
        PipelineGraph(3, [(0, 5)])
    with pytest.raises(ScheduleError, match="runs on stage 1"):
        Action(K.RECV_F, 0, 0, edge=Edge(0, 1))


def test_graph_edges():
    g = PipelineGraph(4, [(0, 3)])
    assert [str(e) for e in g.edges] == ["0->1", "0->3:skip0_3", "1->2", "2->3"]
    assert [str(e) for e in g.in_edges(3)] == ["0->3:skip0_3", "2->3"]
    assert g.out_edges(3) == ()


@pytest.mark.parametrize("name", WARMUP_SCHEDULES)
@pytest.mark.parametrize("delay", [False, True])
def test_dumps_loads_and_csv_round_trip(tmp_path, name, delay):
    s = lower(generate(name, 4, 6, delay, graph=_graph(4, True)))
    assert Schedule.loads(s.dumps()) == s
    assert Schedule.from_csv(s.to_csv()) == s
    for fn in ("s.txt", "s.csv"):
        s.save(tmp_path / fn)
        assert Schedule.load(tmp_path / fn) == s
    assert s.dumps().splitlines()[3].startswith("stage 0: ")


# ------------------------------------------------------------------------ generators
def test_generator_shapes():
    s = generate("1f1b", 4, 6)
    assert s.dumps().splitlines()[2:] == [
        "stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "stage 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "stage 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "stage 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    e = generate("eager-1f1b", 3, 6)
    assert " ".join(map(str, e.actions[0])) == "F0 F1 F2 F3 F4 B0 F5 B1 B2 B3 B4 B5"
    g = generate("gpipe", 2, 3)
    assert " ".join(map(str, g.actions[1])) == "F0 F1 F2 B0 B1 B2"
    d = generate("1f1b", 3, 4, delay_wgrad=True)
    # W(mb) runs right before the next compute that waits on a receive.
    assert " ".join(map(str, d.actions[1])) == "F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3"
    assert " ".join(map(str, d.actions[0])) == "F0 F1 F2 I0 F3 W0 I1 W1 I2 W2 I3 W3"


def test_generator_errors():
    with pytest.raises(ValueError, match="gpipe, 1f1b, eager-1f1b, interleaved-1f1b, eager-interleaved-1f1b, "
                                         "zb-h1, zbv"):
        generate("zero-bubble", 4, 8)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        generate("1f1b", 4, 0)
    with pytest.raises(ValueError, match="graph has 3 stages"):
        generate("1f1b", 4, 8, graph=PipelineGraph(3))


def test_every_generated_schedule_validates_after_lowering():
    """name x delay x P in 1..6 x m in 1..12, with and without a skip edge 0->P-1."""
    n = 0
    for name in WARMUP_SCHEDULES:
        for delay in (False, True):
            for skip in (False, True):
                for P in range(1, 7):
                    for m in range(1, 13):
                        s = generate(name, P, m, delay, graph=_graph(P, skip))
                        validate(s)
                        validate(lower(s))
                        n += 1
    assert n == 3 * 2 * 2 * 6 * 12


@pytest.mark.parametrize("name", WARMUP_SCHEDULES)
def test_rendezvous_safe_lowering(name):
    """A synchronous matched-pair executor (send blocks until the receive is posted):
    chain-only lowering with lookahead 1 is safe; skip edges need the per-edge
    lookahead that `rendezvous_safe` finds, and plain lookahead 1 is not enough."""
    for P in (2, 4, 6):
        for m in (1, 5, 12):
            for skip in (False, True):
                s = generate(name, P, m, True, graph=_graph(P, skip))
                validate(lower(s, rendezvous_safe=True), rendezvous=True)
                if not skip:
                    validate(lower(s), rendezvous=True)
    s = generate("eager-1f1b", 4, 8, graph=_graph(4, True))
    with pytest.raises(ScheduleError, match=r"deadlock \(rendezvous sends\)"):
        validate(lower(s), rendezvous=True)


def test_rendezvous_safe_lowering_raises_when_no_lookahead_helps():
    """Stage 0 runs B0 before F0: its backward waits for a gradient that needs its own
    forward first. No receive lookahead can fix that; the lowering says so and names the
    stuck actions instead of returning a schedule it knows deadlocks."""
    g = PipelineGraph(2, [])
    s = Schedule(g, 1, [[Action(K.B, 0, 0), Action(K.F, 0, 0)], [Action(K.F, 0, 1), Action(K.B, 0, 1)]])
    with pytest.raises(ScheduleError) as err:
        lower(s, rendezvous_safe=True)
    msg = str(err.value)
    assert "whatever the receive lookahead" in msg and "2 stage(s) stay stuck" in msg
    assert "stage 0 step 1: WB0<-1 waits for SB0->0 on stage 1" in msg, msg
    assert "stage 1 step 1: WF0<-0 waits for SF0->1 on stage 0" in msg, msg


def test_lowered_ir_guarantees():
    """Sends right after the producer, waits right before the consumer, FIFO posts."""
    s = lower(generate("eager-1f1b", 4, 8, True, graph=_graph(4, True)))
    for st, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if a.kind in (K.SEND_F, K.SEND_B):
                j = i - 1
                while acts[j].kind in (K.SEND_F, K.SEND_B):
                    j -= 1
                prod = acts[j]
                assert prod.mb == a.mb and prod.kind == (K.F if a.kind == K.SEND_F else K.I)
            if a.kind in (K.WAIT_F, K.WAIT_B):
                nxt = next(b for b in acts[i + 1:] if b.kind.is_compute)
                assert nxt.mb == a.mb
    # stage 1 with lookahead 1: exactly one activation receive outstanding at a time
    outstanding = 0
    for a in s.actions[1]:
        outstanding += {K.RECV_F: 1, K.WAIT_F: -1}.get(a.kind, 0)
        assert 0 <= outstanding <= 1
    low3 = lower(generate("1f1b", 3, 4), lookahead=None)
    assert [str(a) for a in low3.actions[1][:6]] == [
        "RF0<-0", "RF1<-0", "RF2<-0", "RF3<-0", "RB0<-2", "RB1<-2"]
    with pytest.raises(ScheduleError, match="already contains"):
        lower(s)


# ------------------------------------------------------------------------- validator
def _sched(lines: list[str], m: int, skips=()) -> Schedule:
    text = f"stages {len(lines)} microbatches {m}\n" + "".join(
        f"edge {e}\n" for e in skips) + "".join(f"stage {s}: {l}\n" for s, l in enumerate(lines))
    return Schedule.loads(text)


@pytest.mark.parametrize("lines,m,pattern", [
    (["F0 B1 F1 B0", "F0 B0 F1 B1"], 2, r"stage 0 step 1: B1 before its F1"),
    (["F0 F1 B0 B1", "F0 B0"], 2, r"stage 1: microbatch 1 has no F \(missing microbatch\)"),
    (["F0 F1 B0 B1 B1", "F0 B0 F1 B1"], 2, r"stage 0 step 4: B1: duplicate B1 \(first at step 3\)"),
    (["F0 I0 F1 W1 I1 W0", "F0 B0 F1 B1"], 2, r"stage 0 step 3: W1 before its I1"),
    (["F0 F1 I0 I1 W0", "F0 B0 F1 B1"], 2, r"stage 0: microbatch 1 has I1 but no W1"),
    (["F0 F1 B0 B1", "F0 B0 F1 B1 F2 B2"], 2, r"microbatch 2 out of range"),
])
def test_validator_rejects_malformed(lines, m, pattern):
    with pytest.raises(ScheduleError, match=pattern):
        validate(_sched(lines, m))


def test_validator_reports_deadlock_per_stage():
    # stage 0 wants B0 before it ever runs F1; stage 1 runs F1 before B0: a cycle.
    s = _sched(["F0 B0 F1 B1", "F0 F1 B0 B1"], 2)
    with pytest.raises(ScheduleError) as ei:
        validate(s)
    msg = str(ei.value)
    assert "deadlock" in msg
    assert "stage 0 step 1: B0 waits for B0/I0 on stage 1 (edge 0->1)" in msg
    assert "stage 1 step 1: F1 waits for F1 on stage 0 (edge 0->1)" in msg
    # a skip edge adds the dependency 3 -> 0 for gradients
    s = _sched(["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"], 2, ["0->2:skip"])
    validate(s)


def test_validator_rejects_bad_lowering():
    low = lower(generate("1f1b", 3, 3))
    text = low.dumps()
    # a receive posted out of FIFO order on stage 1
    bad = text.replace("RF0<-0 RB0<-2 WF0<-0 RF1<-0", "RF1<-0 RB0<-2 RF0<-0 WF0<-0", 1)
    assert bad != text
    with pytest.raises(ScheduleError, match=r"stage 0 sends microbatches \[0, 1, 2\] but stage 1 "
                                            r"posts receives \[1, 0, 2\]"):
        validate(Schedule.loads(bad))
    # a missing wait before its consumer
    bad = text.replace(" WF0<-0 ", " ", 1)
    with pytest.raises(ScheduleError, match=r"stage 1 step \d+: F0 needs WF0<-0 before it"):
        validate(Schedule.loads(bad))
    # a send before the compute that produces it
    bad = text.replace("F0 SF0->1", "SF0->1 F0", 1)
    with pytest.raises(ScheduleError, match=r"stage 0 step 1: SF0->1 before the compute"):
        validate(Schedule.loads(bad))
    # a missing send: the receiver deadlocks waiting for it
    bad = text.replace(" SF2->1", "", 1)
    with pytest.raises(ScheduleError, match=r"F2 produces a tensor for edge 0->1 but there is no SF2->1"):
        validate(Schedule.loads(bad))
    assert dry_run(low) == []


# ------------------------------------------------------------------------- simulator
@pytest.mark.parametrize("P", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 12])
@pytest.mark.parametrize("fb", [(1, 2), (1, 1)])
def test_bubble_and_peak_activations_free_comm(P, m, fb):
    costs = Costs(f=fb[0], b=fb[1])
    t1 = simulate(generate("1f1b", P, m), costs=costs)
    tg = simulate(generate("gpipe", P, m), costs=costs)
    te = simulate(generate("eager-1f1b", P, m), costs=costs)
    # uniform costs: makespan (m+P-1)(f+b), busy m(f+b) per stage
    assert t1.makespan == pytest.approx((m + P - 1) * sum(fb))
    assert t1.bubble_fraction == pytest.approx((P - 1) / (m + P - 1))
    assert tg.makespan == pytest.approx(t1.makespan)
    assert te.makespan == pytest.approx(t1.makespan)
    assert t1.peak_activations == [min(m, P - i) for i in range(P)]
    assert te.peak_activations == [min(m, 2 * (P - i) - 1) for i in range(P)]
    assert tg.peak_activations == [m] * P
    for name, tl in (("1f1b", t1), ("eager-1f1b", te)):
        assert tl.peak_activations == [forwards_before_first_backward(name, P, m, i) for i in range(P)]


@pytest.mark.parametrize("P,m", [(3, 8), (4, 8), (4, 12)])
@pytest.mark.parametrize("rendezvous", [False, True])
def test_eager_with_delayed_w_hides_communication(P, m, rendezvous):
    """Paper §4 / Figure 4: with comm cost c, 1F1B puts every transfer on the critical
    path; eager-1F1B + delayed W puts other microbatches' compute between a send and
    the compute that waits for it."""
    def span(name, delay, c):
        return simulate(generate(name, P, m, delay),
                        costs=Costs(f=1, b=2, comm=c, rendezvous=rendezvous)).makespan

    free = span("1f1b", False, 0.0)
    # c = 0.5: fully hidden by eager + delayed W, not by 1F1B
    assert span("eager-1f1b", True, 0.5) == pytest.approx(free)
    # 1F1B pays at least the fill and drain transfers (2 per stage boundary), and more
    assert span("1f1b", False, 0.5) > free + 2 * 0.5 * (P - 1)
    # c = 1: strict ordering
    one, one_dw = span("1f1b", False, 1.0), span("1f1b", True, 1.0)
    eager, eager_dw = span("eager-1f1b", False, 1.0), span("eager-1f1b", True, 1.0)
    assert eager_dw < eager < one
    assert eager_dw < one_dw < one


def test_simulator_timeline_details():
    g = _graph(3, True)
    tl = simulate(generate("1f1b", 3, 2, True, graph=g),
                  costs=Costs(f=[1, 2, 1], b={0: 2, 1: 4, 2: 2}, comm={"0->2:skip": 3, "*": 1}))
    assert len(tl.comm) == 2 * 2 * len(g.edges)  # every edge, both directions, every mb
    skip = [c for c in tl.comm if c.edge.name == "skip"]
    assert all(c.end - c.start == 3 for c in skip)
    for s, row in enumerate(tl.compute):  # stages never overlap their own compute
        for a, b in zip(row, row[1:]):
            assert a.end <= b.start + 1e-12
    f_stage1 = [iv for iv in tl.compute[1] if iv.action.kind == K.F]
    assert all(iv.end - iv.start == 2 for iv in f_stage1)
    trace = tl.to_trace()
    json.dumps(trace)
    assert {"stage", "kind", "mb", "start", "end"} <= set(trace[0])
    with pytest.raises(ScheduleError, match="no entry for edge 0->2:skip"):
        simulate(generate("1f1b", 3, 2, graph=g), costs=Costs(comm={"0->1": 1}))


# -------------------------------------------------------------------------- the tool
def test_plot_schedule_tool_writes_png(tmp_path):
    out = tmp_path / "cmp.png"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_schedule.py"), "--compare",
                        "--schedule", "1f1b", "eager-1f1b+dw", "--stages", "3",
                        "--microbatches", "4", "--comm", "0.5", "--json", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["name"] for row in rows] == ["1f1b", "eager-1f1b+dw"]
    assert rows[1]["makespan"] < rows[0]["makespan"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a measured trace in the runtime's format
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(simulate(generate("gpipe", 2, 2)).to_trace()))
    out2 = tmp_path / "trace.png"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_schedule.py"),
                        "--trace", str(trace), "-o", str(out2)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "makespan" in r.stdout and out2.exists()
    # several traces stack in one figure, each named by its folder and file
    other = tmp_path / "b" / "trace.json"
    other.parent.mkdir()
    other.write_text(json.dumps(simulate(generate("1f1b", 2, 2)).to_trace()))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_schedule.py"), "--trace", str(trace), str(other),
                        "--json", "-o", str(tmp_path / "both.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [row["name"] for row in json.loads(r.stdout)] == [f"{tmp_path.name}/trace", "b/trace"]
