"""Pre-flight rendezvous (missing ranks named, not a hang), rank map, placement check, watchdog."""
import io
import os
import time

import pytest

from megareshard.launch import RankInfo, Watchdog, rank_map_table, tp_placement_warnings
from megareshard.parallel import Topology
from tests.harness import RankFailure, free_port, run_ranks

pytestmark = pytest.mark.waits  # rendezvous timeouts: seconds of waiting (tests/conftest.py)


def _join(i: int, n: int, ranks: list[int], world: int, port: int, timeout_s: float) -> tuple[bool, str]:
    """Rank ``ranks[i]`` of ``world`` as torchrun starts it (its environment), through the pre-flight rendezvous
    and one all-reduce: (joined, what it says)."""
    import torch
    import torch.distributed as dist

    from megareshard.launch import PreflightError, preflight_rendezvous

    os.environ.update(RANK=str(ranks[i]), WORLD_SIZE=str(world), LOCAL_RANK=str(ranks[i]), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if i > 0:
        time.sleep(0.3)  # let the store's host come up first
    try:
        infos = preflight_rendezvous("gloo", timeout_s=timeout_s, comm_timeout_s=30)
    except PreflightError as e:
        return False, str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return True, f"joined {len(infos)} {int(t.item())}"


def _launch(ranks, world, timeout_s):
    """The ranks forked from the test harness's server (torch imported once), each making its own process
    group."""
    return run_ranks(_join, len(ranks), ranks, world, free_port(), timeout_s, init_group=False, timeout=60)


def test_all_ranks_join():
    for ok, said in _launch([0, 1, 2], 3, 20):
        assert ok and said == "joined 3 3", said


def test_missing_rank_is_named_not_a_hang():
    start = time.monotonic()
    outs = _launch([0, 1], 3, 3)
    assert time.monotonic() - start < 30
    for ok, said in outs:
        assert not ok
        assert "1 of 3 ranks did not join within 3s: missing ranks 2" in said and "joined: " in said, said


@pytest.mark.slow
def test_missing_store_host_is_named():
    ((ok, said),) = _launch([1], 2, 3)
    assert not ok and "could not reach the rendezvous store" in said, said


def test_rank_map_and_tp_placement():
    topo = Topology(8, tp=2, pp=2, nproc_per_node=4)
    good = [RankInfo(r, f"node{r // 4}", r % 4, 100 + r) for r in range(8)]
    table = rank_map_table(good, topo)
    assert "node0: r0[pp0 tp0 dp0] r1[pp0 tp1 dp0]" in table and "node1:" in table
    assert tp_placement_warnings(good, topo) == []
    # a cluster whose nodes run 3 ranks: tp pairs straddle hosts, and the counts differ
    bad = [RankInfo(r, f"node{r // 3}", r % 3, 100 + r) for r in range(8)]
    warnings = tp_placement_warnings(bad, topo)
    assert any("tensor-parallel group [2, 3] spans hosts node0, node1" in w for w in warnings)
    assert any("different numbers of ranks" in w for w in warnings)


def _stall(rank, world_size, log_dir):
    import torch.distributed as dist

    with open(os.path.join(log_dir, f"rank{rank}.log"), "w") as log:
        dog = Watchdog(1.0, rank, out=log)
        if rank == 1:
            with dog.activity("stage 1 compute F mb 3 (injected stall)"):
                time.sleep(30)
        with dog.activity(f"stage {rank} WAIT_F mb 3 from stage 1"):
            dist.barrier()
    return rank


def test_watchdog_fires_on_injected_stall(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_stall, 2, str(tmp_path), timeout=60)
    assert time.monotonic() - start < 20  # the watchdog, not the harness timeout, ended it
    assert "exited with code 1" in str(info.value)
    log0 = (tmp_path / "rank0.log").read_text()
    log1 = (tmp_path / "rank1.log").read_text()
    # both watchdogs fire at 1 s: rank 0's own (the stalled activity and its stack), or rank 1's first, whose
    # exit fails rank 0's barrier (the activity named, and the cause); either way rank 0 says what it waited on
    assert "rank 0: 'stage 0 WAIT_F mb 3 from stage 1'" in log0
    assert ("has run for" in log0 and "_stall" in log0) or ("failed after" in log0 and "a peer rank died" in log0), log0
    assert "rank 1: 'stage 1 compute F mb 3 (injected stall)'" in log1


def test_watchdog_quiet_when_activities_finish():
    fired = []
    dog = Watchdog(0.3, 0, out=io.StringIO(), on_fire=fired.append)
    for _ in range(5):
        with dog.activity("short"):
            time.sleep(0.05)
    time.sleep(0.5)
    dog.stop()
    assert fired == []
    with pytest.raises(ValueError, match="--comm-timeout must be positive"):
        Watchdog(0, 0)
