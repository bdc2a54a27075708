#!/usr/bin/env python
"""Validate the layout planner against measured runs on the emulated cluster (issue 18, item 4).

    python -m lab.validation.validate_planner --dry-run            # every point's commands and the wall-time estimate; runs nothing
    sudo python -m lab.validation.validate_planner                 # the main grid (root: network namespaces), ~6 min
    python -m lab.validation.validate_planner --from-json RUN.json   # redraw a run's table and picture
    python -m lab.validation.validate_planner --history RUN*.json    # every run side by side
    python -m lab.validation.validate_planner --replay RUN.json      # its predictions, again

Recorded runs are read from a path (they are kept in git history, not in the tree: e.g. ``git show
1f2c7ba:docs/results/planner_validation_run105_blind.json``; lab/tests/data holds the few the tests replay).

The grids are fixed in lab/validation/validation.py before anything runs: `--grid main`, two GPT
shapes on 4 hosts × 2 ranks at 40 and 200 Mbit/s per NIC direction (the grid the cost model was developed
on); `--grid holdout`, two other GPT shapes on 2 hosts × 4 ranks at 60 Mbit/s and 8 hosts × 1 rank at
300 Mbit/s (fixed later, before its first run); `--grid fresh`, two more on 6 ranks, 3 hosts × 2 at
80 Mbit/s and 6 hosts × 1 at 200 Mbit/s (fixed in session 7, before its first run); `--grid blind`, two
more on 4 ranks, 2 hosts × 2 at 30 Mbit/s and 4 hosts × 1 at 150 Mbit/s (fixed in session 8, before its
first run). For every point:

1. **calibrate** the emulated cluster (`lab.cluster.calibrate_emulated` under `lab.cluster.emulate_cluster`:
   the product's calibration — matmul FLOP/s and one layer's forward/backward measured on every rank at
   once, the load the run will see; intra-host and NIC bandwidth; latencies — and the cores the hosts
   share, the sleep overshoot); the emulated device is `PACE_MARGIN` slower than that and takes
   `ACTION_SLACK_S` more per action;
2. **plan** with that cluster and the shared cores' cost term (`lab.cluster.shared_cpu`; schedules the
   runtime executes, ZeRO 0, no recomputation: both change memory, not the paced time), every shape scored
   by the simulator;
3. **run** the planner's `TOP_K` best configurations and a seeded sample of `SAMPLE` others in ONE
   launch (one process group, one trainer per configuration in turn), every compute action paced to
   the planner's per-stage forward/backward time plus the slack (`PipelineRuntime.pace`; one stage: the
   whole forward-backward padded to m·(F + B + 2·slack)), so measured times are comparable to the model's;
   each configuration's process groups are destroyed before the next one starts; `PASSES` passes, the
   second in reverse order (`pass_order`), each building the configuration afresh; step time = median over
   every pass's `ITERS` timed iterations after `WARMUP`, barrier to optimizer step, max over ranks;
4. **compare**: Spearman rank correlation of predicted and measured step times, and how much slower
   the planner's choice measured than the best measured (targets: >= 0.8, <= 10 %).

Every configuration started is reported, failures included; a launch that ends early leaves the
configurations it did not reach as "not finished". The JSON (`--json`) is rewritten after every
point; `--from-json` prints the Markdown tables and draws predicted against measured (`--img`).
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from lab import env_with_root, module_command
from lab.cluster.shared_cpu import SHARED_CPU, EmulatedCluster, read_cluster
from lab.validation.validation import (ACTION_SLACK_S, GRIDS, ITERS, NIC_BURST, PACE_MARGIN,
                                            PASSES, POOLED_CPU_CONTENTION, SAMPLE, SEED, TOP_K, WARMUP,
                                            GridPoint, choose,
                                            estimate_wall_s, pass_order,
                                            grid_json, median_error, read_results, summarize)



# ---- planning (pure) -----------------------------------------------------------------------------
def ranking(point: GridPoint, device: EmulatedCluster) -> list:
    """The planner's whole ranking at `point` (every candidate simulated) on the emulated `device` (its cluster and
    the shared cores' cost term)."""
    from megareshard.planner import ModelShape, plan_layouts

    m = point.model
    shape = ModelShape(m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size,
                       dtype_bytes=4)  # the runs train in fp32
    return plan_layouts(shape, device.cluster, m.global_batch_size, micro_batches=(1, 2, 4), zero_stages=(0,),
                        recompute_options=(False,), runtime_only=True, top_shapes=10**6, keep=None,
                        terms=device.terms())


