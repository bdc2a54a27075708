"""The planner validation's pure parts (Spearman, the choice of configurations, the grid, reading results), the
replays of recorded runs (lab/tests/data: three blind-grid runs, each cut to the one point a test replays) and a
smoke run of its worker on 2 local gloo ranks (no emulated cluster)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.cluster.shared_cpu import SHARED_CPU, EmulatedCluster
from megareshard.planner import ClusterSpec
from lab.validation.validation import (ACTION_SLACK_S, BLIND, FRESH, GRID, GRIDS, HOLDOUT, GridPoint, ModelPoint,
                                            choice_gap, choose, estimate_wall_s, median_error, pass_order, read_results,
                                            spearman, summarize)
from tests.harness import run_ranks

pytestmark = pytest.mark.waits  # paced runs: mostly sleeping (tests/conftest.py)
DATA = Path(__file__).resolve().parent / "data"
"""Recorded validation runs (docs/results/planner_validation_run*.json until they left the tree), each cut to the
point its test replays: run 94's gpt-squat 2 × 2, run 96's gpt-tall 2 × 2, run 105's (the newest blind run's)
cheapest point. They record their calibrations in the older cluster-file layout (the shared cores at the top)."""


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # monotone but not linear: still 1 (ranks only)
    assert spearman([1, 2, 3, 4, 5], [1, 8, 27, 64, 1000]) == pytest.approx(1.0)
    # ties share their average rank: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4) -> Pearson = 0.9487
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / 10 ** 0.5, rel=1e-9)
    # one swap among 5: 1 - 6·2/(5·24) = 0.9
    assert spearman([1, 2, 3, 4, 5], [2, 1, 3, 4, 5]) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="constant"):
        spearman([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="length >= 2"):
        spearman([1], [1])


def test_choose_is_seeded_distinct_and_top_first() -> None:
    pred = [1.0, 1.0, 1.0004, 1.1, 1.2, 1.2, 1.3, 1.5, 1.6, 2.0, 2.5, 3.0]
    got = choose(pred, top_k=3, sample=3, seed=0)
    assert [i for i, w in got if w == "top"] == [0, 3, 4]  # ties (to 0.1 %) stand for one another
    drawn = [i for i, w in got if w == "sample"]
    assert len(drawn) == 3 and drawn == sorted(drawn) and not set(drawn) & {0, 1, 2, 3, 4, 5}
    assert choose(pred, 3, 3, seed=0) == got  # seeded: the same draw every time
    assert choose([1.0, 2.0], top_k=4, sample=8) == [(0, "top"), (1, "top")]


def test_grid_is_fixed_and_fits_the_budget() -> None:
    assert len(GRID) == 4 and len({g.key for g in GRID}) == 4
    assert {g.rate_mbit for g in GRID} == {40.0, 200.0} and all((g.hosts, g.procs_per_host) == (4, 2) for g in GRID)
    # the holdout grid shares no model, cluster shape or rate with the main one
    assert len(HOLDOUT) == 4 and len({g.key for g in HOLDOUT}) == 4
    assert GRIDS == {"main": GRID, "holdout": HOLDOUT, "fresh": FRESH, "blind": BLIND}
    assert not {g.model for g in HOLDOUT} & {g.model for g in GRID}
    assert (4, 2) not in {(g.hosts, g.procs_per_host) for g in HOLDOUT}
    assert not {g.rate_mbit for g in HOLDOUT} & {40.0, 200.0}
    assert all(g.hosts * g.procs_per_host == 8 for g in HOLDOUT)
    # the fresh grid: models, shapes and rates of neither, on 6 ranks
    assert len(FRESH) == 4 and len({g.key for g in FRESH}) == 4
    assert not {g.model for g in FRESH} & {g.model for g in GRID + HOLDOUT}
    assert not {(g.hosts, g.procs_per_host) for g in FRESH} & {(g.hosts, g.procs_per_host) for g in GRID + HOLDOUT}
    assert {g.rate_mbit for g in FRESH} - {g.rate_mbit for g in GRID + HOLDOUT} == {80.0}  # 200: main's too
    assert all(g.hosts * g.procs_per_host == 6 for g in FRESH)
    # the blind grid: models, shapes and rates of no other grid, on 4 ranks
    others = GRID + HOLDOUT + FRESH
    assert len(BLIND) == 4 and len({g.key for g in BLIND}) == 4
    assert not {g.model for g in BLIND} & {g.model for g in others}
    assert not {(g.hosts, g.procs_per_host) for g in BLIND} & {(g.hosts, g.procs_per_host) for g in others}
    assert not {g.rate_mbit for g in BLIND} & {g.rate_mbit for g in others}
    assert all(g.hosts * g.procs_per_host == 4 for g in BLIND)
    assert estimate_wall_s([1.0, 2.0], warmup=1, iters=3, launch_s=20, build_s=4, slack=1.0, passes=1) == 40 + 8 + 4 * 3
    assert estimate_wall_s([1.0, 2.0], warmup=1, iters=3, launch_s=20, build_s=4, slack=1.0, passes=2) == 40 + 2 * 20


def test_pass_order_alternates_so_every_configuration_runs_early_once() -> None:
    assert pass_order(3, 1) == [[0, 1, 2]]
    assert pass_order(3, 2) == [[0, 1, 2], [2, 1, 0]]
    assert pass_order(2, 3) == [[0, 1], [1, 0], [0, 1]]
    assert pass_order(0, 2) == [[], []]
    # two passes: the sum of a configuration's positions is the same for all (no one always runs first)
    two = pass_order(5, 2)
    assert len({two[0].index(k) + two[1].index(k) for k in range(5)}) == 1
    with pytest.raises(ValueError, match="passes >= 1"):
        pass_order(3, 0)


def test_summary_and_reading_results(tmp_path) -> None:
    res = [{"rank": 1, "why": "top", "name": "a", "predicted_s": 1.0, "measured_s": 1.2, "status": "ok"},
           {"rank": 2, "why": "top", "name": "b", "predicted_s": 2.0, "measured_s": 1.1, "status": "ok"},
           {"rank": 5, "why": "sample", "name": "c", "predicted_s": 3.0, "measured_s": 3.3, "status": "ok"},
           {"rank": 9, "why": "sample", "name": "d", "predicted_s": 4.0, "status": "failed: boom"}]
    s = summarize(res)
    assert (s["started"], s["finished"], s["failed"]) == (4, 3, ["d"])
    assert s["spearman"] == pytest.approx(0.5) and s["choice"] == "a" and s["best_measured"] == "b"
    assert s["choice_gap"] == pytest.approx(1.2 / 1.1 - 1, abs=1e-4) and s["choice_target_met"]
    assert not s["spearman_target_met"]
    assert choice_gap([1, 2], [1.0, 1.05]) == 0.0
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"points": [{"key": "p", "results": res}]}))
    data = read_results(str(path))
    assert data["points"][0]["summary"]["spearman"] == pytest.approx(0.5)
    from lab.validation import validate_planner

    text = validate_planner.tables(data)
    assert "| p | 3/4 | 0.50 | a | +9.1 % | NOT met |" in text and "failed: boom" in text
    validate_planner.draw(data, str(tmp_path / "v.png"))
    assert (tmp_path / "v.png").stat().st_size > 1000
    # errors 0.2, 0.45, 0.1 (the failed one has none): median 0.2
    assert median_error(res) == pytest.approx(0.2) and median_error(res[3:]) is None
    run7 = tmp_path / "planner_validation_run7.json"
    run7.write_text(path.read_text())
    hist = validate_planner.history([str(run7)]).splitlines()
    assert hist[2] == "| 7 | 20% | 0 of 1 |"
    assert "| 7 | p | 3/4 | 0.50 | a | +9% (b) | not met / met | 0 |" in hist
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a planner validation file"):
        read_results(str(path))


def test_the_newest_blind_run_reproduces_from_its_calibration(tmp_path) -> None:
    """The recorded predictions come from the current code: the newest blind-grid run's cheapest point (run 105),
    planned again from its recorded calibration with the shared cores' cost term, gives every measured
    configuration's prediction bit for bit (after a change to the cost model, run the grids again). A changed
    prediction is reported."""
    from lab.validation import validate_planner

    data = json.loads((DATA / "planner_validation_run105_blind.json").read_text())
    assert [p["key"] for p in data["points"]] == ["gpt-tall-4x1-150mbit"] and data["points"][0]["ranked"] == 91
    one = tmp_path / "one.json"
    one.write_text(json.dumps(data))
    table, exact = validate_planner.replay([str(one)])
    n = sum(1 for r in data["points"][0]["results"] if r.get("status") == "ok")
    assert exact and f"| {n} of {n} |" in table, table
    next(r for r in data["points"][0]["results"] if r.get("status") == "ok")["predicted_s"] *= 1.01
    one.write_text(json.dumps(data))
    table, exact = validate_planner.replay([str(one)])
    assert not exact and f"| {n - 1} of {n} |" in table, table


def test_the_runs_contention_replaces_the_calibrations(capsys) -> None:
    """Since run 96 a run plans with the contention its method names (`POOLED_CPU_CONTENTION`, or --cpu-contention)
    in place of each calibration's own fit; 'measured' (None) keeps the fit, as runs 1-95 did."""
    import dataclasses

    from lab.validation import validate_planner

    data = json.loads((DATA / "planner_validation_run94_blind.json").read_text())
    (rec,) = data["points"]  # gpt-squat 2 x 2: its calibration's fit was 0
    assert rec["key"] == "gpt-squat-2x2-30mbit"
    pj = rec["point"]
    point = GridPoint(ModelPoint(**pj["model"]), pj["hosts"], pj["procs_per_host"], pj["rate_mbit"])
    own = validate_planner.recorded_device(point, rec["calibration"], data["method"], "run 94")
    assert own.shared.cores and own.shared.cpu_contention == rec["calibration"]["cpu_contention"] == 0.0
    for rate in (None, 0.26):
        got = validate_planner.recorded_device(point, rec["calibration"], data["method"] | {"cpu_contention": rate},
                                               "run 94")
        assert got == (own if rate is None else
                       EmulatedCluster(own.cluster, dataclasses.replace(own.shared, cpu_contention=rate)))
    # the waiting is counted: the planner's step of the run's choice grows by 0.26 x its CPU work over the cores
    ranked = {c.name: c for c in validate_planner.ranking(point, got)}
    choice = next(c for c in rec["configs"] if c["rank"] == 1)
    assert ranked[choice["name"]].terms[SHARED_CPU] == choice["shared_cpu_s"]
    assert ranked[choice["name"]].step_s == pytest.approx(
        choice["predicted_s"] + 0.26 * choice["shared_cpu_s"] / own.shared.cores, rel=1e-9)
    for bad, why in (("-1", "-1 is below 0"), ("x", "'x' is neither a number nor 'measured'")):
        with pytest.raises(SystemExit) as e:
            validate_planner.main(["--cpu-contention", bad, "--dry-run"])
        assert e.value.code == 2 and why in capsys.readouterr().err


