"""Resharder on 8 gloo ranks: every destination rank gets exactly global[local_slices(...)].

Start-up is the expensive part on 2 cores, so one `run_ranks` launch checks every case (the paper cases,
the random spec pairs, then the special cases, whose teardown closes the stream threads, and the validation
errors): the worker loops over them and returns per-case failure strings instead of asserting.
Every launch runs in NCCL's checking mode (tags forced to 0, per-group operation sequences
and message pairing checked across ranks, one thread per communicator). Both execution
orders (`plan`, `concurrent`) are checked; `plan` runs also return their
trace, from which the ordering test checks that every host NIC side serves the plan's
tasks one at a time, in plan order.
"""
from __future__ import annotations

import functools
import random
import threading
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megareshard.resharding import Mesh, ShardingSpec, local_slices, plan_resharding
from megareshard.resharding.cases import paper_case
from megareshard.resharding.executor import Resharder
from megareshard.resharding.messages import ORDERS, RECV_SIDE, SEND_SIDE, build_messages, nic_side_chains
from tests.harness import run_ranks
import lab.signal  # noqa: F401,E402  (registers the 1-byte `signal` bound the tests exercise)

WORLD = 8
STRATEGIES = ("sendrecv", "allgather", "broadcast")
SCHEDULERS = ("naive", "loadbalance", "dfs", "greedy")
SPECS = ("R", "S0", "S1", "S01", "S10")


def _global(shape, dtype=torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float64).reshape(shape).to(dtype)


def _check_once(rank, shape, src_mesh, src_spec, dst_mesh, dst_spec, strategy, scheduler, chunks=None,
                dtype=torch.float32, label="", order="plan", trace=None, ctrace=None) -> list[str]:
    """Plan, build, run; returns this rank's failure messages (empty when correct).

    With `trace` (a list), the run is traced and a plan-order run appends (plan summary, this rank's trace) to
    it; a concurrent-order run appends them to `ctrace`.
    """
    plan = plan_resharding(shape, src_mesh, src_spec, dst_mesh, dst_spec, strategy=strategy,
                           scheduler=scheduler, itemsize=torch.empty(0, dtype=dtype).element_size(),
                           time_budget_s=0.05, broadcast_chunks=chunks)
    res = Resharder(plan, dtype, order=order, trace=trace is not None)
    full = _global(shape, dtype)
    src_sl = local_slices(shape, src_mesh, src_spec, rank)
    local = None if src_sl is None else full[src_sl].clone()
    handle = res.start(local)
    out = handle.wait()
    dst_sl = local_slices(shape, dst_mesh, dst_spec, rank)
    tag = f"{label} {src_mesh}{tuple(src_mesh.flat_ranks)} {src_spec} -> {dst_mesh}{tuple(dst_mesh.flat_ranks)} " \
          f"{dst_spec} shape {tuple(shape)} {strategy}/{scheduler}/K={chunks}/{order} rank {rank}"
    # wait() must leave no operation in flight: a send whose wait was skipped could be dropped
    # with its buffer (the plan-order hang: a progress thread's freed work id was reused)
    pending = sum(not w.is_completed() for w in handle._works)
    if pending:
        return [f"{tag}: {pending} operations still in flight after wait()"]
    if trace is not None:
        (trace if order == "plan" else ctrace).append((_plan_summary(plan, label), handle.trace))
    if dst_sl is None:
        return [] if out is None else [f"{tag}: expected None, got a tensor"]
    if out is None:
        return [f"{tag}: got None"]
    want = full[dst_sl]
    if out.shape != want.shape or out.dtype != want.dtype:
        return [f"{tag}: got {tuple(out.shape)} {out.dtype}, want {tuple(want.shape)} {want.dtype}"]
    if not torch.equal(out, want):
        bad = (out != want).nonzero()
        return [f"{tag}: {len(bad)} wrong elements, first at {bad[0].tolist()}"]
    return []


def _plan_summary(plan, label: str) -> dict:
    """What the ordering check needs from the plan: per task (in plan order) the planner's
    NIC sides — taken from the network model's cost, not from the executor."""
    sides = []
    for t in plan.tasks:
        cost = plan.task_cost(t)
        sides.append(sorted([(h, SEND_SIDE) for h in cost.out_bytes] + [(h, RECV_SIDE) for h in cost.in_bytes]))
    return {"label": f"{label} {plan.strategy}/{plan.scheduler}", "tasks": [t.index for t in plan.tasks],
            "sides": sides}


def _grid(ranks_by_host: list[list[int]], first_host: int) -> Mesh:
    return Mesh(ranks_by_host, {r: first_host + h for h, row in enumerate(ranks_by_host) for r in row})


