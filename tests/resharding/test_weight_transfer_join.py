"""Generators as a separate launch (issue #50, `megareshard.transfer.join_transfer_group`): a trainer job (2 gloo
ranks, its own world, pp 2), a generator job (2 ranks, its own world, tp 2) and a bare generator process (no
torch.distributed world at all, tp 1), started independently, join one transfer group through a rendezvous of their
own on 127.0.0.1. After the transfer every generator's GPTModel holds the trainer's weights bitwise, cut to its
layout (vocabulary padding zero); each job's world is as it was (its size, its registered groups, an all-reduce
over it still works); the trainer's weights are untouched; and NCCL's checking mode saw the transfer's operations
(the joined group's record, both jobs' files together, passes the check). A generator process that dies as the
transfer starts fails the others' `run` with `TransferFailed` (its rank, the step), within the group's timeout; the
trainer's weights and world carry on, and the trainer and the generator left join a new group and transfer
exactly. Mistakes in joining are one line."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megareshard.parallel.nccl_check import ENV, check_logs
from tests.harness import free_port, run_ranks
from tests.resharding.test_weight_transfer import _SHAPES, _cfg, _set_truth, _source, _truth

T, G = 2, 3  # the trainer's ranks of the transfer group, the generators' (tp 2 job + the bare tp 1 process)
BUCKET_MB = 0.004  # small buckets: many messages, forwards and waves


def _destinations():
    from megareshard.transfer import Destination
    return [Destination("job_tp2", (2, 3), tp=2), Destination("bare_tp1", (4,), tp=1)]


def _trainer(rank: int, world: int, port: int):
    from torch.distributed import distributed_c10d as c10d

    from megareshard.parallel import ParallelContext
    from megareshard.parallel.topology import Topology
    from megareshard.transfer import WeightTransfer, join_transfer_group, leave_transfer_group, source_boxes
    ctx = ParallelContext.create(Topology(world, pp=2, nproc_per_node=world))
    cfg = _cfg(True)
    model, opt = _source(cfg, ctx, 0)
    got = [None] * world
    dist.all_gather_object(got, [(p.name, p.shape) for p in source_boxes(model, ctx, opt)[0]])
    _SHAPES.clear()
    _SHAPES.update({k: v for g in got for k, v in g})
    _set_truth(model, ctx, opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = dict(c10d._world.pg_group_ranks)
    group = join_transfer_group("127.0.0.1", port, rank, T + G, timeout=60)
    wt = WeightTransfer(_destinations(), model=model, ctx=ctx, optimizer=opt, group=group, bucket_mb=BUCKET_MB)
    report = wt.run()
    same = dict(c10d._world.pg_group_ranks) == groups  # torch's registry: the same groups, the same ranks
    leave_transfer_group(group)
    untouched = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    one = torch.ones(1)
    dist.all_reduce(one)  # the trainer's own world still works
    ctx.destroy()
    return {"world": dist.get_world_size(), "sum": one.item(), "groups_same": same, "untouched": untouched,
            "bytes": report["bytes"], "rank_in_group": wt.rank}


def _check_filled(wt, model) -> int:
    """Every box this rank's destination needs holds the truth's slice; rows past it (vocabulary padding) zero."""
    params = dict(model.named_parameters())
    shapes = {p.name: p.shape for p in wt.plan.params}
    n = 0
    for b in (*wt.plan.dest[wt.rank].values(), *wt.plan.aliases.get(wt.rank, [])):
        want = _truth(b.name, shapes[b.name])[tuple(slice(a, z) for a, z in b.region)]
        have = params[b.local_name].detach()
        assert torch.equal(have[tuple(slice(0, s) for s in want.shape)], want), (wt.rank, b.local_name)
        assert not have[want.shape[0]:].any(), (wt.rank, b.local_name)
        n += 1
    assert n == len(params), (n, sorted(params))
    return n


def _generator_job(rank: int, world: int, port: int):
    from torch.distributed import distributed_c10d as c10d

    from megareshard.models import GPTModel
    from megareshard.parallel import ParallelContext
    from megareshard.parallel.topology import Topology
    from megareshard.transfer import WeightTransfer, join_transfer_group, leave_transfer_group
    ctx = ParallelContext.create(Topology(world, tp=2, nproc_per_node=world))
    groups = dict(c10d._world.pg_group_ranks)
    group = join_transfer_group("127.0.0.1", port, T + rank, T + G, timeout=60)
    wt = WeightTransfer(_destinations(), group=group, bucket_mb=BUCKET_MB)
    model = GPTModel(wt.model_config, ctx, seed=99)
    wt.run(into=model)
    same = dict(c10d._world.pg_group_ranks) == groups
    leave_transfer_group(group)
    n = _check_filled(wt, model)
    one = torch.ones(1)
    dist.all_reduce(one, group=ctx.groups["tp"])  # its own tp group still works
    ctx.destroy()
    return {"world": dist.get_world_size(), "sum": one.item(), "groups_same": same, "checked": n}


def _bare_generator(rank: int, world: int, port: int):
    from megareshard.models import GPTModel
    from megareshard.parallel import ParallelContext
    from megareshard.parallel.topology import Topology
    from megareshard.transfer import WeightTransfer, join_transfer_group, leave_transfer_group
    assert not dist.is_initialized()
    group = join_transfer_group("127.0.0.1", port, T + 2, T + G, timeout=60)
    wt = WeightTransfer(_destinations(), group=group, bucket_mb=BUCKET_MB)
    model = GPTModel(wt.model_config, ParallelContext(topology=Topology(1), rank=0), seed=98)
    wt.run(into=model)
    leave_transfer_group(group)
    return {"checked": _check_filled(wt, model), "initialized": dist.is_initialized()}


@pytest.mark.slow
def test_generators_in_separate_launches_join_the_trainer(tmp_path):
    port = free_port()
    dirs = {k: tmp_path / k for k in ("trainer", "gen", "bare")}
    res: dict[str, object] = {}

    def launch(key, fn, n, **kw):
        try:
            res[key] = run_ranks(fn, n, port, timeout=120, env={ENV: str(dirs[key])}, **kw)
        except BaseException as e:  # noqa: BLE001 (reported below)
            res[key] = e

    threads = [threading.Thread(target=launch, args=("trainer", _trainer, 2)),
               threading.Thread(target=launch, args=("gen", _generator_job, 2)),
               threading.Thread(target=launch, args=("bare", _bare_generator, 1), kwargs={"init_group": False})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, r in res.items():
        if isinstance(r, BaseException):
            raise r
    trainer, gen, bare = res["trainer"], res["gen"], res["bare"]
    assert [r["rank_in_group"] for r in trainer] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 2.0 and r["groups_same"] and r["untouched"] and r["bytes"] > 0
               for r in trainer), trainer
    assert all(r["world"] == 2 and r["sum"] == 2.0 and r["groups_same"] and r["checked"] > 0 for r in gen), gen
    assert bare[0]["checked"] > 0 and not bare[0]["initialized"]
    # NCCL's rules: each job's own world, and the transfer group from both jobs' records together
    assert check_logs(str(dirs["trainer"])) == [] and check_logs(str(dirs["gen"])) == []
    merged = tmp_path / "merged"
    merged.mkdir()
    for d in dirs.values():
        for f in Path(d).glob("group-*/rank*.json"):
            shutil.copy(f, merged / f.name)
    assert sorted(f.name for f in merged.iterdir()) == [f"rank{r}.json" for r in range(T + G)]
    assert check_logs(str(merged)) == []


# ---- a generator process that dies mid-transfer -------------------------------------------------------------------
DEAD_TIMEOUT_S = 8


def _trainer_model(world: int):
    """The trainer's pp 2 model on its own world, every source box set to the truth's slice."""
    from megareshard.parallel import ParallelContext
    from megareshard.parallel.topology import Topology
    from megareshard.transfer import source_boxes
    ctx = ParallelContext.create(Topology(world, pp=2, nproc_per_node=world))
    model, opt = _source(_cfg(False), ctx, 0)
    got = [None] * world
    dist.all_gather_object(got, [(p.name, p.shape) for p in source_boxes(model, ctx, opt)[0]])
    _SHAPES.clear()
    _SHAPES.update({k: v for g in got for k, v in g})
    _set_truth(model, ctx, opt)
    return ctx, model, opt


def _trainer_survives(rank: int, world: int, ports: list[int]):
    """The trainer's side when a generator dies: `run` raises TransferFailed within the group's timeout; the
    trainer's weights are as they were, its own world carries on, and it joins a new group with the generator
    that is left and transfers to it."""
    import time

    from megareshard.transfer import (Destination, TransferFailed, WeightTransfer, join_transfer_group,
                                      leave_transfer_group)
    ctx, model, opt = _trainer_model(world)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    group = join_transfer_group("127.0.0.1", ports[0], rank, T + 2, timeout=DEAD_TIMEOUT_S)
    wt = WeightTransfer([Destination("g0", (T,)), Destination("g1", (T + 1,))], model=model, ctx=ctx, group=group,
                        bucket_mb=BUCKET_MB)
    t0 = time.monotonic()
    try:
        wt.run()
        error = None
    except TransferFailed as e:
        error = str(e)
    waited = time.monotonic() - t0
    leave_transfer_group(group)
    one = torch.ones(1)
    dist.all_reduce(one)
    again = join_transfer_group("127.0.0.1", ports[1], rank, T + 1, timeout=60)  # with the generator left
    report = WeightTransfer([Destination("g0", (T,))], model=model, ctx=ctx, group=again, bucket_mb=BUCKET_MB).run()
    leave_transfer_group(again)
    untouched = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    ctx.destroy()
    return {"error": error, "waited": waited, "sum": one.item(), "untouched": untouched, "bytes": report["bytes"]}


def _generator(rank: int, world: int, ports: list[int], which: int):
    """A bare generator process (a tp 1 replica, no world of its own), a launch of its own: ``which`` 1 dies as the
    transfer starts; ``which`` 0 fails its transfer, joins the trainer again and receives its weights."""
    import os
    import signal

    from megareshard.transfer import (Destination, TransferFailed, WeightTransfer, join_transfer_group,
                                      leave_transfer_group)
    group = join_transfer_group("127.0.0.1", ports[0], T + which, T + 2, timeout=DEAD_TIMEOUT_S)
    wt = WeightTransfer([Destination("g0", (T,)), Destination("g1", (T + 1,))], group=group, bucket_mb=BUCKET_MB)
    if which == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        wt.run()
        error = None
    except TransferFailed as e:
        error = str(e)
    leave_transfer_group(group)
    again = join_transfer_group("127.0.0.1", ports[1], T, T + 1, timeout=60)
    wt = WeightTransfer([Destination("g0", (T,))], group=again, bucket_mb=BUCKET_MB)
    wt.run()
    leave_transfer_group(again)
    shapes = {p.name: p.shape for p in wt.plan.params}
    exact = wt.received.keys() == wt.plan.dest[T].keys() and all(
        torch.equal(t, _truth(n, shapes[n])[tuple(slice(a, z) for a, z in wt.plan.dest[T][n].region)])
        for n, t in wt.received.items())
    return {"error": error, "exact": exact}


@pytest.mark.slow
def test_a_generator_that_dies_fails_the_transfer_not_the_trainer():
    from tests.harness import RankFailure

    ports = [free_port(), free_port()]
    res: dict[str, object] = {}

    def launch(key, fn, n, *args, **kw):
        try:
            res[key] = run_ranks(fn, n, ports, *args, timeout=90, **kw)
        except BaseException as e:  # noqa: BLE001 (checked below)
            res[key] = e

    threads = [threading.Thread(target=launch, args=("trainer", _trainer_survives, 2)),
               threading.Thread(target=launch, args=("left", _generator, 1, 0), kwargs={"init_group": False}),
               threading.Thread(target=launch, args=("dead", _generator, 1, 1), kwargs={"init_group": False})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in ("trainer", "left"):
        if isinstance(res[key], BaseException):
            raise res[key]
    assert isinstance(res["dead"], RankFailure) and "process exited with code -9" in str(res["dead"]), res["dead"]
    left = res["left"][0]
    assert left["error"].startswith(f"rank {T} of the transfer group failed in ") and left["exact"], left
    for r, out in enumerate(res["trainer"]):
        assert out["error"] is not None and out["error"].startswith(f"rank {r} of the transfer group failed in "), out
        assert "(a peer rank died, stalled or lost its network)" in out["error"], out
        assert out["waited"] < DEAD_TIMEOUT_S + 5, out  # no hang: the group's timeout bounds it
        assert out["sum"] == 2.0 and out["untouched"] and out["bytes"] > 0, out


def test_joining_mistakes_are_one_line():
    """In this process, no transfer group formed: a rank outside the group, a port already taken, a rank missing."""
    import socket

    from megareshard.transfer import join_transfer_group
    with pytest.raises(ValueError, match=r"^join_transfer_group: rank 3 is outside 0\.\.2$"):
        join_transfer_group("127.0.0.1", free_port(), 3, 3)
    with pytest.raises(ValueError, match="backend 'mpi' is not 'gloo' or 'nccl'"):
        join_transfer_group("127.0.0.1", free_port(), 0, 2, backend="mpi")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConnectionError) as e:
            join_transfer_group("127.0.0.1", port, 0, 2, timeout=2)
    assert str(e.value).startswith(f"join_transfer_group: rank 0 could not serve the rendezvous on 127.0.0.1:{port} "
                                   "within 2s: ") and "\n" not in str(e.value)
    port = free_port()
    with pytest.raises(ConnectionError) as e:
        join_transfer_group("127.0.0.1", port, 0, 3, timeout=1)
    assert str(e.value) == (f"join_transfer_group: rank 0: 2 of 3 ranks did not join 127.0.0.1:{port} within 1s "
                            "(missing ranks [1, 2])")