TINY = GridPoint(ModelPoint("tiny", 2, 32, 4, 16, 64, 4), 1, 2, 1000.0)
# a slow device (20 MFLOP/s): a tiny layer's paced forward takes ~10 ms, far more than its real compute
SLOW = ClusterSpec(1, 2, device_memory_gib=1.0, device_tflops=2e-5, efficiency=1.0, nic_gbps=1.0, intra_gbps=10.0)


def _smoke(rank: int, world: int, configs, argv):
    from lab.validation import validate_planner

    return validate_planner.run_configs(configs, argv, 2, 1, 2, None, say=lambda *x: None, passes=2)


def test_worker_smoke_on_two_local_ranks() -> None:
    from lab.validation import validate_planner

    # the emulated device's per-action slack is in the planner's device and in every paced budget
    device = EmulatedCluster(SLOW)  # one host, its own cores: no extra cost term
    assert validate_planner.slowed(device, margin=1.0).cluster.action_overhead_s == \
        SLOW.action_overhead_s + ACTION_SLACK_S
    configs, n = validate_planner.plan_point(TINY, device)
    assert n >= len(configs) >= 2 and configs[0]["why"] == "top"
    assert all(c["slack_s"] == ACTION_SLACK_S for c in configs)
    configs = configs[:1] + [c for c in configs if c["pp"] > 1][:1]  # one stage, and a pipeline
    assert len(configs) == 2
    recs = run_ranks(_smoke, 2, configs, TINY.model.argv(), timeout=120)[0]
    assert [r["status"] for r in recs] == ["ok", "ok"], recs
    # two passes of 2 timed steps each: the median is over all 4, each pass's own median recorded
    assert all(r["passes"] == 2 and len(r["rounds_s"]) == 4 and len(r["pass_s"]) == 2 for r in recs), recs
    for c, r in zip(configs, recs):
        busiest = max(f + b for f, b in zip(c["stage_f_s"], c["stage_b_s"])) + 2 * ACTION_SLACK_S
        # paced: a stage runs its m forwards and backwards one after another, each at least its budget
        assert r["measured_s"] >= 0.95 * c["num_microbatches"] * busiest, (c, r)
        assert r["measured_s"] < 20 * c["predicted_s"] + 1.0, (c, r)
    # the pipeline's compute per action, every rank's 2 × 2 timed steps: each stage's m forwards, within its budget's
    # order of magnitude; one thread's CPU time never exceeds its wall time (µs counters: 1 µs per action)
    one, pipe = recs
    assert one["compute_ms"] == {}
    fwd = pipe["compute_ms"]["F"]
    assert fwd["actions"] == 2 * 2 * configs[1]["num_microbatches"] * configs[1]["pp"], pipe
    assert 0 < fwd["cpu"] <= fwd["wall"] + 1e-3, pipe
    # each stage paced to its own planned forward (+ the slack), whatever stage its rank runs: the mean over actions
    want = sum(configs[1]["stage_f_s"]) / configs[1]["pp"] + ACTION_SLACK_S
    assert fwd["budget"] == pytest.approx(want * 1e3, abs=2e-3), (want, pipe)
    # the rest of a pipeline step, per rank and step: with 2 stages each rank waits for m activations or m
    # gradients, and every step ends with its tail (the reduction, the last sends)
    other = pipe["other_ms_per_step"]
    m = configs[1]["num_microbatches"]
    assert other["WAIT_F"]["actions"] + other["WAIT_B"]["actions"] == m and other["tail"]["actions"] == 1, pipe
    assert one["other_ms_per_step"] == {}


