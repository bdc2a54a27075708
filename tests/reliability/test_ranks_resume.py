"""Auto-resume under torchrun --max-restarts: a rank SIGKILLed mid-iteration, the workers restarted by
torchrun, the run resumed from the newest complete checkpoint (--save D --load D) and ending bitwise
equal (every weight, every optimizer tensor) to an uninterrupted run; only the iterations after the last
save are redone."""
import pytest

from ._ranks import chaos_ranks


@pytest.mark.slow
def test_killed_rank_restarts_from_last_save_and_ends_bitwise_equal(tmp_path):
    cr = chaos_ranks()
    r = cr.trial_rank_killed_restart(str(tmp_path), quick=True)
    log = r["log"]
    assert r["exit_code"] == 0, log[-3000:]
    # the first attempt found nothing to load and started fresh; the restart loaded the last save
    assert "holds no checkpoint" in log and "training starts from scratch" in log
    assert "injecting fault 'kill' in iteration 5" in log
    assert f"loaded {tmp_path}/ck/iter_0000003 (iteration 3" in log
    # the survivor named what it was doing when its peer vanished, before torchrun restarted everyone
    assert r["reports"] and all(k.startswith("failed after") for _, _, k in r["reports"]), log[-3000:]
    assert all("stage 0 action" in w and "peer stage 1" in w for _, w, _ in r["reports"])
    # iterations 1-4 in the first attempt, 4-8 after the restart: only iteration 4 (after the save at 3) redone
    assert r["iterations"] == [1, 2, 3, 4, 4, 5, 6, 7, 8]
    assert r["steps_lost"] == r["expected_redone"] == 1
    assert r["recovered"], r["data_lost"]
    assert cr.FAULTS[0][0] == "rank-killed-restart"