def _paper_meshes(n: int) -> tuple[Mesh, ShardingSpec, Mesh, ShardingSpec]:
    """Paper case n's specs on meshes that fit 8 ranks (2 devices per host when it fits)."""
    for dph in (2, 1):
        _, sm, ss, dm, ds = paper_case(n, devices_per_host=dph)
        if max(sm.flat_ranks + dm.flat_ranks) < WORLD:
            return sm, ss, dm, ds
    raise AssertionError(f"case {n} does not fit {WORLD} ranks")


def _worker_paper(rank: int, world: int) -> tuple[list[str], list, list]:
    torch.manual_seed(0)
    fails: list[str] = []
    traces: list = []
    ctraces: list = []
    shape = (8, 6, 4)
    for n in range(1, 10):
        sm, ss, dm, ds = _paper_meshes(n)
        for strategy in STRATEGIES:
            for scheduler in SCHEDULERS:
                for order in ORDERS:
                    if order == "concurrent" and scheduler in ("loadbalance", "greedy"):
                        continue  # the concurrent executor ignores the order; two schedulers suffice
                    fails += _check_once(rank, shape, sm, ss, dm, ds, strategy, scheduler, label=f"case {n}",
                                         order=order, trace=traces, ctrace=ctraces)
    return fails, traces, ctraces




