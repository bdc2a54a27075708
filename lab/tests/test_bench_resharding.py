"""lab/bench/bench_resharding.py: the model-only mode and one tiny 4-rank run (hosts as labels)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab import ROOT, module_command  # noqa: F401
from lab.tests import run_as_torchrun, run_main
TOOL = module_command("lab.bench.bench_resharding")

# the record fields the issue names (benchmarks and external tools read them)
FIELDS = {"case", "strategy", "scheduler", "seconds", "nic_bytes", "lower_bound_s", "ratio_to_bound",
          "speedup_vs_sendrecv", "predicted_s"}


def _tool(argv: list[str], capsys) -> SimpleNamespace:
    """--simulate starts no process group: the tool runs in this process."""
    from lab.bench import bench_resharding

    return run_main(bench_resharding.main, argv, capsys)


def test_simulate_paper_suite(tmp_path, capsys):
    out = tmp_path / "sim.json"
    r = _tool(["--simulate", "--suite", "paper", "--scale", "0.001", "--devices-per-host", "2", "--nic-gbps", "1",
               "--strategy", "sendrecv,broadcast", "--scheduler", "naive,auto", "--json", str(out)], capsys)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert len(recs) == 9 * 2 * 2 and all(FIELDS <= set(x) for x in recs)
    assert {x["case"] for x in recs} == {f"case{n}" for n in range(1, 10)}
    for x in recs:
        assert x["simulated"] and x["seconds"] == x["predicted_s"]
        assert x["predicted_s"] >= x["lower_bound_s"] * (1 - 1e-9) > 0, x  # a bound is a bound
    by = {(x["case"], x["strategy"], x["scheduler"]): x for x in recs}
    for n in range(1, 10):
        snd, bc = by[(f"case{n}", "sendrecv", "auto")], by[(f"case{n}", "broadcast", "auto")]
        assert snd["speedup_vs_sendrecv"] == 1.0
        assert bc["nic_bytes"] <= snd["nic_bytes"]  # broadcast never moves more over NICs
    assert "case9" in r.stdout  # the per-case tables


@pytest.mark.slow
def test_4_ranks_both_orders_with_calibration(tmp_path):
    """4 ranks = 2 'hosts' × 2 on this machine (forked with torchrun's environment): checked runs under both
    orders, the JSON records, and a calibrated model (the goodput of one message host 0 -> host 1)."""
    out = tmp_path / "run.json"
    cmd = ["--shape", "8,6,4", "--src-mesh", "1x2", "--src-spec", "S0,R,R", "--dst-mesh", "1x2", "--dst-spec",
           "R,S0,R", "--procs-per-host", "2", "--strategy", "sendrecv,broadcast", "--scheduler", "auto",
           "--order", "plan,concurrent", "--repeat", "2", "--calibrate-mb", "1", "--json", str(out),
           "--trace-dir", str(tmp_path / "tr")]
    ranks = run_as_torchrun("lab.bench.bench_resharding", cmd, 4, timeout=240)
    assert [x.returncode for x in ranks] == [0] * 4, ranks[0].stdout[-3000:] + ranks[0].stderr[-3000:]
    r = ranks[0]
    recs = json.loads(out.read_text())
    assert {(x["strategy"], x["order"]) for x in recs} == {(s, o) for s in ("sendrecv", "broadcast")
                                                           for o in ("plan", "concurrent")}
    m = re.search(r"calibrated: one 1 MiB message host 0 -> host 1 at (\d+) Mbit/s", r.stdout)
    assert m, r.stdout[-3000:]
    goodput_mbit = int(m.group(1))
    for x in recs:
        assert FIELDS <= set(x) and not x["simulated"]
        assert x["seconds"] > 0 and len(x["repeats"]) == 2
        # predicted with the measured goodput (printed rounded to 1 Mbit/s), not the nominal rate
        assert abs(x["model_nic_gbps"] * 1e3 - goodput_mbit) <= 0.5, (x["model_nic_gbps"], goodput_mbit)
    # --trace-dir: one traced run per configuration, both orders; every wire operation from both ends, the
    # sender's and receiver's hosts apart; drawn by lab/bench/reshard_timeline.py
    traces = sorted((tmp_path / "tr").iterdir())
    docs = [json.loads(p.read_text()) for p in traces]
    assert sorted((d["strategy"], d["order"]) for d in docs) == sorted((x["strategy"], x["order"]) for x in recs)
    doc = docs[0]
    hosts = {int(r): h for r, h in doc["host_of_rank"].items()}
    sends = sorted((e["rank"], e["peer"], e["task"]) for e in doc["events"] if e["side"] == "send")
    assert sends and sends == sorted((e["peer"], e["rank"], e["task"]) for e in doc["events"] if e["side"] == "recv")
    assert all(hosts[e["rank"]] != hosts[e["peer"]] and e["t_post"] <= e["t_done"] for e in doc["events"])
    from lab.bench import reshard_timeline

    assert reshard_timeline.main([str(traces[0]), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 0


def test_simulate_prints_the_chunk_count_per_case(tmp_path, capsys):
    """One sender to 1..4 hosts: every broadcast task's K is the model's choice, printed; the
    many-host cases pipeline (K > 1) and stay within 1.15x the NIC lower bound."""
    out = tmp_path / "sim.json"
    r = _tool(["--simulate", "--suite", "one-to-many", "--scale", "0.015625", "--strategy", "broadcast,sendrecv",
               "--scheduler", "auto", "--json", str(out)], capsys)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = json.loads(out.read_text())
    multi = [x for x in recs if x["strategy"] == "broadcast" and x["case"].startswith("inter:")]
    assert len(multi) == 4
    for x in multi:
        (k,) = x["chunks"]
        assert (k == 1) == x["case"].startswith("inter:1->1x"), x  # one receiving host: nothing to pipeline
        assert x["ratio_to_bound"] <= 1.15, x
        assert f"K={k}:" in r.stdout
    assert all(x["chunks"] == [1] for x in recs if x["strategy"] == "sendrecv")