def plan_point(point: GridPoint, device: EmulatedCluster) -> tuple[list[dict[str, Any]], int]:
    """The configurations to run at `point` (dicts the worker reads) and the size of the ranking they come from."""
    m = point.model
    ranked = ranking(point, device)
    picked = choose([c.step_s for c in ranked], TOP_K, SAMPLE, SEED)
    out = []
    for i, why in picked:
        c = ranked[i]
        out.append({"rank": i + 1, "why": why, "name": c.name, "flags": c.flags(m.num_layers),
                    "predicted_s": c.step_s, "pp": c.pp, "num_microbatches": c.num_microbatches,
                    "stage_f_s": c.stage_f_s, "stage_b_s": c.stage_b_s, "stage_w_s": c.stage_w_s,
                    "slack_s": ACTION_SLACK_S,
                    "bottleneck": c.bottleneck, "shared_cpu_s": c.terms.get(SHARED_CPU, 0.0),
                    # what the worker's pipeline_s measures: the pipeline and the exposed dp reduction
                    "pipeline_s": c.step_s - sum(v for k, v in c.breakdown.items()
                                                 if k.startswith(("optimizer", "step-end")))})
    return out, len(ranked)


def slowed(device: EmulatedCluster, margin: float = PACE_MARGIN, sleep_overshoot_s: float = 0.0,
           slack_s: float = ACTION_SLACK_S) -> EmulatedCluster:
    """The emulated device: `margin` times slower than the measured compute — its FLOP rate and a layer's fixed
    part alike, so that small micro batches, where the fixed part dominates, get slack too — (same network; on
    shared cores a device second is `margin` times less CPU); every paced action takes `slack_s` more
    (`ACTION_SLACK_S`: the worker adds it to each budget) and ends when the OS wakes its closing sleep,
    `sleep_overshoot_s` late (measured by the calibration)."""
    cluster, shared = device.cluster, device.shared
    cluster = dataclasses.replace(cluster, efficiency=cluster.efficiency / margin,
                                  layer_overhead_s=cluster.layer_overhead_s * margin,
                                  action_overhead_s=cluster.action_overhead_s + sleep_overshoot_s + slack_s)
    if shared is not None:
        shared = dataclasses.replace(shared, compute_cpu_share=shared.compute_cpu_share / margin)
    return EmulatedCluster(cluster, shared)


def recorded_device(point: GridPoint, calibration: dict[str, Any], method: dict[str, Any],
                    source: str) -> EmulatedCluster:
    """The emulated device a point was planned for: its recorded calibration (the point's hosts × ranks; the lab's
    `read_cluster`, which also reads the older runs' layout) `slowed` by the run's pace margin, slack (0 before
    run 29 recorded one) and measured late wake-up, with the run's `cpu_contention` where its method names one
    (runs 96–100: 0.26, 101–104: 0.35; since run 105: `POOLED_CPU_CONTENTION`), else the calibration's."""
    measured = read_cluster(calibration, source, hosts=point.hosts, devices_per_host=point.procs_per_host)
    if method.get("cpu_contention") is not None and measured.shared:
        measured = EmulatedCluster(measured.cluster, dataclasses.replace(
            measured.shared, cpu_contention=float(method["cpu_contention"])))
    return slowed(measured, margin=method.get("pace_margin", PACE_MARGIN),
                  sleep_overshoot_s=calibration["measured"]["sleep_overshoot"]["seconds"],
                  slack_s=method.get("action_slack_s", 0.0))


# ---- the worker (inside torchrun, every rank) ----------------------------------------------------------
class _Paced:
    """One stage without a pipeline runtime: the whole forward-backward padded to `budget_s`."""

    def __init__(self, fn, budget_s: float) -> None:
        self.fn, self.budget_s, self.overruns, self.overrun_s = fn, budget_s, 0, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        left = self.budget_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1
            self.overrun_s -= left
        return out


class _Timed:
    """The trainer's forward-backward, timed: `last_s` is its last call's wall seconds (the pipeline part of a step;
    the gradient reduction too where the runtime finalizes it)."""

    def __init__(self, fn) -> None:
        self.fn, self.last_s = fn, 0.0
        self.finalizes_grads = getattr(fn, "finalizes_grads", False)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.last_s = time.perf_counter() - t0