def test_replay_contention_rebuilds_the_recorded_predictions_and_scores_the_models() -> None:
    """lab/validation/replay_contention.py on run 96's gpt-tall 2 x 2 (the one point of runs 96-99 that missed): S and C
    rebuild every recorded prediction (max(S + c C, C), c the run's), and the models are scored as the run was:
    the run's own 0.26 misses the choice, a wait growing with the load (q 0.3) meets both targets, and so does the
    run's own rate applied to the machine's measured CPU instead of the planned."""
    from lab.validation import validate_planner
    from lab.validation.replay_contention import configurations, linear, load, measured_cpu, report, score

    one = DATA / "planner_validation_run96_blind.json"
    data = json.loads(one.read_text())
    assert [p["key"] for p in data["points"]] == ["gpt-tall-2x2-30mbit"]
    rows = configurations(str(one))
    recorded = {r["name"]: r["predicted_s"] for r in data["points"][0]["results"] if r.get("status") == "ok"}
    assert len(rows) == len(recorded) == 12
    for r in rows:
        assert r["contention"] == 0.26 and r["C"] == pytest.approx(sum(r["parts"].values()))
        assert max(r["S"] + 0.26 * r["C"], r["C"]) == pytest.approx(recorded[r["name"]], rel=1e-9), r["name"]
    points = {("run96_blind", "gpt-tall-2x2-30mbit"): rows}
    assert score(linear(0.26), points)["met"] == 0 and score(load(0.3), points)["met"] == 1
    rep = report(rows)
    assert rep["own fit"]["misses"] == ["run96_blind gpt-tall-2x2-30mbit"] and rep["load"]["0.3"]["met"] == 1
    assert rep["load, one run left out"] == []  # one run: nothing to choose a value on
    # the same form with the machine's measured CPU in place of the planned count (not a prediction) meets both
    # at the pooled rate: the count is what misses here; the paced compute actions took 1.6-1.9x the planned CPU
    assert score(measured_cpu(0.26), points)["met"] == 1 and rep["measured CPU"]["0.26"]["met"] == 1
    assert 1.5 < rep["compute actions' CPU / planned compute"]["without tp"]["p10"]