def _random_case(rng: random.Random) -> tuple:
    """Random meshes (disjoint or overlapping), specs and a small uneven shape."""
    ndim = rng.choice((2, 3))
    shape = tuple(rng.randint(1, 7) for _ in range(ndim))

    def spec() -> ShardingSpec:
        while True:
            toks = [rng.choice(SPECS) for _ in range(ndim)]
            axes = [a for t in toks if t != "R" for a in t[1:]]
            if len(axes) == len(set(axes)):
                return ShardingSpec.parse(",".join(toks))

    ranks = list(range(WORLD))
    rng.shuffle(ranks)
    a0, a1 = rng.choice(((1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (1, 4), (2, 4)))
    b0, b1 = rng.choice(((1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (1, 4), (2, 3), (4, 2)))
    src_ranks = ranks[:a0 * a1]
    overlap = rng.random() < 0.4
    pool = ranks if overlap else ranks[a0 * a1:] or ranks
    if len(pool) < b0 * b1:
        pool = ranks
    dst_ranks = rng.sample(pool, b0 * b1)
    host = {r: r // 2 for r in range(WORLD)}  # 4 hosts x 2 ranks, whatever the mesh rows say
    sm = Mesh([src_ranks[i * a1:(i + 1) * a1] for i in range(a0)], host)
    dm = Mesh([dst_ranks[i * b1:(i + 1) * b1] for i in range(b0)], host)
    return shape, sm, spec(), dm, spec()


def _worker_random(rank: int, world: int, seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    fails: list[str] = []
    for i in range(count):
        shape, sm, ss, dm, ds = _random_case(rng)
        strategy = ("sendrecv", "allgather", "broadcast", "broadcast")[i % 4]
        scheduler = SCHEDULERS[(i // 4) % len(SCHEDULERS)]
        order = ORDERS[(i // 16) % len(ORDERS)]
        chunks = rng.choice((1, 2, 5, 64))
        dtype = rng.choice((torch.float32, torch.float64, torch.int64, torch.bfloat16))
        fails += _check_once(rank, shape, sm, ss, dm, ds, strategy, scheduler, chunks, dtype,
                             label=f"random#{i}", order=order)
    return fails


def _worker_special(rank: int, world: int) -> dict:
    """Overlap, uneven, signal, start/wait with compute, reuse, validation errors."""
    out: dict = {"fails": []}
    host = {r: r // 2 for r in range(WORLD)}
    # overlapping meshes: src ranks 0-5, dst ranks 2-7 (4 shared ranks)
    sm = Mesh([[0, 1], [2, 3], [4, 5]], host)
    dm = Mesh([[2, 3, 4], [5, 6, 7]], {r: host[r] for r in range(WORLD)})
    for strategy in STRATEGIES:
        for order in ORDERS:
            out["fails"] += _check_once(rank, (7, 5, 3), sm, ShardingSpec.parse("S0,S1,R"), dm,
                                        ShardingSpec.parse("R,S10,R"), strategy, "auto", label="overlap", order=order)
            out["fails"] += _check_once(rank, (7, 5, 3), sm, ShardingSpec.parse("R,R,R"), dm,
                                        ShardingSpec.parse("S1,R,S0"), strategy, "loadbalance", label="overlap-rep",
                                        order=order)
    # identical meshes and specs: everything is a local copy
    g = Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], host)
    out["fails"] += _check_once(rank, (7, 5, 3), g, ShardingSpec.parse("S0,S1,R"), g,
                                ShardingSpec.parse("S0,S1,R"), "broadcast", "auto", label="identity")
    # uneven shapes, 1 -> many with more chunks than elements
    src1 = Mesh([[0]], host)
    dst7 = Mesh([[1, 2, 3, 4, 5, 6, 7]], host)
    for strategy in STRATEGIES:
        for order in ORDERS:
            out["fails"] += _check_once(rank, (7, 5, 3), src1, ShardingSpec.parse("R,R,R"), dst7,
                                        ShardingSpec.parse("R,R,R"), strategy, "auto", chunks=200, label="1->7",
                                        order=order)
            out["fails"] += _check_once(rank, (3,), src1, ShardingSpec.parse("R"), dst7,
                                        ShardingSpec.parse("S1"), strategy, "auto", chunks=4, label="empty-shards",
                                        order=order)

    # signal: right shape, values undefined
    shape = (8, 6)
    src = Mesh([[0, 1], [2, 3]], host)
    dst = Mesh([[4, 5], [6, 7]], host)
    s_spec, d_spec = ShardingSpec.parse("S0,R"), ShardingSpec.parse("R,S1")
    plan = plan_resharding(shape, src, s_spec, dst, d_spec, strategy="signal")
    res = Resharder(plan, torch.float32)
    full = _global(shape)
    sl = local_slices(shape, src, s_spec, rank)
    got = res.run(None if sl is None else full[sl])
    dsl = local_slices(shape, dst, d_spec, rank)
    out["signal_shape"] = None if got is None else tuple(got.shape)
    out["signal_want"] = None if dsl is None else tuple(full[dsl].shape)

    # start()/wait() with compute in between; three runs in flight; reuse of one Resharder
    local = None if sl is None else full[sl].clone()
    for strategy, orders in (("broadcast", ORDERS), ("allgather", ORDERS)):
        plan = plan_resharding(shape, src, s_spec, dst, d_spec, strategy=strategy, broadcast_chunks=4)
        for order in orders:
            res = Resharder(plan, torch.float32, order=order)
            hs = [res.start(None if local is None else local * (j + 1)) for j in range(3)]
            a = torch.randn(64, 64)
            for _ in range(20):
                a = torch.tanh(a @ a)
            o2, o1, o0 = hs[1].wait(), hs[0].wait(), hs[2].wait()
            o3 = res.run(None if local is None else local + 1)
            if dsl is not None:
                for got_t, want in ((o1, full[dsl]), (o2, full[dsl] * 2), (o0, full[dsl] * 3), (o3, full[dsl] + 1)):
                    if not torch.equal(got_t, want):
                        out["fails"].append(f"start/wait {strategy}/{order} rank {rank}: wrong values")
            elif (o1, o2, o0, o3) != (None, None, None, None):
                out["fails"].append(f"start/wait {strategy}/{order} rank {rank}: expected None outside the dst mesh")

    # teardown: the stream threads this process started (forwarding communicators, plan order) are stopped and
    # joined before the communicators are destroyed (a thread alive at interpreter exit can abort it)
    from megareshard.resharding.executor import CommStreams

    streams = CommStreams.shared()
    out["threads_before_close"] = len(streams.threads())
    streams.close(destroy_groups=True)
    out["threads_after_close"] = len(streams.threads()) + sum(
        t.name.startswith("reshard-stream") for t in threading.enumerate())

    # validation errors, raised before any communication (so no other rank is needed)
    errors = {}
    bad_inputs = {
        "wrong_shape": torch.zeros(3, 3),
        "wrong_dtype": None if sl is None else full[sl].double(),
        "none_in_src": None,
        "tensor_outside_src": torch.zeros(1),
    }
    for name, value in bad_inputs.items():
        in_src = sl is not None
        if (name in ("wrong_shape", "wrong_dtype", "none_in_src")) != in_src:
            continue
        try:
            res.start(value)
            errors[name] = "no error"
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    out["errors"] = errors
    dist.barrier()
    return out


def _worker_all(rank: int, world: int) -> dict:
    """Every 8-rank case in one launch (each one was a launch of its own: ~5 CPU-seconds of start-up apiece on
    2 cores); the special cases last (their teardown closes this process's stream threads)."""
    return {"paper": _worker_paper(rank, world), "random": _worker_random(rank, world, 1234, 48),
            "special": _worker_special(rank, world), "bad_plan": _worker_bad_plan(rank, world)}


@functools.lru_cache(maxsize=1)
def _launch() -> list:
    """The one launch every multi-rank test reads (per rank: _worker_all's dict)."""
    return run_ranks(_worker_all, WORLD, timeout=400, nccl_check=True)


def _paper_results() -> list:
    return [r["paper"] for r in _launch()]


def test_build_messages_orders() -> None:
    host = {0: 0, 1: 1, 2: 1, 3: 2, 4: 2, 5: 0}
    # broadcast: chain 0 -> 1 -> 3 per chunk, fan-out 1->2, 3->4, local 5 fed by the sender
    msgs = build_messages("broadcast", 10, 0, [1, 2, 3, 4, 5], host, chunks=2)
    assert [(m.src, m.dst, m.start, m.stop, m.forward) for m in msgs[:5]] == [
        (0, 5, 0, 5, False), (0, 1, 0, 5, False), (1, 3, 0, 5, True), (1, 2, 0, 5, True), (3, 4, 0, 5, True)]
    assert len(msgs) == 10
    # allgather: host 1 gets halves from the sender, then exchanges them
    msgs = build_messages("allgather", 5, 0, [1, 2], host, chunks=4)
    assert [(m.src, m.dst, m.start, m.stop, m.forward) for m in msgs] == [
        (0, 1, 0, 3, False), (0, 2, 3, 5, False), (1, 2, 0, 3, True), (2, 1, 3, 5, True)]
    assert [m.dst for m in build_messages("sendrecv", 5, 0, [1, 2, 3], host, 4)] == [1, 2, 3]
    assert build_messages("signal", 5, 0, [1, 2], host, 4)[0].stop == 1


def test_nic_side_chains() -> None:
    from megareshard.resharding.messages import _TaskProgram

    host = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}

    def prog(pos, strategy, sender, remote):
        msgs = build_messages(strategy, 12, sender, remote, host, chunks=2)
        return _TaskProgram(pos, pos, (slice(0, 12),), (12,), 12, sender, (), msgs)

    chains = nic_side_chains([prog(0, "broadcast", 0, [1, 2, 3, 4, 5]), prog(1, "sendrecv", 1, [2, 3]),
                              prog(2, "allgather", 4, [2, 3]), prog(3, "sendrecv", 0, [1])], host)
    # task 0: chain host 0 -> 1 -> 2 (heads 2 and 4), fan-out and loopback are intra-host
    assert chains[(0, SEND_SIDE)] == [(0, frozenset({0})), (1, frozenset({1}))]
    assert chains[(1, RECV_SIDE)] == [(0, frozenset({2})), (1, frozenset({2, 3})), (2, frozenset({2, 3}))]
    assert chains[(1, SEND_SIDE)] == [(0, frozenset({2}))]
    assert chains[(2, RECV_SIDE)] == [(0, frozenset({4}))]
    assert chains[(2, SEND_SIDE)] == [(2, frozenset({4}))]
    assert all(p != 3 for side in chains.values() for p, _ in side)  # task 3 stays on host 0


@pytest.mark.slow
def test_paper_cases_all_strategies_and_schedulers() -> None:
    t0 = time.monotonic()
    fails = [f for fails, _, _ in _paper_results() for f in fails]
    assert not fails, "\n".join(fails[:20])
    print(f"paper cases: {time.monotonic() - t0:.1f}s")


@pytest.mark.slow
def test_plan_order_one_task_per_nic_side_in_plan_order() -> None:
    """Per host NIC side, the traced tasks are exactly the planner's, follow plan order and
    do not overlap: each starts (wire operations posted) after the previous one completed
    on every rank of the host that used the side."""
    per_rank = [traces for _, traces, _ in _paper_results()]
    n_runs = len(per_rank[0])
    assert n_runs == 9 * 3 * 4 and all(len(t) == n_runs for t in per_rank)
    checked = 0
    for k in range(n_runs):
        summary = per_rank[0][k][0]
        events = [e for rank_traces in per_rank for e in rank_traces[k][1]]
        label = summary["label"]
        # the planner's sides per task position vs the sides the executor used
        want = {(h, side): [pos for pos, sides in enumerate(summary["sides"]) if (h, side) in map(tuple, sides)]
                for sides in summary["sides"] for h, side in sides}
        got: dict[tuple[int, int], dict[int, list[float]]] = {}
        for e in events:
            side = SEND_SIDE if e["side"] == "send" else RECV_SIDE
            span = got.setdefault((e["host"], side), {}).setdefault(e["pos"], [e["t_post"], e["t_done"]])
            span[0], span[1] = min(span[0], e["t_post"]), max(span[1], e["t_done"])
            assert summary["tasks"][e["pos"]] == e["task"], label
        assert {s: sorted(p) for s, p in got.items()} == want, f"{label}: executor's NIC sides differ from the plan's"
        for side, spans in got.items():
            order = sorted(spans)
            for a, b in zip(order, order[1:]):
                assert spans[b][0] >= spans[a][1], \
                    f"{label}: on host {side[0]} {('send', 'recv')[side[1]]} side task at position {b} started " \
                    f"{spans[a][1] - spans[b][0]:.6f}s before position {a} finished"
                checked += 1
    assert checked > 100  # most cases put several tasks on some NIC side


@pytest.mark.slow
def test_concurrent_order_trace_records_every_wire_operation_on_both_ends() -> None:
    """Concurrent order, trace=True (each wire operation waited by a watcher thread): every wire message is
    recorded once by its sender and once by its receiver, on exactly the plan's host NIC sides, posted before
    it completed; and the run's data is right (test_paper_cases_all_strategies_and_schedulers)."""
    per_rank = [ctraces for _, _, ctraces in _paper_results()]
    n_runs = len(per_rank[0])
    assert n_runs == 9 * 3 * 2 and all(len(t) == n_runs for t in per_rank)
    for k in range(n_runs):
        summary = per_rank[0][k][0]
        events = [e for rank_traces in per_rank for e in rank_traces[k][1]]
        label = summary["label"]
        want = {(h, side, pos) for pos, sides in enumerate(summary["sides"]) for h, side in map(tuple, sides)}
        got = {(e["host"], SEND_SIDE if e["side"] == "send" else RECV_SIDE, e["pos"]) for e in events}
        assert got == want, f"{label}: traced NIC sides differ from the plan's"
        sends = Counter((e["rank"], e["peer"], e["task"]) for e in events if e["side"] == "send")
        recvs = Counter((e["peer"], e["rank"], e["task"]) for e in events if e["side"] == "recv")
        assert sends == recvs, f"{label}: sends and receives recorded differ"
        assert all(e["t_post"] <= e["t_done"] for e in events), label


@pytest.mark.slow
def test_random_spec_pairs() -> None:
    fails = [f for r in _launch() for f in r["random"]]
    assert not fails, "\n".join(fails[:20])


@pytest.mark.slow
def test_overlap_uneven_signal_async_and_validation() -> None:
    results = [r["special"] for r in _launch()]
    fails = [f for r in results for f in r["fails"]]
    assert not fails, "\n".join(fails[:20])
    assert sum(r["threads_before_close"] for r in results) > 0  # some ranks forward (broadcast, plan order)
    assert [r["threads_after_close"] for r in results] == [0] * WORLD
    for rank, r in enumerate(results):
        assert r["signal_shape"] == r["signal_want"], (rank, r)
        errs = r["errors"]
        if rank < 4:  # source ranks
            assert "shape (3, 3), expected (4, 6)" in errs["wrong_shape"] and f"rank {rank}" in errs["wrong_shape"]
            assert "dtype torch.float64, expected torch.float32" in errs["wrong_dtype"]
            assert "must pass its shard of shape (4, 6)" in errs["none_in_src"]
        else:
            assert "is not in the source mesh" in errs["tensor_outside_src"], errs


def _worker_bad_plan(rank: int, world: int) -> str:
    plan = plan_resharding((4, 4), Mesh.grid(1, 2), ShardingSpec.parse("S0,R"), Mesh.grid(1, 2, 2, 1),
                           ShardingSpec.parse("R,R"), strategy="broadcast")
    try:
        plan.strategy = "scatter"
        Resharder(plan, torch.float32)
    except ValueError as e:
        msg = str(e)
    else:
        msg = "no error"
    plan.strategy = "broadcast"
    try:
        plan_resharding((4, 4), Mesh.grid(1, 2), ShardingSpec.parse("S0,R"), Mesh.grid(1, 2, 2, 1),
                        ShardingSpec.parse("R,R"), strategy="broadcast", broadcast_chunks=0)
    except ValueError as e:
        msg += " | " + str(e)
    try:
        Resharder(plan, torch.float32, order="fifo")
    except ValueError as e:
        msg += " | " + str(e)
    return msg


@pytest.mark.slow
def test_bad_strategy_and_chunks_rejected_before_communication() -> None:
    for msg in [r["bad_plan"] for r in _launch()]:  # every rank, those outside the plan's meshes too
        assert "unknown resharding strategy 'scatter'" in msg and "broadcast_chunks must be an integer >= 1" in msg
        assert "order must be one of plan, concurrent, got 'fifo'" in msg
