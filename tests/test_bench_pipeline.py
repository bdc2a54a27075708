"""tools/bench_pipeline.py: configuration parsing, the simulator mode, and one tiny torchrun launch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_pipeline.py"
sys.path.insert(0, str(ROOT / "tools"))

import bench_pipeline as bp  # noqa: E402

FIELDS = {"config", "schedule", "strategy", "delay_wgrad", "mode", "ms_per_iter", "ms_q1", "ms_q3", "ms_all",
          "tokens_per_s", "speedup_vs_baseline", "signal_config", "signal_ms", "signal_fraction",
          "best_signal_fraction", "transfer_model_ms", "transfer_nic_bytes", "action_ms", "pp", "tp", "dp",
          "microbatches", "nic_gbps"}


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
    from megareshard.pipeline.pacing import calibrate_pace, parse_pace

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


def test_simulate_needs_no_processes(tmp_path):
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, str(TOOL), "--simulate", "--nic-gbps", "0.1", "--cost-f", "20",
                        "--json", str(out), "--trace-dir", str(tmp_path / "tr")],
                       env=_env(), capture_output=True, text=True, timeout=120)
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


def test_torchrun_two_configs(tmp_path):
    """4 ranks = 2 'hosts' × (tp 2), pp 2, tiny shapes: JSON fields, traces, signal reported as a fraction."""
    out = tmp_path / "run.json"
    cmd = [sys.executable, str(TOOL), "--nproc", "4", "--procs-per-host", "2", "--tp", "2", "--pp", "2",
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
           "--micro-batch-size", "1", "--microbatches", "3", "--vocab-size", "64",
           # two real configurations and one signal run (--no-signal: not one per schedule, to stay small)
           "--configs", "1f1b+sendrecv,eager-1f1b+broadcast+dw,1f1b+signal", "--no-signal",
           "--iters", "2", "--warmup", "1", "--json", str(out), "--trace-dir", str(tmp_path / "tr"), "--timeout", "120",
           "--pace", "auto"]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = json.loads(out.read_text())
    by = {x["config"]: x for x in recs}
    assert set(by) == {"1f1b+sendrecv", "eager-1f1b+broadcast+dw", "1f1b+signal"}
    for x in recs:
        assert FIELDS <= set(x)
        assert x["mode"] == "measured, paced compute" and x["ms_per_iter"] > 0 and len(x["ms_all"]) == 2
        assert x["ms_q1"] <= x["ms_per_iter"] <= x["ms_q3"]
    base, sig = by["1f1b+sendrecv"], by["1f1b+signal"]
    assert base["speedup_vs_baseline"] == pytest.approx(1.0)
    assert base["signal_config"] == "1f1b+signal"
    assert base["signal_fraction"] == pytest.approx(sig["ms_per_iter"] / base["ms_per_iter"])
    assert sig["signal_fraction"] == pytest.approx(1.0)
    assert by["eager-1f1b+broadcast+dw"]["signal_fraction"] is None  # its own signal run was not asked for
    assert by["eager-1f1b+broadcast+dw"]["best_signal_fraction"] == pytest.approx(
        sig["ms_per_iter"] / by["eager-1f1b+broadcast+dw"]["ms_per_iter"])
    # measured per-action times: F on every stage, I and W for the delayed-W configuration
    assert all(v is not None for v in base["action_ms"]["F"])
    assert set(by["eager-1f1b+broadcast+dw"]["action_ms"]) >= {"F", "I", "W"}
    trace = json.loads((tmp_path / "tr" / "eager-1f1b+broadcast+dw.json").read_text())
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


def test_simulate_utransformer_has_skip_edges(tmp_path):
    out = tmp_path / "u.json"
    r = subprocess.run([sys.executable, str(TOOL), "--simulate", "--model", "utransformer", "--nic-gbps", "0.2",
                        "--configs", "1f1b+sendrecv,eager-1f1b+broadcast+dw", "--json", str(out)],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    recs = json.loads(out.read_text())
    edges = set(recs[0]["edge_model_ms"])
    assert {"0->3:skip0", "1->3:skip1"} <= edges  # mirrored levels on non-adjacent stages
    assert recs[0]["config"] == "1f1b+sendrecv" and recs[0]["model"] == "utransformer"
