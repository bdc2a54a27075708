"""A rank killed (SIGKILL) or stopped (SIGSTOP) mid-iteration, with no launcher to clean up: every
surviving rank exits non-zero within --comm-timeout (plus a loaded machine's slack) with the watchdog's
per-rank report — stage, action, microbatch, peer — and no hang; `latest` still names the last complete
checkpoint. The NIC-down case runs only in lab/chaos/chaos.py (the emulated cluster takes too long for CI)."""
import re

import pytest

from lab.chaos.faults import parse_faults

from ._ranks import chaos_ranks

REPORT = re.compile(r"stage (\d) action W[FB]\d+<-(\d) \(microbatch \d+, peer stage \2 on ranks \[\d+\]\)")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kill", "stop"])
def test_every_survivor_reports_and_exits_nonzero(tmp_path, kind):
    r = chaos_ranks()._survivor_trial(str(tmp_path), True, kind)
    assert not r["hung"], r["how"]
    assert sorted(r["per_rank"]) == [0, 1]                       # rank 2 (the last stage) was the victim
    for rank, v in r["per_rank"].items():
        assert v["code"] == 1, (rank, v)
        assert v["report"] is not None, (rank, v["last"])
        assert REPORT.fullmatch(v["report"][1]), v["report"]     # stage, action, microbatch, peer
        # a dead peer closes its sockets: an error at once; a stopped one: gloo's timeout or the watchdog's
        assert v["report"][2].startswith("failed after" if kind == "kill" else ("has run for", "failed after"))
        assert v["exit_s"] is not None and v["exit_s"] < r["limit_s"], v
    # the stage next to the victim waits for it; stage 0 waits for stage 1
    assert {int(REPORT.fullmatch(v["report"][1])[2]) for v in r["per_rank"].values()} <= {1, 2}
    assert r["latest_verdict"] == "complete" and r["latest"] == r["last_save"] == 2, r["data_lost"]


def test_fault_spec_is_checked():
    assert [(f.kind, f.rank, f.iteration) for f in parse_faults("kill@1:5, stop@0:7")] == [("kill", 1, 5),
                                                                                          ("stop", 0, 7)]
    with pytest.raises(ValueError, match="'explode@1:5' is not KIND@RANK:ITERATION"):
        parse_faults("explode@1:5")
    with pytest.raises(ValueError, match="ITERATION >= 1"):
        parse_faults("kill@1:0")


def test_watchdog_reports_a_communication_error_once_and_ignores_others():
    import io

    from megareshard.launch import Watchdog, is_communication_error

    out = io.StringIO()
    dog = Watchdog(60, 3, out=out, on_fire=lambda code: None)
    try:
        with pytest.raises(ValueError):
            with dog.activity("iteration 4"):
                raise ValueError("token id 999 is outside the vocabulary")   # a bug or bad data: not a peer
        assert dog.failure is None and out.getvalue() == ""
        gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6050: "
                            "Connection reset by peer")
        with pytest.raises(RuntimeError):
            with dog.activity("iteration 5"):
                with dog.activity("stage 1 action WB0<-2 (microbatch 0, peer stage 2 on ranks [2])"):
                    raise gloo
        lines = out.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "[watchdog] rank 3: 'stage 1 action WB0<-2 (microbatch 0, peer stage 2 on ranks [2])' failed after ")
        assert "Connection reset by peer" in lines[0] and dog.failure in lines[0]
    finally:
        dog.stop()
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = gloo
    assert is_communication_error(wrapped) and not is_communication_error(KeyboardInterrupt())


def test_untimed_activity_never_fires_but_a_timed_one_does():
    import io
    import time

    from megareshard.launch import Watchdog

    fired = []
    dog = Watchdog(0.2, 0, out=io.StringIO(), on_fire=fired.append)
    try:
        with dog.activity("saving checkpoint of iteration 4", timed=False):   # a large save may take long
            time.sleep(0.7)
        assert fired == []
        with dog.activity("stage 0 action WF1<-1 (microbatch 1, peer stage 1 on ranks [1])"):
            time.sleep(0.7)
        assert fired == [1]
    finally:
        dog.stop()
