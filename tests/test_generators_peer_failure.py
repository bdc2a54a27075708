"""A generator rank that dies (issue #50, same-job generators): one launch of 4 gloo ranks through the real entry
point and rendezvous (``pretrain_gpt.main`` with torchrun's environment, as a worker runs it) — a trainer at pp 2 on
ranks 0-1 saving every step, a tp 2 generator replica on ranks 2-3 receiving the weights after every step. Rank 3
SIGKILLs itself as its second transfer starts (the trainer is inside that transfer). Every survivor, trainer and
generator alike, exits at once with one line naming its rank, what it was doing and that a peer died (the watchdog's report,
exit code 1: the launcher's peer-failure tier), no traceback and no hang; the launcher's summary names the killed
rank; the newest complete checkpoint is the first step's and holds exactly what a run without generators saves at
that step (the transfer never touched the trainer's weights)."""
from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
import torch

from tests.harness import RankFailure, free_port, run_pretrain, run_ranks

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", "8", "--init-method-std", "0.3",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-2", "--device", "cpu",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "0",
         "--pipeline-model-parallel-size", "2", "--train-iters", "4", "--save-interval", "1",
         "--comm-timeout", "60"]
VICTIM = 3  # the tp 2 replica's second rank
LINE = re.compile(r"pretrain_gpt\.py: error: rank (\d): '(.+)' failed after [\d.]+s: .+ \(a peer rank died, stalled "
                  r"or lost its network\)")


def _worker(rank: int, world: int, argv: list[str], port: int, logs: str) -> int:
    """A torchrun worker: its environment, its output in a log, ``pretrain_gpt.py`` as a script runs it."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fd = os.open(os.path.join(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if rank == VICTIM:  # the fault, injected here: the product has no test branch
        from megareshard.transfer import WeightTransfer
        run, calls = WeightTransfer.run, []

        def dying_run(self, *a, **k):
            calls.append(1)
            if len(calls) == 2:  # its second transfer, after iteration 2
                os.kill(os.getpid(), signal.SIGKILL)
            return run(self, *a, **k)

        WeightTransfer.run = dying_run
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from pretrain_gpt import main

    try:
        return main(list(argv), hard_exit_after_peer_failure=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


@pytest.mark.slow
def test_a_dead_generator_is_a_peer_failure_and_leaves_the_checkpoints_alone(tmp_path):
    from lab.chaos.chaos_ranks import latest_state
    from megareshard.generation import read_model_weights

    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    logs.mkdir()
    argv = MODEL + ["--save", str(ckpt), "--generator-layouts", "tp2", "--transfer-interval", "1",
                    "--generator-prompts", "1 2 3", "--generator-max-new-tokens", "2"]
    start = time.monotonic()
    with pytest.raises(RankFailure) as failed:
        run_ranks(_worker, 4, argv, free_port(), str(logs), init_group=False, timeout=120)
    took = time.monotonic() - start
    story = str(failed.value)
    # no hang: every rank ended on its own (none "still running after another rank failed", none timed out)
    assert "still running" not in story and "timed out" not in story, story
    assert f"rank {VICTIM} -----\nprocess exited with code -9" in story, story
    for r in (0, 1, 2):
        assert f"----- rank {r} -----\nprocess exited with code 1 " in story, story  # os._exit(1) after its line
        text = (logs / f"rank{r}.log").read_text()
        errors = [line for line in text.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in text, (r, text[-3000:])
        m = LINE.fullmatch(errors[0])
        assert m and int(m[1]) == r, (r, errors[0])
        assert "weight transfer after iteration 2" in m[2], errors[0]
    assert took < 60, took
    # the launcher's summary (megareshard/launch/launcher.py) names the killed rank first
    from megareshard.launch import launcher

    ranks = []
    for r, code in ((0, 1), (1, 1), (2, 1), (3, -signal.SIGKILL)):
        d = tmp_path / "attempt_0" / str(r)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text((logs / f"rank{r}.log").read_text())
        ranks.append(launcher._Rank(r, r, 1000 + r, code, str(d)))
    err = _capture_stderr(lambda: launcher._report(ranks, "failed"))
    assert err.splitlines()[0] == "megareshard-run: rank 3 (and 3 other ranks) failed (killed by SIGKILL)", err
    # the checkpoints: the first step's is the newest complete one, and equals a run without generators
    assert latest_state(str(ckpt)) == (1, "complete")
    assert not (ckpt / "iter_0000002").exists()
    ref = tmp_path / "ref"
    run_pretrain(MODEL + ["--save", str(ref)], 2, str(tmp_path / "ref.rank{}.log"), timeout=120)  # the same schedule
    _, got = read_model_weights(str(ckpt / "iter_0000001"))
    _, want = read_model_weights(str(ref / "iter_0000001"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _capture_stderr(fn) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        fn()
    return buf.getvalue()