def run_configs(configs: Sequence[dict[str, Any]], model_argv: Sequence[str], procs_per_host: int,
                warmup: int, iters: int, results_path: str | None, say=print, passes: int = 1) -> list[dict[str, Any]]:
    """Run every configuration on the initialised default process group, in `passes` passes (`pass_order`:
    ranking order, then reversed, ...; each pass builds the configuration afresh and runs `warmup` untimed and
    `iters` timed steps); rank 0 appends one JSON line per configuration to `results_path` after its last pass
    (its time: the median over every pass's timed steps) and returns the records (other ranks: [])."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    raws: dict[int, list[dict[str, Any]]] = {k: [] for k in range(len(configs))}
    orders = pass_order(len(configs), passes)
    records = []
    for p, order in enumerate(orders):
        for k in order:
            c = configs[k]
            t_start = time.monotonic()
            raws[k].append(_measure(c, model_argv, procs_per_host, warmup, iters))
            raws[k][-1]["wall_s"] = time.monotonic() - t_start
            if p < len(orders) - 1:  # every pass runs every configuration: its record after the last
                continue
            rec = _record(c, raws[k], world, rank)
            if rank == 0:
                records.append(rec)
                if results_path:
                    with open(results_path, "a", encoding="utf-8") as fh:
                        fh.write(json.dumps(rec) + "\n")
                got = f"{rec['measured_s']:.3f} s measured" if rec["status"] == "ok" else rec["status"]
                say(f"[validate_planner] {len(records)}/{len(configs)} #{c['rank']} {c['name']}: predicted "
                    f"{c['predicted_s']:.3f} s, {got} ({rec['wall_s']:.0f} s, {len(raws[k])} passes)")
    records.sort(key=lambda r: r["rank"])
    return records


_OTHERS = ("SEND_F", "RECV_F", "WAIT_F", "SEND_B", "RECV_B", "WAIT_B", "R", "tail")
"""The parts of a paced pipeline step besides compute (the kinds `pacing.note_action` counts)."""


def _measure(c: dict[str, Any], model_argv: Sequence[str], procs_per_host: int, warmup: int,
             iters: int) -> dict[str, Any]:
    """One pass of configuration `c`: build it, run `warmup` + `iters` steps paced to its planned costs, close it.
    The raw numbers of its timed steps (every rank returns the same), or {"error": why}."""
    import torch
    import torch.distributed as dist

    from megareshard.arguments import ConfigError, parse_args
    from lab.cluster.calibration_shared import machine_busy_s
    from lab.cluster.pacing import PACE_KINDS, pacer
    from megareshard.training import Trainer, build_context

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        argv = ["--mock-data", *model_argv, "--train-iters", "1000000", "--lr", "1e-4", "--lr-warmup-iters", "1",
                "--device", "cpu", "--log-interval", "1000000", "--hidden-dropout", "0", "--attention-dropout",
                "0", "--nproc-per-node", str(procs_per_host), *c["flags"].split()]
        cfg = parse_args(argv, world_size=world)
        ctx, _ = build_context(cfg, world)
        trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
        paced = None
        slack = c.get("slack_s", 0.0)  # every action's share of the emulated device's per-action cost
        if trainer.pipeline is not None:  # each of this rank's (virtual) stages its own planned costs
            mine = [s for s, mesh in enumerate(trainer.pipeline.placement) if mesh == ctx.pp_rank()]
            per_stage = {s: dict(zip("FBIW", (f, b, b - w, w))) for s in mine
                         for f, b, w in [(c["stage_f_s"][s], c["stage_b_s"][s], c["stage_w_s"][s])]}
            pacer(trainer.pipeline).budgets = {k: {s: t[k] + slack for s, t in per_stage.items()} for k in "FBIW"}
        else:  # one stage: F and B of every microbatch
            f, b = c["stage_f_s"][0], c["stage_b_s"][0]
            paced = _Paced(trainer.forward_backward_fn, c["num_microbatches"] * (f + b + 2 * slack))
            trainer.forward_backward_fn = paced
        batch = trainer._microbatches(trainer.train_data, next(trainer._train_iter))
        timed = _Timed(trainer.forward_backward_fn)
        trainer.forward_backward_fn = timed
        times, overruns, overrun_s, cpu, pipe, machine = [], 0, 0.0, [], [], []
        # per kind, summed over the timed steps: actions, their wall and CPU µs, their budgets (compute only)
        paced_sums = torch.zeros(len(PACE_KINDS) + len(_OTHERS), 4, dtype=torch.float64)
        for r in range(warmup + iters):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            m0 = machine_busy_s() if rank == 0 else 0.0
            trainer.train_step(batch)
            # the step (max over ranks), its pipeline part (forward-backward returned; max) and the CPU seconds
            # every thread of every rank spent in it (sum: 8 emulated hosts share this machine's cores)
            mx = torch.tensor([time.perf_counter() - t0, timed.last_s], dtype=torch.float64)
            sm = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            dist.all_reduce(sm)
            if r >= warmup:
                if rank == 0:  # the machine's cores, every process and the kernel (the emulated NICs' packets)
                    machine.append(machine_busy_s() - m0)
                times.append(float(mx[0]))
                pipe.append(float(mx[1]))
                cpu.append(float(sm[0]))
                if trainer.pipeline is not None:
                    st = trainer.pipeline.last_stats
                    overruns += st.get("pace_overruns", 0)
                    overrun_s += st.get("pace_overrun_us", 0) / 1e6
                    paced_sums += torch.tensor([[st.get(f"paced_{w}_{k}", 0)
                                                 for w in ("n", "wall_us", "cpu_us", "budget_us")]
                                                for k in PACE_KINDS + _OTHERS], dtype=torch.float64)
        if paced is not None:
            overruns, overrun_s = paced.overruns, paced.overrun_s
        total = torch.tensor([overruns, overrun_s], dtype=torch.float64)
        dist.all_reduce(total)
        dist.all_reduce(paced_sums)
        trainer.close()
        trainer.release_communicators()  # or each configuration's gloo threads slow the later ones down
        return {"times": times, "pipe": pipe, "cpu": cpu, "machine": machine, "overruns": int(total[0]),
                "overrun_s": float(total[1]), "paced_sums": paced_sums.tolist(), "iters": iters}
    except (ConfigError, ValueError, RuntimeError) as e:  # the same on every rank: they all go on
        return {"error": f"failed: {str(e).splitlines()[0][:300]}"}


def _record(c: dict[str, Any], raws: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
    """A configuration's JSON record from its passes' raw numbers (`_measure`): its time is the median over every
    pass's timed steps; the first failed pass, if any, is its status."""
    from lab.cluster.pacing import PACE_KINDS

    rec: dict[str, Any] = {k: c[k] for k in ("rank", "why", "name", "flags", "predicted_s")}
    rec["wall_s"] = round(sum(r["wall_s"] for r in raws), 2)
    bad = next((r["error"] for r in raws if "error" in r), None)
    if bad:
        rec["status"] = bad
        return rec
    times = [t for r in raws for t in r["times"]]
    steps = sum(r["iters"] for r in raws)
    rec.update(status="ok", measured_s=statistics.median(times), rounds_s=[round(t, 5) for t in times],
               passes=len(raws), pass_s=[round(statistics.median(r["times"]), 5) for r in raws],
               pace_overruns=sum(r["overruns"] for r in raws),
               pace_overrun_s=round(sum(r["overrun_s"] for r in raws), 5),
               pipeline_s=round(statistics.median([t for r in raws for t in r["pipe"]]), 5),
               cpu_s=round(statistics.median([t for r in raws for t in r["cpu"]]), 5))
    if rank == 0:
        rec["machine_cpu_s"] = round(statistics.median([t for r in raws for t in r["machine"]]), 4)
        sums = [[sum(r["paced_sums"][i][j] for r in raws) for j in range(4)]
                for i in range(len(PACE_KINDS) + len(_OTHERS))]
        sums_of = dict(zip(PACE_KINDS + _OTHERS, sums))
        # a paced pipeline's compute per action, every rank's timed steps: what its budget had to cover
        rec["compute_ms"] = {k: {"actions": int(n), "wall": round(wl / n / 1e3, 4),
                                 "cpu": round(cp / n / 1e3, 4), "budget": round(bd / n / 1e3, 4)}
                             for k in PACE_KINDS for n, wl, cp, bd in [sums_of[k]] if n}
        # and the rest of its step, per rank and step: the transfers, the reduction, the tail
        rec["other_ms_per_step"] = {k: {"actions": round(n / (steps * world), 2),
                                        "wall": round(wl / 1e3 / (steps * world), 3)}
                                    for k in _OTHERS for n, wl, _, _ in [sums_of[k]] if n}
    return rec


