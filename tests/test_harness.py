"""The multi-process harness itself: results come back per rank, failures show every rank."""
import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, run_ranks

pytestmark = pytest.mark.waits  # timeouts and hung ranks: seconds of waiting (tests/conftest.py)


def _allreduce(rank, world_size, scale):
    t = torch.tensor([float(rank)]) * scale
    dist.all_reduce(t)
    return rank, world_size, t.item()


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # the other ranks block here until the harness dumps their stacks
    return rank


def _hang(rank, world_size):
    import time
    if rank == 0:
        dist.barrier()  # waits for rank 1, which never arrives
    else:
        time.sleep(60)
    return rank


def test_results_come_back_per_rank():
    out = run_ranks(_allreduce, 4, 2.0)
    assert out == [(r, 4, 2.0 * 6) for r in range(4)]


def test_failure_shows_every_rank():
    with pytest.raises(RankFailure) as info:
        run_ranks(_fail_on_rank1, 3, timeout=60)
    msg = str(info.value)
    assert "rank one is unhappy" in msg and "----- rank 1 -----" in msg
    # ranks 0 and 2 were blocked in the barrier: their stacks are shown
    assert "----- rank 0 -----" in msg and "_fail_on_rank1" in msg


def test_timeout_dumps_stacks():
    with pytest.raises(RankFailure) as info:
        run_ranks(_hang, 2, timeout=5)
    msg = str(info.value)
    assert "timed out" in msg and "----- rank 0 -----" in msg and "----- rank 1 -----" in msg
    assert "_hang" in msg  # the dumped stacks name where each rank was
