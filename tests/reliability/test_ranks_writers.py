"""One writer per checkpoint directory, and workers that end with their launcher — in one run of real torchrun
jobs (lab.chaos.chaos_ranks.writers_trial): job A trains with --save D; job B on the same D stops at start-up with ONE
line (two ranks raise it, the first to report prints it) naming A's rank 0, and A's checkpoints stay intact;
`kill -9` of A's torchrun ends every A worker within --comm-timeout, saying why, and the lock died with A (taken
here at once; that the next job then resumes from the last save is test_ranks_resume's)."""
import re
import socket

import pytest

from ._ranks import chaos_ranks


@pytest.mark.slow
def test_second_job_is_refused_and_workers_die_with_their_launcher(tmp_path):
    r = chaos_ranks().writers_trial(str(tmp_path), True, resume=False)
    assert r["a_started"], r["log"][-3000:]

    s = r["second"]
    assert s["code"] == 1 and not s["started_training"], s["log"][-3000:]
    assert len(s["lines"]) == 1, s["log"][-3000:]              # printed once, not once per rank
    line = s["lines"][0]
    assert line.startswith("pretrain_gpt.py: error: --save ") and len(line.replace(str(tmp_path), "D")) < 300, line
    assert re.search(rf"pid {s['a_rank0_pid']} on host {re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d ",
                     line), line
    assert s["latest_verdict"] == "complete" and s["iterations_before"] <= s["iterations_after"], s

    k = r["kill"]
    assert not k["survivors"] and all(t <= k["limit_s"] for t in k["gone_s"].values()), k
    assert len(k["lines"]) == 1 and "the launcher (torchrun agent, pid " in k["lines"][0], r["log"][-3000:]
    assert k["latest_verdict"] == "complete" and k["latest"] >= 5, k
    assert k["lock_holder_after"] is None, k                   # no stale lock: free the moment A's rank 0 died