def _worker(spec_path: str) -> int:
    import torch

    from megareshard.training import init_distributed

    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    run_configs(spec["configs"], spec["model_argv"], spec["procs_per_host"], spec["warmup"], spec["iters"],
                spec["results"], say=lambda *x: print(*x, flush=True), passes=spec.get("passes", 1))
    return 0


# ---- the grid (root: emulated cluster) -------------------------------------------------------------------
def _emulated(point: GridPoint, cmd: list[str], timeout_s: float) -> list[str]:
    return module_command("lab.cluster.emulate_cluster", ["--hosts", str(point.hosts), "--procs-per-host",
            str(point.procs_per_host), "--nic-rate", f"{point.rate_mbit:g}mbit", "--burst", NIC_BURST,
            "--timeout", str(int(timeout_s)),
            "--", *cmd])


CALIBRATION_MICRO_BATCH = 1
"""The smallest micro batch the search tries: the layer is timed at it, at twice and at four times it (the search's
three), so the fixed part of a layer (what does not shrink with the batch) is measured where it weighs most, not
extrapolated to it, and the largest micro batch is measured, not extrapolated either."""


def calibration_cmd(point: GridPoint, out: str, pace_margin: float = PACE_MARGIN) -> list[str]:
    """The calibration's command under torchrun (the lab's, around the product's: `lab.cluster.calibrate_emulated`)."""
    m = point.model
    return ["-m", "lab.cluster.calibrate_emulated", "--num-layers", str(m.num_layers), "--hidden-size",
            str(m.hidden_size), "--num-attention-heads", str(m.num_attention_heads), "--seq-length",
            str(m.seq_length), "--vocab-size", str(m.vocab_size), "--micro-batch-size", str(CALIBRATION_MICRO_BATCH),
            "--iters", "5", "--pace-margin", str(pace_margin),
            "--json", out]


