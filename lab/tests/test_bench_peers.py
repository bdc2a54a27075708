"""lab/bench/bench_peers.py: ratios, bubble, the void rule, JSON round trip, the activation meter under
retain_graph, torch's compute order in our IR, and one tiny side-by-side run on local gloo ranks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lab import ROOT, module_command  # noqa: F401

from lab.bench import bench_peers as bpe
from lab.bench import peers_report as rep
from lab.bench import peers_torch as pt
from tests.harness import run_ranks  # noqa: E402


def _rec(name, framework, ms, strategy="broadcast", signal=None):
    return {"name": name, "framework": framework, "status": "ok", "strategy": strategy, "signal_name": signal,
            "ms_all": ms, **rep.summarise(ms)}


def test_bubble_fraction_is_idle_over_span():
    trace = [{"kind": "F", "start": 0.0, "end": 1.0}, {"kind": "B", "start": 2.0, "end": 4.0},
             {"kind": "SEND_F", "start": 1.0, "end": 3.0}]  # communication is not compute
    assert rep.bubble_fraction(trace, 6.0) == pytest.approx(0.5)
    assert rep.bubble_fraction(trace, 0.0) is None


def test_compute_bound_is_every_rank_paced_compute():
    # rank 1: 4 microbatches × (F 10 + B 25) = 140 ms; B = I + W after calibration
    assert rep.compute_bound_ms([{"F": 5, "B": 10}, {"F": 10, "B": 25, "I": 15, "W": 10}], 4) == 140
    assert rep.compute_bound_ms(None, 4) is None


def test_ratios_void_rule_and_verdict():
    recs = [_rec("1f1b+allgather", "megareshard", [200, 210, 220], "allgather", "1f1b+signal"),
            _rec("1f1b+broadcast", "megareshard", [150, 160], signal="1f1b+signal"),
            _rec("1f1b+signal", "megareshard", [100, 100], "signal"),
            _rec("eager+broadcast", "megareshard", [90, 90], signal="1f1b+signal"),  # faster than its signal run
            _rec("torch Schedule1F1B", "torch", [240, 240], "p2p"),
            _rec("torch ScheduleGPipe", "torch", [50, 50], "p2p"),  # below the compute bound
            {"name": "torch ScheduleDualPipeV", "framework": "torch", "status": "failed", "reason": "x", "ms_all": []}]
    sm = rep.fill_ratios(recs, bound_ms=80.0)
    by = {r["name"]: r for r in recs}
    assert by["eager+broadcast"]["void"] and by["torch ScheduleGPipe"]["void"]
    assert not by["1f1b+broadcast"]["void"] and not by["torch ScheduleDualPipeV"]["void"]
    assert sm["torch_best"] == "torch Schedule1F1B" and sm["megareshard_best"] == "1f1b+broadcast"
    assert sm["best_ratio"] == pytest.approx(240 / 155)
    assert by["1f1b+broadcast"]["vs_torch_best"] == pytest.approx(240 / 155)
    assert by["1f1b+broadcast"]["vs_baseline"] == pytest.approx(210 / 155)
    assert sm["baseline_signal_fraction"] == pytest.approx(100 / 210)  # communication matters: target 1.2x
    assert rep.verdict(sm).startswith("met (need >= 1.2x")
    assert rep.verdict({**sm, "best_ratio": 1.1}).startswith("not met")
    assert rep.verdict({**sm, "best_ratio": 1.05, "baseline_signal_fraction": 0.95}).startswith("met (need >= 1.0x")
    assert rep.verdict({"best_ratio": None}) == "unknown"


def test_run_json_round_trip_and_redraw(tmp_path, capsys):
    recs = [_rec("1f1b+allgather", "megareshard", [200, 210], "allgather"),
            _rec("torch Schedule1F1B", "torch", [240, 250], "p2p")]
    for r in recs:
        r.update(bubble=[0.5, 0.25], act_peak_bytes=[2 ** 20, 2 ** 19], predicted_ms=190.0, loss_diff=0.0)
    run = {"kind": rep.RUN_KIND, "status": "complete", "records": recs, "budgets_ms": None,
           "setup": {"cluster": "2 hosts × 1 ranks", "pp": 2, "tp": 1, "microbatches": 4, "micro_batch_size": 1,
                     "seq_length": 8, "num_layers": 4, "hidden_size": 16, "nic_gbps": 0.04}}
    run["summary"] = rep.fill_ratios(recs, None)
    path = tmp_path / "run.json"
    rep.write_json(str(path), run)
    assert rep.load_json(str(path)) == json.loads(json.dumps(run))
    grid = {"kind": rep.GRID_KIND, "rates_mbit": [40.0], "tps": [1], "pp": 2, "picture": str(tmp_path / "g.png"),
            "points": [{"rate_mbit": 40.0, "tp": 1, "status": "complete", "reason": None, "run": run}]}
    rep.write_json(str(tmp_path / "grid.json"), grid)
    assert bpe.main(["--from-json", str(tmp_path / "grid.json")]) == 0
    out = capsys.readouterr().out
    assert "torch Schedule1F1B (245)" in out and "1f1b+allgather (205)" in out and "| 1f1b+allgather | 205 |" in out
    assert (tmp_path / "g.png").stat().st_size > 0
    assert bpe.main(["--from-json", str(path), "--plot", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="neither"):
        rep.load_json(str(tmp_path / "bad.json"))


def test_lifetime_meter_counts_saved_tensors_while_anyone_holds_them():
    w = torch.randn(64, 64, requires_grad=True)
    kib2 = 8 * 64 * 4
    with pt.LifetimeMeter(exclude=[w]) as m:
        x = torch.randn(8, 64, requires_grad=True)
        y = (torch.tanh(x @ w) ** 2).sum()  # saves x (w excluded), tanh's output, and it again for ** 2
        assert m.live == 2 * kib2            # the same storage counts once
        torch.autograd.grad(y, x, retain_graph=True)  # I: the retained graph still holds everything
        assert m.live == 2 * kib2
        torch.autograd.grad(y, w)                      # W: the graph goes; x is still held here
        del y
        assert m.live == kib2
        del x
    assert m.live == 0 and m.peak_bytes == 2 * kib2


def test_torch_orders_map_onto_our_ir():
    assert pt.peer_stages_of("ScheduleZBVZeroBubble", 1, 4) == [1, 6]
    assert pt.peer_stages_of("ScheduleInterleaved1F1B", 1, 4) == [1, 5]
    order = [[("F", 0, 0), ("F", 0, 3), ("I", 0, 3), ("W", 0, 3), ("B", 0, 0)],
             [("F", 0, 1), ("F", 0, 2), ("B", 0, 2), ("B", 0, 1)]]
    s = pt.order_to_schedule(order, "ScheduleZBVZeroBubble", 2, 1)
    assert s.placement == (0, 1, 1, 0) and [a.kind.value for a in s.actions[0]] == ["F", "F", "I", "W", "B"]
    with pytest.raises(ValueError, match="evenly"):
        pt.chunk_layer_ranges(6, 4)


def test_a_megareshard_chunk_is_paced_to_its_share_of_the_rank_budget():
    """Virtual stages: each chunk gets its share of the rank's layers of every per-kind budget (torch's rule,
    ``peers_torch.chunk_share``), its calibration durations are scaled back to a whole stage's, and a rank
    whose chunks hold unequal shares is refused (the runtime paces with one budget per kind)."""
    from types import SimpleNamespace

    from lab.bench import bench_pipeline as bp
    from lab.bench import peers_worker as pw
    from lab.cluster.pacing import pacer
    from megareshard.pipeline.chunks import ModelChunks

    def part(ranges, chunked=True):
        mods = {}
        for s, r in ranges.items():
            mods[s] = torch.nn.Linear(1, 1)
            mods[s].layer_range = r
        rt = SimpleNamespace(virtual_stages=len(ranges), stage=0, hooks=[],
                             last_trace=[{"stage": 0, "kind": "F", "mb": 0, "start": 1.0, "end": 1.5}])
        model = ModelChunks(mods, 4) if chunked else mods[0]
        return pw._Ours(bp.BenchConfig("zbv", "broadcast", True), rt, SimpleNamespace(model=model))

    p = part({0: (0, 2), 3: (6, 8)})  # zbv on rank 0 of pp 2: stages 0 and 3, 2 of the rank's 4 layers each
    assert p.share == pt.chunk_share((0, 2), 4) == 0.5
    p.set_pace({"F": 0.01, "B": 0.02})
    assert pacer(p.rt).budgets == {"F": 0.005, "B": 0.01}
    assert p.calibration_trace()[0]["end"] == 2.0 and p.rt.last_trace[0]["end"] == 1.5
    whole = part({0: (0, 4)}, chunked=False)
    whole.set_pace({"F": 0.01})
    assert pacer(whole.rt).budgets == {"F": 0.01} and whole.calibration_trace() is whole.rt.last_trace
    with pytest.raises(ValueError, match="unequal shares"):
        part({0: (0, 1), 3: (5, 8)})


def test_args_refuse_layers_that_do_not_split_into_two_chunks_per_rank(capsys):
    assert bpe.main(["--pp", "4", "--num-layers", "4"]) == 2
    assert "multiple of 8" in capsys.readouterr().err


def test_grid_dry_run_prints_every_point(capsys):
    assert bpe.main(["--grid", "--dry-run", "--rates", "10,160", "--grid-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("lab.cluster.emulate_cluster") == 2 and "--nic-rate 10000kbit" in out and "whole grid: about" in out


def _side_by_side(rank, world):
    a = bpe.build_parser().parse_args([
        "--pp", "2", "--tp", "1", "--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--microbatches", "4", "--vocab-size", "64",
        "--schedules", "1f1b,interleaved-1f1b,zbv", "--strategies", "allgather", "--no-method", "--iters", "1",
        "--warmup", "1", "--pace", "auto", "--peers", "Schedule1F1B,ScheduleZBVZeroBubble", "--peer-timeout", "60"])
    run = bpe.run_worker(bpe.resolve(a))
    return run


def test_smoke_peer_and_megareshard_losses_agree():
    run = run_ranks(_side_by_side, 2, timeout=90, nccl_check=True)[0]
    by = {r["name"]: r for r in run["records"]}
    virtual = ("interleaved-1f1b+allgather", "zbv+allgather+dw")  # chunk models of trainers of their own
    assert set(by) == {"1f1b+allgather", "1f1b+signal", *virtual, "interleaved-1f1b+signal", "zbv+signal+dw",
                       "torch Schedule1F1B", "torch ScheduleZBVZeroBubble"}
    assert all(r["status"] == "ok" for r in by.values()), [r.get("reason") for r in by.values()]
    assert [by[n]["virtual_stages"] for n in ("1f1b+allgather", *virtual)] == [1, 2, 2]
    # paced: the budgets were calibrated on every megareshard trace (a chunk's durations scaled to a whole
    # stage's); I and W come only from zbv's split backward here, so zbv's traces did count
    assert len(run["budgets_ms"]) == 2 and all(set(b) == {"F", "B", "I", "W"} for b in run["budgets_ms"])
    # the same kernels on the same tensors; only the sum of the 4 per-microbatch fp32 losses is reordered
    tol = 2 * 4 * 2.0 ** -24 * abs(run["reference_loss"])
    assert run["loss_tolerance"] == pytest.approx(tol)
    for name in ("torch Schedule1F1B", "torch ScheduleZBVZeroBubble", *virtual):
        assert abs(by[name]["loss"] - by["1f1b+allgather"]["loss"]) <= tol, name
        assert by[name]["loss_ok"]
    assert 3.0 < run["reference_loss"] < 5.5  # ln(64) = 4.16 at initialisation
    # memory measured per stage: 1F1B holds 2 microbatches on stage 0, 1 on stage 1 (on both sides)
    for name in ("1f1b+allgather", "torch Schedule1F1B"):
        peak = by[name]["act_peak_bytes"]
        assert len(peak) == 2 and all(p > 0 for p in peak)
        assert peak[0] > peak[1]
    # the same layers save the same tensors; torch's stage holds a few of them a little longer (its
    # caches of a microbatch's inputs and outputs): within a tenth, never less
    ours, torchs = by["1f1b+allgather"]["act_peak_bytes"], by["torch Schedule1F1B"]["act_peak_bytes"]
    assert torchs == pytest.approx(ours, rel=0.1) and all(t >= o for t, o in zip(torchs, ours))
    assert by["torch ScheduleZBVZeroBubble"]["predicted_ms"] and by["torch Schedule1F1B"]["predicted_ms"]
    # the simulator ran the registry schedules on their 2 chunks per rank
    assert all(by[n]["predicted_ms"] and by[n]["chunks_per_rank"] == 2 for n in virtual)


def test_grid_records_every_point_and_its_worker_arguments_parse(tmp_path, monkeypatch):
    """The grid's bookkeeping without a cluster: each point's worker argv parses back to the grid's own
    settings; a point that fails is kept as stopped with its reason; JSON and picture are written."""
    from lab.cluster import emulate_cluster

    monkeypatch.setattr(emulate_cluster, "check_privileges", lambda: None)
    recs = [_rec("1f1b+allgather", "megareshard", [200, 210], "allgather"),
            _rec("torch Schedule1F1B", "torch", [240, 250], "p2p")]
    calls = []

    def fake_point(cmd, timeout_s):
        worker = cmd[cmd.index("--") + 3:]  # after "-- -m lab.bench.bench_peers"
        wa = bpe.build_parser().parse_args(worker)
        calls.append((wa.tp, wa.nic_gbps, wa.strategies, wa.iters, wa.pace))
        if wa.nic_gbps == 0.01:
            return 1, None  # a failed point: no JSON
        run = {"kind": rep.RUN_KIND, "status": "complete", "records": [dict(r) for r in recs], "budgets_ms": None,
               "setup": {"cluster": "x", "pp": 4, "tp": wa.tp, "microbatches": 8, "micro_batch_size": 2,
                         "seq_length": 64, "num_layers": 8, "hidden_size": 128, "nic_gbps": wa.nic_gbps}}
        run["summary"] = rep.fill_ratios(run["records"], None)
        Path(worker[worker.index("--json") + 1]).write_text(json.dumps(run))
        return 0, None

    monkeypatch.setattr(bpe.bp, "_run_point", fake_point)
    out, pic = tmp_path / "peers.json", tmp_path / "peers.png"
    assert bpe.main(["--grid", "--rates", "10,40", "--grid-tp", "1,2", "--results", str(out),
                     "--picture", str(pic)]) == 0
    assert sorted(calls) == sorted((tp, r, "broadcast", 3, "auto") for tp in (1, 2) for r in (0.01, 0.04))
    grid = rep.load_json(str(out))
    st = {(p["tp"], p["rate_mbit"]): p for p in grid["points"]}
    assert st[(1, 10.0)]["status"] == "stopped" and st[(1, 10.0)]["reason"] == "exit code 1"
    assert st[(2, 40.0)]["status"] == "complete" and st[(2, 40.0)]["run"]["summary"]["torch_best"]
    assert pic.stat().st_size > 0
