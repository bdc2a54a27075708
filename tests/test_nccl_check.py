"""The NCCL checking mode catches what NCCL would break on, and passes what it would not.

Each scenario runs on gloo ranks in the checking mode; the ones that break a rule must be
reported by ``check_logs`` (or raise at once, for a second driving thread), the correct
variant of each must not.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from megareshard.parallel.nccl_check import NcclRuleViolation, check_logs, label
from tests.harness import RankFailure, run_ranks


def _tagged_pair(rank: int, world: int, crossed: bool) -> list[float]:
    """Two messages 0 -> 1 told apart by tags; `crossed`: the receiver posts them in the other order.

    gloo with tags pairs them right either way; NCCL pairs by issue order, so the crossed
    program swaps the two tensors — the checking mode forces tags to 0 and sees the labels cross.
    """
    g = dist.new_group([0, 1])
    if rank == 0:
        with label("a"):
            w1 = dist.isend(torch.full((3,), 1.0), dst=1, group=g, tag=7)
        with label("b"):
            w2 = dist.isend(torch.full((3,), 2.0), dst=1, group=g, tag=9)
        w1.wait()
        w2.wait()
        return []
    a, b = torch.zeros(3), torch.zeros(3)
    order = [("b", b, 9), ("a", a, 7)] if crossed else [("a", a, 7), ("b", b, 9)]
    works = []
    for name, t, tag in order:
        with label(name):
            works.append(dist.irecv(t, src=0, group=g, tag=tag))
    for w in works:
        w.wait()
    return [a[0].item(), b[0].item()]


def _collective_order(rank: int, world: int, swapped: bool) -> None:
    """Two same-size all-reduces of different buffers; `swapped`: rank 1 issues them in the other order.

    gloo completes (and silently sums x with y); the labels show the crossing."""
    x, y = torch.ones(4), torch.ones(4)
    order = [("y", y), ("x", x)] if swapped and rank == 1 else [("x", x), ("y", y)]
    for name, t in order:
        with label(name):
            dist.all_reduce(t)


def _two_threads(rank: int, world: int, second_group: bool) -> str:
    g1 = dist.new_group([0, 1])
    g2 = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=g1)
    err: list[BaseException] = []

    def other() -> None:
        try:
            dist.all_reduce(torch.ones(1), group=g2 if second_group else g1)
        except BaseException as e:  # the checking mode raises before issuing
            err.append(e)

    t = threading.Thread(target=other, name="helper")
    t.start()
    t.join()
    if err:
        # keep the peers in step: the other rank's op on g1 needs a partner
        if isinstance(err[0], NcclRuleViolation):
            dist.all_reduce(torch.ones(1), group=g1)
        return f"{type(err[0]).__name__}: {err[0]}"
    return "ok"


@pytest.mark.slow
def test_issue_order_pairing_is_checked() -> None:
    # the correct program passes, and its values are right with tags forced to 0
    assert run_ranks(_tagged_pair, 2, False, nccl_check=True, timeout=60)[1] == [1.0, 2.0]
    with pytest.raises(RankFailure, match=r"message #0 from rank 0 to rank 1 pairs send \[3, 'float32', 'a'\] "
                                          r"with receive \[3, 'float32', 'b'\]"):
        run_ranks(_tagged_pair, 2, True, nccl_check=True, timeout=60)


@pytest.mark.slow
def test_collective_order_is_checked() -> None:
    run_ranks(_collective_order, 2, False, nccl_check=True, timeout=60)
    with pytest.raises(RankFailure, match=r"rank 1's collective #0 \['all_reduce', None, 4, 'float32', 'y'\] "
                                          r"differs from rank 0's \['all_reduce', None, 4, 'float32', 'x'\]"):
        run_ranks(_collective_order, 2, True, nccl_check=True, timeout=60)


@pytest.mark.slow
def test_second_thread_on_a_group_is_refused() -> None:
    # another thread on another group is fine; on the same group it raises at once
    assert run_ranks(_two_threads, 2, True, nccl_check=True, timeout=60) == ["ok", "ok"]
    with pytest.raises(RankFailure, match="driven from thread 'helper' after thread 'MainThread'"):
        run_ranks(_two_threads, 2, False, nccl_check=True, timeout=60)


def test_check_logs_without_records(tmp_path) -> None:
    assert check_logs(str(tmp_path)) == [f"no records under {tmp_path} (was MEGARESHARD_NCCL_CHECK set in every rank?)"]


def _plan_order_on_nccl(rank: int, world: int) -> str:
    """The constructor's NCCL branch, reached on gloo by reporting the backend as nccl."""
    from megareshard.resharding import Mesh, ShardingSpec, plan_resharding
    from megareshard.resharding.executor import Resharder

    plan = plan_resharding((4,), Mesh([[0]], {0: 0}), ShardingSpec.parse("R"), Mesh([[1]], {1: 1}),
                           ShardingSpec.parse("R"), strategy="broadcast")
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]
    try:
        Resharder(plan, torch.float32, order="plan")
    except ValueError as e:
        return str(e)
    finally:
        dist.get_backend = real  # type: ignore[assignment]
    return "no error"


@pytest.mark.slow
def test_plan_order_on_nccl_raises_instead_of_running_concurrent() -> None:
    for msg in run_ranks(_plan_order_on_nccl, 2, timeout=60):
        assert "order='plan' is gloo-only" in msg and "use order='concurrent'" in msg, msg