def _run(cmd: list[str]) -> int:
    print("[validate_planner] $ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env_with_root()).returncode


def run_grid(a: argparse.Namespace, points: Sequence[GridPoint]) -> int:
    data: dict[str, Any] = {"method": {"top_k": TOP_K, "sample": SAMPLE, "seed": SEED, "pace_margin": a.pace_margin,
                                       "action_slack_s": ACTION_SLACK_S,
                                       "nic_burst": NIC_BURST,
                                       "warmup": WARMUP, "iters": ITERS, "passes": PASSES, "grid": a.grid,
                                       "cpu_contention": a.cpu_contention},
                            "grid": grid_json(GRIDS[a.grid]), "points": []}
    tmp = tempfile.mkdtemp(prefix="mr-validate-")
    t_all = time.monotonic()
    try:
        for n, point in enumerate(points):
            t0 = time.monotonic()
            print(f"[validate_planner] point {n + 1}/{len(points)} {point.key}: calibrating "
                  f"(total {time.monotonic() - t_all:.0f} s)", flush=True)
            cal = os.path.join(tmp, f"{point.key}-cluster.json")
            rec: dict[str, Any] = {"key": point.key, "point": grid_json([point])[0], "results": []}
            # the wall-time budget: what is left, shared by the points still to run
            share = (a.budget_min * 60 - (time.monotonic() - t_all)) / (len(points) - n)
            rc = _run(_emulated(point, calibration_cmd(point, cal, a.pace_margin), max(30.0, min(150.0, share / 3))))
            if rc or not os.path.exists(cal):
                rec["status"] = f"calibration failed (exit code {rc})"
                data["points"].append(rec)
                _write(a.json, data)
                continue
            with open(cal, encoding="utf-8") as f:
                rec["calibration"] = json.load(f)
            cluster = recorded_device(point, rec["calibration"], data["method"], cal)
            configs, n_ranked = plan_point(point, cluster)
            rec.update(ranked=n_ranked, configs=configs)
            spec = os.path.join(tmp, f"{point.key}-spec.json")
            results = os.path.join(tmp, f"{point.key}-results.jsonl")
            with open(spec, "w", encoding="utf-8") as f:
                json.dump({"configs": configs, "model_argv": point.model.argv(), "procs_per_host":
                           point.procs_per_host, "warmup": WARMUP, "iters": ITERS, "passes": PASSES,
                           "results": results}, f)
            print(f"[validate_planner] {point.key}: {len(configs)} of {n_ranked} configurations to run "
                  f"(estimate {estimate_wall_s([c['predicted_s'] for c in configs]):.0f} s)", flush=True)
            left = max(60.0, min(a.point_timeout, share - (time.monotonic() - t0)))
            rc = _run(_emulated(point, ["-m", "lab.validation.validate_planner", "--worker", spec], left))
            done = []
            if os.path.exists(results):
                with open(results, encoding="utf-8") as f:
                    done = [json.loads(line) for line in f if line.strip()]
            names = {r["name"] for r in done}
            for c in configs:
                if c["name"] not in names:
                    done.append({k: c[k] for k in ("rank", "why", "name", "flags", "predicted_s")}
                                | {"status": f"not finished (the launch ended with exit code {rc})"})
            rec["results"] = done
            rec["summary"] = summarize(done)
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            data["points"].append(rec)
            _write(a.json, data)
            s = rec["summary"]
            print(f"[validate_planner] {point.key}: {s['finished']}/{s['started']} finished, Spearman "
                  f"{s.get('spearman')}, choice {s.get('choice_gap')} slower than the best measured "
                  f"({rec['wall_s']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(tables(data))
    if a.img:
        draw(data, a.img)
    return 0


def _write(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)


# ---- dry run, tables, picture -----------------------------------------------------------------------
def dry_run(points: Sequence[GridPoint]) -> int:
    """Commands and wall time, from an in-process calibration of this machine (no processes, no network):
    the layer's measured speed shared by every rank of the point on this machine's cores."""
    from megareshard.planner import ClusterSpec, ModelShape
    from megareshard.planner.calibration import measure_layer, measure_matmul, measure_optimizer
    from megareshard.planner.costs import layer_flops

    total = 0.0
    cores = os.cpu_count() or 1
    for point in points:
        m = point.model
        shape = ModelShape(m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size,
                           dtype_bytes=4)
        mm = measure_matmul(m.seq_length * 2, m.hidden_size, shape.ffn)
        layer = measure_layer(shape, 2)
        share = max(1.0, point.hosts * point.procs_per_host / cores)  # every rank computes at once
        opt = measure_optimizer(m.hidden_size)
        cluster = ClusterSpec(point.hosts, point.procs_per_host, 4.0, mm["flops"] / 1e12,
                              min(1.0, layer_flops(shape, 2) / layer["forward_s"] / mm["flops"]) / share,
                              nic_gbps=point.rate_mbit / 1e3, intra_gbps=30.0,
                              backward_factor=layer["backward_s"] / layer["forward_s"],
                              optimizer_s_per_param=opt["seconds_per_param"] * share,
                              grad_pass_s_per_param=opt["grad_pass_s_per_param"] * share)
        configs, n = plan_point(point, slowed(EmulatedCluster(cluster)))
        est = estimate_wall_s([c["predicted_s"] for c in configs])
        total += est
        print(f"# {point.key}: {len(configs)} of {n} configurations, estimate {est:.0f} s")
        print(" ".join(_emulated(point, calibration_cmd(point, "CLUSTER.json"), 360)))
        print(" ".join(_emulated(point, ["-m", "lab.validation.validate_planner", "--worker", "SPEC.json"], 360)))
        for c in configs:
            print(f"#   {c['why']:6s} #{c['rank']:<4d} {c['predicted_s']:.3f} s  {c['name']}")
    print(f"# estimated wall time: {total / 60:.1f} min for {len(points)} point(s)")
    return 0


def tables(data: dict[str, Any]) -> str:
    out = ["| point | finished | Spearman | planner's choice | measured vs best | targets |",
           "|---|---|---|---|---|---|"]
    for p in data["points"]:
        s = p.get("summary") or summarize(p.get("results", []))
        if "spearman" not in s:
            why = p.get("status", "too few finished")
            out.append(f"| {p['key']} | {s['finished']}/{s['started']} | — | — | — | {why} |")
            continue
        met = "met" if s["spearman_target_met"] and s["choice_target_met"] else "NOT met"
        out.append(f"| {p['key']} | {s['finished']}/{s['started']} | {s['spearman']:.2f} | {s['choice']} | "
                   f"{100 * s['choice_gap']:+.1f} % | {met} |")
    for p in data["points"]:
        # runs since 51 also record the step's CPU seconds, planned (shared cores) and the machine's busy time
        cpu = {c["name"]: c["shared_cpu_s"] for c in p.get("configs", []) if "shared_cpu_s" in c}
        busy = any("machine_cpu_s" in r for r in p.get("results", []))
        head = "| # | why | configuration | predicted s | measured s | actions over their paced budget | "
        out += ["", f"#### {p['key']}", "", head + ("step CPU s, planned / machine | " if busy else "") + "status |",
                "|---|---|---|---|---|---|" + ("---|" if busy else "") + "---|"]
        for r in sorted(p.get("results", []), key=lambda r: r["rank"]):
            meas = f"{r['measured_s']:.3f}" if r.get("status") == "ok" else "—"
            extra = ""
            if busy:
                planned = f"{cpu[r['name']]:.2f}" if r["name"] in cpu else "—"
                extra = f" {planned} / {r['machine_cpu_s']:.2f} |" if "machine_cpu_s" in r else f" {planned} / — |"
            out.append(f"| {r['rank']} | {r['why']} | {r['name']} | {r['predicted_s']:.3f} | {meas} | "
                       f"{r.get('pace_overruns', '—')} |{extra} {r['status']} |")
    return "\n".join(out)


def history(paths: Sequence[str]) -> str:
    """Every run side by side (docs/benchmarks.md's tables): per run its median prediction error and how many
    points met both targets, then every point of every run. The run number is the N of `..._runN.json`
    (`..._runN_holdout.json` likewise)."""
    import re

    runs = []
    for path in paths:
        m = re.search(r"run(\d+)\D*\.json$", path)
        runs.append((int(m.group(1)) if m else 0, read_results(path)))
    runs.sort(key=lambda r: r[0])
    yes = {True: "met", False: "not met"}
    out = ["| run | median \\|measured / predicted − 1\\| | points meeting both targets |", "|---|---|---|"]
    for n, data in runs:
        every = [r for p in data["points"] for r in p.get("results", [])]
        err = median_error(every)
        met = sum(1 for p in data["points"] if p["summary"].get("spearman_target_met")
                  and p["summary"].get("choice_target_met"))
        out.append(f"| {n} | {'—' if err is None else f'{100 * err:.0f}%'} | {met} of {len(data['points'])} |")
    out += ["", "| run | point | finished | Spearman | planner's choice | measured vs best (best) | targets "
            "(Spearman / choice) | most pace overruns in one config |", "|---|---|---|---|---|---|---|---|"]
    for n, data in runs:
        for p in data["points"]:
            s = p["summary"]
            if s.get("spearman") is None:
                out.append(f"| {n} | {p['key']} | {s['finished']}/{s['started']} | — | — | — | "
                           f"{p.get('status', 'too few finished')} | — |")
                continue
            over = max((r.get("pace_overruns", 0) for r in p["results"] if r.get("status") == "ok"), default=0)
            out.append(f"| {n} | {p['key']} | {s['finished']}/{s['started']} | {s['spearman']:.2f} | {s['choice']} | "
                       f"{100 * s['choice_gap']:+.0f}% ({s['best_measured']}) | {yes[s['spearman_target_met']]} / "
                       f"{yes[s['choice_target_met']]} | {over} |")
    return "\n".join(out)


def replay(paths: Sequence[str]) -> tuple[str, bool]:
    """Every finished run's measured configurations predicted again by the current planner, from the run's own
    recorded calibration and emulated device (its pace margin, slack and late wake-up): per point, how many
    predictions equal the recorded ones bit for bit, and both targets with the recorded and the current
    predictions. A run made with the current code reproduces exactly; after a change to the cost model it shows
    what the change does to the points already measured — not an independent check, since the configurations
    were chosen by the old ranking. Returns the table and whether every prediction reproduced."""
    from lab.validation.validation import ModelPoint

    yes = {True: "met", False: "not met", None: "—"}
    out = ["| run | point | predictions reproduced | Spearman (recorded → now) | choice vs best (recorded → now) | "
           "targets now |", "|---|---|---|---|---|---|"]
    exact = True
    for path in paths:
        data = read_results(path)
        for rec in data["points"]:
            if "calibration" not in rec:
                continue
            pj = rec["point"]
            point = GridPoint(ModelPoint(**pj["model"]), pj["hosts"], pj["procs_per_host"], pj["rate_mbit"])
            cluster = recorded_device(point, rec["calibration"], data.get("method", {}), f"{path} ({rec['key']})")
            now = {c.name: (i + 1, c.step_s) for i, c in enumerate(ranking(point, cluster))}
            ok = [r for r in rec["results"] if r.get("status") == "ok"]
            missing = [r["name"] for r in ok if r["name"] not in now]
            if missing:  # the current search no longer has a measured configuration
                exact = False
                out.append(f"| {path} | {rec['key']} | 0 of {len(ok)} ({len(missing)} no longer planned) | "
                           "— | — | — |")
                continue
            same = sum(1 for r in ok if now[r["name"]][1] == r["predicted_s"])
            exact &= same == len(ok)
            again = [r | {"rank": now[r["name"]][0], "predicted_s": now[r["name"]][1]} for r in ok]
            a, b = rec["summary"], summarize(again)
            out.append(f"| {path} | {rec['key']} | {same} of {len(ok)} | {a.get('spearman')} → {b.get('spearman')} "
                       f"| {a.get('choice_gap')} → {b.get('choice_gap')} | "
                       f"{yes[b.get('spearman_target_met')]} / {yes[b.get('choice_target_met')]} |")
    return "\n".join(out), exact


def draw(data: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = data["points"]
    fig, axes = plt.subplots(1, max(1, len(pts)), figsize=(4 * max(1, len(pts)), 4), squeeze=False)
    for ax, p in zip(axes[0], pts):
        ok = [r for r in p.get("results", []) if r.get("status") == "ok"]
        for why, mark in (("top", "o"), ("sample", "x")):
            xs = [r["predicted_s"] for r in ok if r["why"] == why]
            ys = [r["measured_s"] for r in ok if r["why"] == why]
            ax.scatter(xs, ys, marker=mark, label=why)
        if ok:
            lo = min(min(r["predicted_s"], r["measured_s"]) for r in ok)
            hi = max(max(r["predicted_s"], r["measured_s"]) for r in ok)
            ax.plot([lo, hi], [lo, hi], "k:", lw=1)
        s = p.get("summary") or summarize(p.get("results", []))
        ax.set_title(f"{p['key']}\nSpearman {s.get('spearman')}", fontsize=8)
        ax.set_xlabel("predicted s/step")
        ax.set_ylabel("measured s/step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _contention(text: str) -> float | None:
    """--cpu-contention: a rate ≥ 0, or 'measured' (None: each calibration's own fit)."""
    if text == "measured":
        return None
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor 'measured'") from None
    if not rate >= 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0: waiting for a core cannot shorten a step")
    return rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="validate_planner.py", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print each point's commands and the wall estimate")
    p.add_argument("--from-json", default=None, help="no run: print the tables (and --img) of a finished run")
    p.add_argument("--history", nargs="+", default=None, metavar="RUN_JSON",
                   help="no run: the tables of several runs side by side (planner_validation_run*.json)")
    p.add_argument("--replay", nargs="+", default=None, metavar="RUN_JSON",
                   help="no run: predict each run's measured configurations again with the current code from the "
                        "run's recorded calibration (exit code 1 unless every prediction reproduces bit for bit)")
    p.add_argument("--json", default="docs/results/planner_validation.json", help="results (rewritten per point)")
    p.add_argument("--img", default="docs/img/planner_validation.png", help="predicted vs measured picture")
    p.add_argument("--grid", choices=sorted(GRIDS), default="main",
                   help="main: the grid the cost model was developed on; holdout, fresh, blind: grids fixed before "
                        "their first runs (runs 16, 25 and 38)")
    p.add_argument("--points", default=None, help="comma list of point keys (default: the whole grid)")
    p.add_argument("--point-timeout", type=float, default=300.0, help="stop one point's run after this many seconds")
    p.add_argument("--budget-min", type=float, default=30.0,
                   help="wall-time budget of the whole grid: each point's launches stop at its share of what is left "
                        "(the configurations they did not reach are reported as not finished)")
    p.add_argument("--pace-margin", type=float, default=PACE_MARGIN,
                   help=f"how much slower than measured the emulated device computes (default {PACE_MARGIN}, "
                        "validation.PACE_MARGIN; recorded in the JSON's method)")
    p.add_argument("--cpu-contention", type=_contention, default=POOLED_CPU_CONTENTION, metavar="RATE|measured",
                   help=f"the shared cores' contention the planner is told (default {POOLED_CPU_CONTENTION}, "
                        "validation.POOLED_CPU_CONTENTION: chosen on replays of runs 88-104; runs 96-100 used 0.26, "
                        "101-104 0.35); "
                        "'measured': each point's own calibration fit, as runs 1-95 (recorded in the JSON's method)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return _worker(a.worker)
    if a.pace_margin < 1.0:
        p.exit(2, f"{p.prog}: error: --pace-margin {a.pace_margin:g} is below 1: the emulated device would be faster "
                  "than the compute measured, and every paced action would overrun its budget\n")
    if a.history:
        try:
            print(history(a.history))
        except (OSError, ValueError) as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
        return 0
    if a.replay:
        try:
            table, exact = replay(a.replay)
        except (OSError, ValueError, KeyError) as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
        print(table)
        return 0 if exact else 1
    if a.from_json:
        try:
            data = read_results(a.from_json)
        except (OSError, ValueError) as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
        print(tables(data))
        if a.img:
            draw(data, a.img)
            print(f"picture: {a.img}")
        return 0
    grid = GRIDS[a.grid]
    points = list(grid)
    if a.points:
        keys = a.points.split(",")
        unknown = [k for k in keys if k not in {g.key for g in grid}]
        if unknown:
            p.exit(2, f"{p.prog}: error: unknown point(s) {', '.join(unknown)}; the {a.grid} grid: "
                      f"{', '.join(g.key for g in grid)}\n")
        points = [g for g in grid if g.key in keys]
    if a.dry_run:
        return dry_run(points)
    return run_grid(a, points)


if __name__ == "__main__":
    sys.exit(main())
