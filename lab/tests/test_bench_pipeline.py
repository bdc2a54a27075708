"""lab/bench/bench_pipeline.py: configuration parsing, the simulator mode, and one tiny 4-rank run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab import ROOT, module_command  # noqa: F401
TOOL = module_command("lab.bench.bench_pipeline")

from lab.bench import bench_pipeline as bp
from lab.tests import run_as_torchrun, run_main

FIELDS = {"config", "schedule", "strategy", "delay_wgrad", "mode", "ms_per_iter", "ms_q1", "ms_q3", "ms_all",
          "tokens_per_s", "speedup_vs_baseline", "signal_config", "signal_ms", "signal_fraction",
          "best_signal_fraction", "transfer_model_ms", "transfer_nic_bytes", "action_ms", "pp", "tp", "dp",
          "microbatches", "nic_gbps"}


def _tool(argv: list[str], capsys) -> SimpleNamespace:
    return run_main(bp.main, argv, capsys)


def _env() -> dict[str, str]:
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", bp.ENV_ARGV):
        env.pop(k, None)
    return env


def test_configs_expand_with_one_signal_per_schedule():
    cs = bp.expand_configs("1f1b+sendrecv,eager-1f1b+broadcast+dw,1f1b+broadcast")
    assert [c.name for c in cs] == ["1f1b+sendrecv", "eager-1f1b+broadcast+dw", "1f1b+broadcast",
                                    "1f1b+signal", "eager-1f1b+signal+dw"]
    assert [c.name for c in bp.expand_configs("gpipe+allgather", with_signal=False)] == ["gpipe+allgather"]
    with pytest.raises(ValueError, match="SCHEDULE\\+STRATEGY"):
        bp.parse_config("1f1b+nccl")


def test_ratios():
    recs = [{"config": n, "schedule": n.split("+")[0], "strategy": n.split("+")[1], "delay_wgrad": n.endswith("+dw"),
             "ms_per_iter": ms} for n, ms in [("1f1b+sendrecv", 200.0), ("eager-1f1b+broadcast+dw", 110.0),
                                              ("1f1b+signal", 100.0), ("eager-1f1b+signal+dw", 90.0)]]
    bp.fill_ratios(recs, "1f1b+sendrecv")
    by = {r["config"]: r for r in recs}
    assert by["eager-1f1b+broadcast+dw"]["speedup_vs_baseline"] == pytest.approx(200 / 110)
    assert by["eager-1f1b+broadcast+dw"]["signal_config"] == "eager-1f1b+signal+dw"
    assert by["eager-1f1b+broadcast+dw"]["signal_fraction"] == pytest.approx(90 / 110)
    assert by["1f1b+sendrecv"]["signal_fraction"] == pytest.approx(0.5)
    assert by["1f1b+sendrecv"]["best_signal_fraction"] == pytest.approx(0.45)


def test_pace_parsing_and_calibration():
    from lab.cluster.pacing import calibrate_pace, parse_pace

    assert parse_pace("none") is None and parse_pace(None) is None
    assert parse_pace("F=60,b=120") == {"F": 0.06, "B": 0.12}
    for bad in ("F=0", "X=5", "F", "F=abc"):
        with pytest.raises(ValueError, match="KIND=MS"):
            parse_pace(bad)
    with pytest.raises(ValueError, match="--warmup >= 1"):
        parse_pace("auto", warmup=0)
    with pytest.raises(ValueError, match="--pace-margin >= 1"):
        parse_pace("auto", margin=0.5)
    # the tool validates its flags before any launch
    ns = bp.build_parser().parse_args(["--pace", "auto", "--warmup", "0"])
    with pytest.raises(ValueError, match="--warmup >= 1"):
        bp.check_args(ns)
    # stage 0: F durations 10..100 ms -> 0.9 quantile 90 ms × 1.25; B 40 ms but I + W = 30 + 30 ms:
    # B is raised to I + W, and I, W keep their ratio
    tr = [{"stage": 0, "kind": "F", "start": 0.0, "end": ms / 1e3} for ms in range(10, 101, 10)]
    tr += [{"stage": 0, "kind": k, "start": 0.0, "end": e} for k, e in (("B", 0.04), ("I", 0.03), ("W", 0.03))]
    tr += [{"stage": 1, "kind": "F", "start": 1.0, "end": 1.02}]
    (s0, s1) = calibrate_pace([tr, None], 2, 0.9, 1.25)
    assert s0["F"] == pytest.approx(0.09 * 1.25)
    assert s0["B"] == pytest.approx(0.06 * 1.25) and s0["I"] + s0["W"] == pytest.approx(s0["B"])
    assert s0["I"] == pytest.approx(s0["W"])
    assert s1 == {"F": pytest.approx(0.025)}


def test_simulate_needs_no_processes(tmp_path, capsys):
    out = tmp_path / "sim.json"
    r = _tool(["--simulate", "--nic-gbps", "0.1", "--cost-f", "20", "--json", str(out), "--trace-dir",
               str(tmp_path / "tr")], capsys)
    assert r.returncode == 0, r.stderr
    recs = json.loads(out.read_text())
    by = {x["config"]: x for x in recs}
    assert FIELDS <= set(recs[0])
    assert len(recs) == 10  # 6 default configurations + one signal run per (schedule, dw)
    assert all(x["mode"] == "simulated" for x in recs)
    # sendrecv moves the tp-replicated hidden state twice across the NIC, broadcast once
    assert by["1f1b+sendrecv"]["transfer_nic_bytes"] == 2 * by["1f1b+broadcast"]["transfer_nic_bytes"]
    # with communication that matters, the paper's ordering holds in the model
    ms = {k: v["ms_per_iter"] for k, v in by.items()}
    assert ms["1f1b+signal"] < ms["eager-1f1b+broadcast+dw"] < ms["1f1b+broadcast"] < ms["1f1b+sendrecv"]
    assert 0 < by["eager-1f1b+broadcast+dw"]["signal_fraction"] <= 1
    assert (tmp_path / "tr" / "eager-1f1b+broadcast+dw.json").exists()
    assert "1f1b+sendrecv" in r.stdout  # the table


@pytest.mark.slow
def test_two_configs_on_4_ranks(tmp_path):
    """4 ranks = 2 'hosts' × (tp 2), pp 2, tiny shapes: JSON fields, traces, signal reported as a fraction. The
    ranks are forked with torchrun's environment (a fresh interpreter per worker costs ~4.5 CPU-s of imports on
    2 cores); the tool's own torchrun launch is test_the_tool_starts_torchrun_on_itself's."""
    out = tmp_path / "run.json"
    cmd = ["--nproc", "4", "--procs-per-host", "2", "--tp", "2", "--pp", "2",
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
           "--micro-batch-size", "1", "--microbatches", "3", "--vocab-size", "64",
           # two real configurations and one signal run (--no-signal: not one per schedule, to stay small)
           "--configs", "1f1b+sendrecv,eager-1f1b+broadcast+dw,1f1b+signal", "--no-signal",
           "--iters", "2", "--warmup", "1", "--json", str(out), "--trace-dir", str(tmp_path / "tr"), "--trace-every-round",
           "--timeout", "120",
           "--pace", "auto", "--baseline", "1f1b+sendrecv"]
    ranks = run_as_torchrun("lab.bench.bench_pipeline", cmd, 4)
    assert [r.returncode for r in ranks] == [0] * 4, ranks[0].stderr[-3000:]
    recs = json.loads(out.read_text())
    by = {x["config"]: x for x in recs}
    assert set(by) == {"1f1b+sendrecv", "eager-1f1b+broadcast+dw", "1f1b+signal"}
    for x in recs:
        assert FIELDS <= set(x)
        assert x["mode"] == "measured, paced compute" and x["ms_per_iter"] > 0 and len(x["ms_all"]) == 2
        assert x["status"] == "complete" and x["rounds_done"] == x["rounds_planned"] == 2
        assert x["ms_q1"] <= x["ms_per_iter"] <= x["ms_q3"]
    base, sig = by["1f1b+sendrecv"], by["1f1b+signal"]
    assert base["speedup_vs_baseline"] == pytest.approx(1.0)
    assert base["signal_config"] == "1f1b+signal"
    assert base["signal_fraction"] == pytest.approx(sig["ms_per_iter"] / base["ms_per_iter"])
    assert sig["signal_fraction"] == pytest.approx(1.0)
    assert by["eager-1f1b+broadcast+dw"]["signal_fraction"] is None  # its own signal run was not asked for
    assert by["eager-1f1b+broadcast+dw"]["gap_closure"] is None and not by["eager-1f1b+broadcast+dw"]["void"]
    assert not list(tmp_path.glob("*.part"))  # the per-round writes went through a temporary file
    assert by["eager-1f1b+broadcast+dw"]["best_signal_fraction"] == pytest.approx(
        sig["ms_per_iter"] / by["eager-1f1b+broadcast+dw"]["ms_per_iter"])
    # measured per-action times: F on every stage, I and W for the delayed-W configuration
    assert all(v is not None for v in base["action_ms"]["F"])
    assert set(by["eager-1f1b+broadcast+dw"]["action_ms"]) >= {"F", "I", "W"}
    trace = json.loads((tmp_path / "tr" / "eager-1f1b+broadcast+dw.json").read_text())
    # --trace-every-round: each timed round's own timeline, the last one the run's trace
    rounds = sorted(p.name for p in (tmp_path / "tr").glob("1f1b+sendrecv.round*.json"))
    assert rounds == ["1f1b+sendrecv.round1.json", "1f1b+sendrecv.round2.json"], rounds
    assert json.loads((tmp_path / "tr" / "eager-1f1b+broadcast+dw.round2.json").read_text()) == trace
    assert {t["kind"] for t in trace} >= {"F", "I", "W", "SEND_F", "SEND_B"}
    assert base["transfer_nic_bytes"] == 2 * by["eager-1f1b+broadcast+dw"]["transfer_nic_bytes"]
    # paced compute: budgets per stage from the warm-up, the same for every configuration, and
    # every timed action took at least its budget (the trace's spans include the padding)
    pace = base["pace_ms"]
    assert len(pace) == 2 and all(p["F"] > 0 for p in pace) and all(x["pace_ms"] == pace for x in recs)
    assert isinstance(base["pace_overruns"], int) and base["pace_overrun_ms_per_iter"] >= 0
    for x in recs:
        for kind, per_stage in x["action_ms"].items():
            if kind in ("F", "B", "I", "W"):
                for s, ms in enumerate(per_stage):
                    assert ms is None or ms >= 0.99 * pace[s][kind], (x["config"], kind, s, ms, pace[s])


def test_simulate_utransformer_has_skip_edges(tmp_path, capsys):
    out = tmp_path / "u.json"
    r = _tool(["--simulate", "--model", "utransformer", "--nic-gbps", "0.2",
               "--configs", "1f1b+allgather,eager-1f1b+broadcast+dw", "--json", str(out)], capsys)
    assert r.returncode == 0, r.stderr
    recs = json.loads(out.read_text())
    edges = set(recs[0]["edge_model_ms"])
    assert {"0->3:skip0", "1->3:skip1"} <= edges  # mirrored levels on non-adjacent stages
    assert recs[0]["config"] == "1f1b+allgather" and recs[0]["model"] == "utransformer"


# ---- issue 13: the Megatron-style baseline, gap closure, void, the NIC-rate grid ------------------------
from lab.bench import pipeline_grid as pg


def _recs(times: dict[str, float], baseline: str = "1f1b+allgather") -> list[dict]:
    recs = [{"config": n, "schedule": n.split("+")[0], "strategy": n.split("+")[1], "delay_wgrad": n.endswith("+dw"),
             "ms_per_iter": ms, "ms_q1": ms, "ms_q3": ms, "ms_all": [ms], "ms_min": ms, "transfer_model_ms": 1.0}
            for n, ms in times.items()]
    bp.fill_ratios(recs, baseline)
    return recs


def _times(base: float, method: float, base_sig: float = 100.0, meth_sig: float = 90.0) -> dict[str, float]:
    return {"1f1b+allgather": base, "1f1b+sendrecv": 2 * base, "eager-1f1b+broadcast+dw": method,
            "1f1b+signal": base_sig, "eager-1f1b+signal+dw": meth_sig}


def test_baseline_is_megatron_style_and_gap_closure():
    a = bp.resolve_defaults(bp.build_parser().parse_args([]))
    assert a.baseline == "1f1b+allgather" and "1f1b+allgather" in a.configs and "1f1b+sendrecv" in a.configs
    by = {r["config"]: r for r in _recs(_times(200.0, 110.0))}
    m = by["eager-1f1b+broadcast+dw"]
    # the method's own signal run (same schedule, delayed W) bounds it: (200 - 110) / (200 - 90)
    assert m["speedup_vs_baseline"] == pytest.approx(200 / 110)
    assert m["gap_closure"] == pytest.approx(90 / 110) and m["signal_fraction"] == pytest.approx(90 / 110)
    assert by["1f1b+allgather"]["gap_closure"] == 0.0 and by["1f1b+sendrecv"]["gap_closure"] == pytest.approx(-2.0)
    assert bp.gap_closure(100.0, 95.0, 100.0) is None  # no gap to close: undefined, not infinite
    assert not any(r["void"] for r in by.values())
    # faster than its own signal bound: void, in the record and in the Markdown table
    void = {r["config"]: r for r in _recs(_times(200.0, 80.0))}["eager-1f1b+broadcast+dw"]
    assert void["void"] and void["signal_fraction"] > 1 and void["gap_closure"] > 1
    table = bp.format_table(_recs(_times(200.0, 80.0)))
    assert table.startswith("| config |") and "**void**" in table and "vs 1f1b+allgather" in table


def test_pace_budget_missing_for_a_kind_is_an_error():
    from lab.cluster.pacing import calibrate_pace, needed_kinds, parse_pace

    assert needed_kinds([False]) == ("F", "B") and needed_kinds([True, False]) == ("F", "B", "I", "W")
    with pytest.raises(ValueError, match=r"no budget for I, W .*budgets given: F=60 ms, B=120 ms"):
        parse_pace("F=60,B=120", needed=needed_kinds([False, True]))
    assert parse_pace("F=60,B=120", needed=("F", "B")) == {"F": 0.06, "B": 0.12}
    # auto: a kind the warm-up never traced on a stage
    tr = [{"stage": s, "kind": k, "start": 0.0, "end": 0.01} for s in (0, 1) for k in ("F", "B")]
    tr = [r for r in tr if not (r["stage"] == 1 and r["kind"] == "B")]
    with pytest.raises(ValueError, match=r"stage 1 .*no budget for B.*budgets given: F=12.5 ms"):
        calibrate_pace([tr], 2, 0.9, 1.25, needed=("F", "B"))
    # the tool checks before any launch, with the configurations' kinds
    ns = bp.build_parser().parse_args(["--pace", "F=60,B=120", "--configs", "1f1b+allgather,eager-1f1b+broadcast+dw"])
    with pytest.raises(ValueError, match="no budget for I, W"):
        bp.check_args(ns)
    r = subprocess.run([*TOOL, "--pace", "F=60,B=120"], env=_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no budget for I, W" in r.stderr


def _point(rate: float, times: dict[str, float] | None, status: str = "complete") -> dict:
    recs = _recs(times) if times else []
    return {"rate_mbit": rate, "status": status, "reason": None if status == "complete" else "timed out after 9 s",
            "rounds_done": 1 if recs else 0, "rounds_planned": 4, "wall_s": 1.0, "records": recs,
            "simulated": _recs(times) if times else None}


def _grid(points: list[dict]) -> dict:
    return {"kind": pg.GRID_KIND, "model": "gpt", "rates_mbit": [p["rate_mbit"] for p in points],
            "baseline": "1f1b+allgather", "method": "eager-1f1b+broadcast+dw", "extra": "1f1b+sendrecv",
            "configs": list(_times(1, 1)), "cluster": "synthetic", "points": points,
            "target": {"baseline_below": 0.9, "gap_closure_at_least": 0.75}}


def test_target_per_rate_and_the_line():
    # baseline 100 / signal bounds 100 and 90 -> baseline at its bound: n/a
    # baseline 200, method 110, method's signal 90: closure 82 % -> met
    # baseline 200, method 150: closure 45 % -> not met
    # method 80 < its signal 90: void, never met
    grid = _grid([_point(160, _times(100.0, 95.0, 100.0, 95.0)), _point(80, _times(200.0, 110.0)),
                  _point(40, _times(200.0, 150.0)), _point(20, _times(200.0, 80.0)),
                  _point(10, _times(400.0, 300.0), status="stopped"), _point(5, None, status="not run")])
    line, rows = pg.target_verdict(grid)
    assert [r["status"] for r in rows] == ["n/a", "met", "not met", "void", "stopped", "not run"]
    assert rows[1]["gap_closure"] == pytest.approx(90 / 110) and rows[0]["baseline_fraction"] == pytest.approx(1.0)
    assert "NOT MET" in line and "met at 1 of 5 such rates" in line and "20 Mbit/s void" in line
    ok, _ = pg.target_verdict(_grid([_point(160, _times(100.0, 95.0, 100.0, 95.0)), _point(80, _times(200.0, 110.0))]))
    assert ": MET (met at 1 of 1 such rates" in ok
    # a void baseline is void too (its 'fraction of the bound' cannot decide whether the target applies)
    assert pg.target_row(_point(80, _times(80.0, 85.0)), "1f1b+allgather", "eager-1f1b+broadcast+dw")["status"] == "void"


def test_stopped_run_keeps_its_partial_numbers():
    partial = _recs(_times(200.0, 110.0))
    for r in partial:
        r.update(status="running", rounds_done=2, rounds_planned=4)
    p = bp.point_from_run(40.0, 124, partial, "timed out after 600 s", 601.0, 4)
    assert p["status"] == "stopped" and p["reason"] == "timed out after 600 s" and p["rounds_done"] == 2
    assert len(p["records"]) == 5 and all(r["status"] == "stopped" for r in p["records"])
    assert bp.point_from_run(40.0, 1, None, None, 3.0, 4)["reason"] == "exit code 1"
    done = [dict(r, status="complete", rounds_done=4) for r in partial]
    assert bp.point_from_run(40.0, 0, done, None, 9.0, 4)["status"] == "complete"
    # exit 0 without the final records (killed between two writes) is not complete
    assert bp.point_from_run(40.0, 0, partial, None, 9.0, 4)["status"] == "stopped"


def test_the_tool_starts_torchrun_on_itself(tmp_path, monkeypatch):
    """Outside torchrun the tool starts ``torchrun --standalone`` on itself, the arguments in the environment; a
    failing launch marks what the worker wrote as stopped, with the exit code."""
    started = []

    class FakeTorchrun:
        def __init__(self, cmd, env, start_new_session):
            started.append((cmd, env, start_new_session))

        def wait(self, timeout):
            return 3

    for k in ("RANK", "WORLD_SIZE", bp.ENV_ARGV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(bp.subprocess, "Popen", FakeTorchrun)
    path = tmp_path / "run.json"
    path.write_text(json.dumps([{"config": "1f1b+sendrecv", "status": "running", "rounds_done": 1}]))
    argv = ["--nproc", "4", "--procs-per-host", "2", "--tp", "2", "--pp", "2", "--json", str(path)]
    assert bp.main(argv) == 3
    (cmd, env, own_session), = started
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
                       "lab.bench.bench_pipeline"] and own_session
    assert json.loads(env[bp.ENV_ARGV]) == argv and env["OMP_NUM_THREADS"] == "1"
    rec, = json.loads(path.read_text())
    assert rec["status"] == "stopped" and rec["stop_reason"] == "exit code 3"


def test_a_stopped_launch_marks_its_json(tmp_path):
    """lab/bench/bench_pipeline.py's own launcher (timeout, Ctrl-C, a failing rank): the rounds the worker wrote
    stay, marked stopped with the reason, and the table says so."""
    partial = _recs(_times(200.0, 110.0))
    for r in partial:
        r.update(status="running", rounds_done=2, rounds_planned=4)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(partial))
    bp.mark_stopped(str(path), "timed out after 40s")
    recs = json.loads(path.read_text())
    assert len(recs) == 5 and {(r["status"], r["stop_reason"]) for r in recs} == {("stopped", "timed out after 40s")}
    assert bp.format_table(recs).startswith("*stopped after 2 of 4 timed rounds (timed out after 40s)*")
    bp.mark_stopped(str(tmp_path / "none.json"), "interrupted")  # stopped before any round: nothing to mark
    assert not (tmp_path / "none.json").exists()


def test_grid_flags_and_point_command():
    p = bp.build_parser()
    a = bp.resolve_defaults(p.parse_args(["--grid", "--pace-margin", "1.5"]))
    assert (a.iters, a.pace, a.configs) == (4, "auto", bp.GRID_CONFIGS) and a.rates is None
    from lab.bench.grid_points import GRID_POINTS, parse_points

    for model in ("gpt", "utransformer"):  # the operating points fixed before running (grid_points.py)
        assert bp.grid_points_of(a, model) == parse_points(GRID_POINTS[model]) and len(GRID_POINTS[model].split(",")) >= 6
    assert [pt["rate_mbit"] for pt in bp.grid_points_of(bp.resolve_defaults(p.parse_args(["--grid", "--rates", "80,20"])),
                                                         "gpt")] == [20, 80]
    assert len(bp.parse_rates(bp.GRID_RATES)) >= 5
    for bad in ("", "10,x", "10,10", "0,5"):
        with pytest.raises(ValueError, match="--rates"):
            bp.parse_rates(bad)
    cmd = bp.point_command(p, a, "utransformer", 40.0, "out.json")
    assert cmd[cmd.index("--nic-rate") + 1] == "40000kbit" and cmd[cmd.index("--hosts") + 1] == "4"
    worker = cmd[cmd.index("--") + 3:]  # after "-- -m lab.bench.bench_pipeline"
    assert "--grid" not in worker and "--rates" not in worker and "--dry-run" not in worker
    assert worker[worker.index("--nic-gbps") + 1] == "0.04" and worker[worker.index("--model") + 1] == "utransformer"
    assert worker[worker.index("--pace-margin") + 1] == "1.5" and worker[worker.index("--pace") + 1] == "auto"
    assert worker[worker.index("--json") + 1] == "out.json"
    # the worker parses exactly what the point hands it
    w = bp.resolve_defaults(p.parse_args(worker))
    assert (w.model, w.nic_gbps, w.iters, w.configs, w.procs_per_host) == ("utransformer", 0.04, 4, a.configs, 2)
    # a wall-time estimate: every round runs every configuration once, plus set-up
    recs = [{"ms_per_iter": 1000.0}, {"ms_per_iter": 2000.0}]
    assert bp.estimate_point_s(recs, a, 30.0) == pytest.approx(30.0 + (2 + 1 + 4) * 3.0)


def test_from_json_redraws_the_grid(tmp_path, capsys):
    grid = _grid([_point(80, _times(200.0, 110.0)), _point(40, _times(200.0, 80.0)),
                  _point(20, _times(400.0, 300.0), status="stopped")])
    src = tmp_path / "pipeline_grid_gpt.json"
    src.write_text(json.dumps(grid))
    png = tmp_path / "grid.png"
    r = _tool(["--from-json", str(src), "--plot", str(png)], capsys)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "| NIC Mbit/s | run | 1f1b+allgather ms |" in out
    assert "| 80 | complete | 200 | 50% | - | 0.50× | 110 | 1.82× | 82% | 82% | - | - | 1.82× / 82% / 82% / - |" in out
    assert "stopped after 1/4 rounds (timed out after 9 s)" in out and "**void**" in out
    assert "| 80 | 50% | 82% | met |  |" in out and "| 40 | 50% | 109% | void |  |" in out
    assert "target (gpt):" in out and "NOT MET" in out
    assert out.count("#### gpt, NIC") == 3  # every point's full table, the stopped one included
    assert png.stat().st_size > 10_000
    assert json.loads(src.read_text()) == grid  # read, not rewritten


def test_grid_dry_run_runs_nothing(tmp_path, capsys):
    """--grid --dry-run: one command per point and the simulator's wall-time estimate; no cluster, no files."""
    r = _tool(["--grid", "--dry-run", "--rates", "20,80", "--models", "gpt", "--cost-f", "20",
               "--results-dir", str(tmp_path / "res"), "--img-dir", str(tmp_path / "img")], capsys)
    assert r.returncode == 0, r.stderr
    cmds = [x for x in r.stdout.splitlines() if "lab.cluster.emulate_cluster" in x]
    assert len(cmds) == 2 and "--nic-rate 20000kbit" in cmds[0] and "--nic-rate 80000kbit" in cmds[1]
    assert "# whole grid: about" in r.stdout
    assert not (tmp_path / "res").exists() and not (tmp_path / "img").exists()
    r = _tool(["--grid", "--dry-run", "--models", "bert"], capsys)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--models 'bert'" in r.stderr


