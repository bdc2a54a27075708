"""Missing nodes named before torchrun blocks: examples/pretrain_gpt_distributed.sh with NNODES=2 where node 1
never starts stops within the pre-flight timeout naming node rank 1 and the host that joined — on both
rendezvous kinds the script offers (static master address/port, c10d)."""
import io
import socket
import threading

import pytest

from megareshard.launch.node_preflight import node_preflight
from megareshard.launch.preflight import PreflightError

from tests.harness import free_port

from ._ranks import chaos_ranks

pytestmark = pytest.mark.waits  # nodes that never come: seconds of waiting (tests/conftest.py)


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_missing_node_is_named_by_the_launch_script(tmp_path, rdzv):
    cr = chaos_ranks()
    r = cr._node_missing(str(tmp_path), True, rdzv)
    log = r["log"]
    row = cr._pick(r)  # what lab/chaos/chaos.py receives from FAULTS: exactly its seven fields
    assert tuple(row) == cr.KEYS and row["detected"] is True and isinstance(row["detect_s"], float)
    assert f"node-missing-{rdzv}" in [name for name, _ in cr.FAULTS] and row["fault"] == f"node-missing-{rdzv}"
    assert r["exit_code"] == 1, log[-2000:]
    assert f"1 of 2 nodes did not join within {r['timeout']}s: missing node rank 1; joined: node 0 on " \
           f"{socket.gethostname()}" in log, log[-2000:]
    assert "torch.distributed.run" not in log and "iteration" not in log   # torchrun never started
    assert r["detect_s"] is not None and r["detect_s"] < r["timeout"] + 5


def _node(results, rank, nnodes, port, rdzv, timeout=20.0):
    results[rank] = _try(rank, nnodes, port, rdzv, timeout)


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_nodes_that_all_join_pass_and_duplicates_are_refused(rdzv):
    port = free_port()
    results = {}
    threads = [threading.Thread(target=_node, args=(results, r, 3, port, rdzv)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(results[r], list) and [n.node_rank for n in results[r]] == [0, 1, 2] for r in range(3)), \
        results
    if rdzv == "c10d":  # two nodes claiming node rank 0: the second is refused by name
        dup = {}
        port = free_port()
        first = threading.Thread(target=lambda: dup.update(a=_try(0, 2, port, rdzv)))
        first.start()
        first.join(0.5)
        dup["b"] = _try(0, 2, port, rdzv)
        first.join(60)
        assert "node rank 0 is taken twice" in str(dup["b"]), dup
        assert "missing node rank 1" in str(dup["a"]), dup


def _try(rank, nnodes, port, rdzv, timeout=3.0):
    """One node's pre-flight in a thread of this process: its node list, or the PreflightError."""
    try:
        return node_preflight(nnodes, rank, "127.0.0.1", port, timeout, rdzv, out=io.StringIO())
    except PreflightError as e:
        return e


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_dry_run_prints_the_node_preflight_before_torchrun(rdzv):
    import os
    import shlex
    import subprocess

    from ._ranks import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="29500", RDZV=rdzv,
               PREFLIGHT_TIMEOUT="42")
    out = subprocess.run(["bash", str(ROOT / "examples/pretrain_gpt_distributed.sh")], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip().splitlines()
    pre, run = shlex.split(out[-2]), shlex.split(out[-1])
    assert pre[1:3] == ["-m", "megareshard.launch.node_preflight"]
    assert " ".join(pre[3:]) == \
        f"--nnodes 2 --node-rank 1 --master-addr 10.1.2.3 --port 29501 --timeout 42 --rdzv {rdzv}"
    assert run[1:3] == ["-m", "megareshard.launch"] and "--max-restarts" in run
    # single node: nothing to wait for, no pre-flight step
    env.update(NNODES="1")
    out = subprocess.run(["bash", str(ROOT / "examples/pretrain_gpt_distributed.sh")], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip().splitlines()
    assert len(out) == 2 and "--validate-only" in out[0] and not any("node_preflight" in line for line in out)
