"""Preemption: SIGTERM to examples/pretrain_gpt_distributed.sh (what Slurm's --signal=TERM@120 does) makes
the training processes (--exit-signal-handler) save at the next iteration boundary and the job exit 0; the
next job, same flags, continues from that save and ends bitwise equal to an uninterrupted run."""
import re
from pathlib import Path

import pytest

from ._ranks import ROOT, chaos_ranks


def test_sbatch_asks_for_the_signal_and_the_script_resumes():
    sbatch = (ROOT / "examples/slurm/pretrain_gpt.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=TERM@120\b", sbatch, re.M)
    script = (ROOT / "examples/pretrain_gpt_distributed.sh").read_text()
    for needed in ('--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"', "--exit-signal-handler",
                   '--max-restarts "${MAX_RESTARTS:-3}"', "megareshard.launch.node_preflight"):
        assert needed in script, needed


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_next_job_continues_bitwise(tmp_path):
    r = chaos_ranks().trial_preempted(str(tmp_path), quick=True)
    log = r["log"]
    assert r["exit_code"] == 0, log[-3000:]
    assert "SIGTERM received" in log and r["stopped_at"] is not None and 3 <= r["stopped_at"] < 40, log[-3000:]
    assert r["saved"] == r["stopped_at"]          # saved at the boundary it stopped at, and that save is latest
    assert r["resumed_from"] == r["saved"]        # the next job continued from it (did not start over)
    assert r["detected"] and r["recovered"], r["data_lost"]
    assert not list(Path(tmp_path, "ck").glob(".tmp.*"))