def test_grid_driver_reports_every_point_started(tmp_path, monkeypatch):
    """The grid loop without a cluster: each point's command is replaced by a fake run that writes the
    records a worker would (complete; or one timed round, then the cluster's timeout exit 124)."""
    from lab.cluster import emulate_cluster

    pace = [{"F": 20.0, "B": 40.0, "I": 30.0, "W": 10.0}] * 4
    full = [dict(r, status="complete", rounds_done=4, rounds_planned=4, pace_ms=pace) for r in _recs(_times(200, 110))]
    part = [dict(r, status="running", rounds_done=1, rounds_planned=4, pace_ms=pace) for r in _recs(_times(300, 250))]

    def fake_command(p, a, model, rate, out):
        recs, rc = (full, 0) if rate == 80 else (part, 124)
        src = tmp_path / f"fake-{rate:g}.json"
        src.write_text(json.dumps(recs))
        return [sys.executable, "-c", f"import shutil, sys; shutil.copy({str(src)!r}, {out!r}); sys.exit({rc})"]

    monkeypatch.setattr(bp, "point_command", fake_command)
    monkeypatch.setattr(emulate_cluster, "check_privileges", lambda: None)
    res, img = tmp_path / "res", tmp_path / "img"
    argv = ["--grid", "--models", "gpt", "--rates", "80,20", "--point-timeout", "30", "--results-dir", str(res),
            "--img-dir", str(img)]
    monkeypatch.setattr(sys, "argv", ["bench_pipeline.py"] + argv)
    assert bp.main(argv) == 0
    grid = json.loads((res / "pipeline_grid_gpt.json").read_text())
    assert grid["kind"] == pg.GRID_KIND and grid["rates_mbit"] == [20, 80] and grid["baseline"] == "1f1b+allgather"
    p20, p80 = grid["points"]
    assert p20["status"] == "stopped" and p20["reason"] == "timed out after 30 s" and p20["rounds_done"] == 1
    assert {r["config"] for r in p20["records"]} == set(_times(1, 1)) and p20["records"][0]["status"] == "stopped"
    assert p80["status"] == "complete" and p80["reason"] is None
    for p in (p20, p80):  # the simulator beside every point with numbers, at that point's rate
        sim = {r["config"]: r for r in p["simulated"]}
        assert sim["1f1b+allgather"]["mode"] == "simulated" and sim["1f1b+allgather"]["nic_gbps"] == p["rate_mbit"] / 1e3
        assert sim["1f1b+sendrecv"]["ms_per_iter"] > sim["1f1b+allgather"]["ms_per_iter"]
    assert (img / "pipeline_grid_gpt.png").exists()


def test_ctrl_c_stops_a_point_and_waits_for_its_cluster(tmp_path):
    """Ctrl-C reaches the whole process group: the point's process ends, the driver waits for it and then
    sees KeyboardInterrupt (the grid records the point as stopped, 'interrupted')."""
    script = f"""
import os, signal, sys, threading
from lab.bench import bench_pipeline as bp
child = [sys.executable, "-c", "import time; open({str(tmp_path / 'started')!r}, 'w').close(); time.sleep(30)"]
def ctrl_c():
    while not os.path.exists({str(tmp_path / 'started')!r}):
        threading.Event().wait(0.05)
    os.killpg(os.getpgid(0), signal.SIGINT)
threading.Thread(target=ctrl_c, daemon=True).start()
try:
    bp._run_point(child, 60)
except KeyboardInterrupt:
    print("interrupted")
"""
    # its own process group (the SIGINT stays inside it), with SIGINT's default action: a suite started in the
    # background of a shell (`bash tests/run.sh &`) inherits SIGINT ignored, and Python then installs no handler
    r = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=60,
                       start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.stdout.strip() == "interrupted", r.stderr[-2000:]


def test_a_rank_with_several_stages_paces_each_to_its_own_budget():
    """The pacing hook's budgets per kind, or per kind and virtual stage (a rank that holds stages of unequal
    cost, as interleaved and V schedules place them): each action sleeps to its own stage's budget, and the
    budgets granted are counted per kind."""
    import time
    from types import SimpleNamespace as NS

    from lab.cluster.pacing import pacer

    hook = pacer(NS(stage=0, hooks=[]))
    hook.budgets = {"F": {0: 0.02, 3: 0.04}, "B": 0.01}
    stats: dict = {}

    def act(kind, stage):
        return NS(kind=NS(value=kind, is_compute=True), stage=stage)

    for kind, stage, want in (("F", 0, 0.02), ("F", 3, 0.04), ("B", 3, 0.01)):
        t0 = time.time()
        hook.before(act(kind, stage), stats)
        hook.after(act(kind, stage), stats, None)
        assert time.time() - t0 >= want, (kind, stage)
    assert stats["paced_budget_us_F"] == 60000 and stats["paced_budget_us_B"] == 10000
    assert stats["paced_n_F"] == 2 and "pace_overruns" not in stats
    with pytest.raises(ValueError, match="no pacing budget for kind 'F'"):  # a stage the dict leaves out
        hook.before(act("F", 1), stats)
        hook.after(act("F", 1), stats, None)
