#!/usr/bin/env python
"""Calibrate an emulated cluster: the product's calibration, then what the emulation adds to it; write a cluster JSON.

    # under the emulated cluster (root): 4 hosts × 2 ranks, 100 Mbit/s NICs
    python -m lab.cluster.emulate_cluster --hosts 4 --procs-per-host 2 --nic-rate 100mbit -- \\
        -m lab.cluster.calibrate_emulated --hidden-size 256 --num-attention-heads 4 --seq-length 256 --json cluster.json
    # this machine, 2 local gloo ranks (torchrun started here)
    python -m lab.cluster.calibrate_emulated --nproc 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32

What it measures, in one launch (every rank, collective calls in one order):

1. the product's `megareshard.planner.calibration.calibrate`: what a real cluster has (device, layer,
   optimizer, links, latencies) → the `ClusterSpec`, as ``tools/calibrate_cluster.py`` would write it;
2. how late a paced action's closing sleep ends (`calibration_shared.measure_sleep_overshoot`), at the CPU
   demand of runs paced ``--pace-margin`` times slower than measured: recorded in ``measured``, for the
   validation's emulated device (a device has no such sleep);
3. where every rank runs on one kernel (the hosts share the machine's cores): the cores and the CPU rates of a
   step's work (`calibration_shared.measure_shared_cpu`, the optimizer's CPU time, the load), a real pipeline of
   one small layer per rank unpaced at two microbatch counts (``cpu_s_per_action``, ``cpu_s_per_step``), and one
   of the model's own layers per rank paced as the emulated device paces that layer's forward
   (``cpu_contention``; and what posting a send and a receive holds a rank's program: the `ClusterSpec`'s
   ``send_post_s`` and ``recv_post_s``) → `SharedCores`.

The JSON is the product's cluster file (the product's tools read it as a real cluster) with the shared cores in
its ``"lab": {"shared_cores": {...}}`` section (`shared_cpu.write_cluster`; the lab reads it with
`shared_cpu.load_cluster`). Model flags keep Megatron-LM's names.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable

from lab import env_with_root, module_command
from lab.cluster.calibration_shared import (PROBE, busy_over, fit_contention, fit_runtime_cpu, measure_shared_cpu,
                                            measure_sleep_overshoot)
from lab.cluster.shared_cpu import EmulatedCluster, SharedCores, write_cluster
from megareshard.planner.calibration import calibrate, measure_layer, rank_median
from megareshard.planner.costs import ClusterSpec, ModelShape
from megareshard.planner.search import pipeline_makespan

ENV_ARGV = "MR_CALIBRATE_EMULATED_ARGV"


def calibrate_emulated(model: ModelShape, micro_batch: int, devices_per_host: int, device_memory_gib: float,
                       iters: int = 3, target_s: float = 0.3, pace_margin: float = 1.0,
                       runtime_step_cpu: Callable[..., tuple[float, float]] | None = None
                       ) -> tuple[EmulatedCluster, dict[str, Any]]:
    """The product's `calibrate`, then the emulation's own measurements (`measure_emulation`); a collective call."""
    cluster, measured = calibrate(model, micro_batch, devices_per_host, device_memory_gib, iters=iters,
                                  target_s=target_s)
    return measure_emulation(model, micro_batch, cluster, measured, iters=iters, target_s=target_s,
                             pace_margin=pace_margin, runtime_step_cpu=runtime_step_cpu)


def measure_emulation(model: ModelShape, micro_batch: int, cluster: ClusterSpec, measured: dict[str, Any],
                      iters: int = 3, target_s: float = 0.3, pace_margin: float = 1.0,
                      runtime_step_cpu: Callable[..., tuple[float, float]] | None = None
                      ) -> tuple[EmulatedCluster, dict[str, Any]]:
    """What the emulation adds to the product's calibration (`cluster`, `measured`: `calibrate`'s; the module
    docstring's steps 2 and 3), with `measured` updated; a collective call. `runtime_step_cpu(m, pace=None,
    posts=None, layer=None)` (`probe_step_cpu`): the machine's busy and wall seconds of a real training step of m
    microbatches through a pipeline of one `PROBE` layer per rank (`layer`: the model's layer at `micro_batch`
    instead), every action paced to `pace` seconds if given; given a dict `posts`, it also fills in the mean
    seconds a send and a receive held a rank's program (``send_s``, ``recv_s``), how many of each it counted over
    the ranks and the mean thread CPU seconds of its compute actions by kind. Without it the runtime's and the
    contention's rates stay 0."""
    import torch.distributed as dist

    devices_per_host = cluster.devices_per_host
    layer, action = measured["layer"], measured["action_overhead"]
    # a paced action of about a layer's forward: how late its closing sleep ends (raw, see the function), at
    # the CPU demand of runs paced `pace_margin` times slower than measured
    measured["sleep_overshoot"] = measure_sleep_overshoot(max(1e-3, layer["under_load_forward_s"] * pace_margin),
                                                          layer["forward_cpu_s"])
    if not dist.is_initialized():
        return EmulatedCluster(cluster), measured
    world = dist.get_world_size()
    nic, intra = measured.get("nic"), measured.get("intra")
    nic_lat, intra_lat = measured.get("nic_latency"), measured.get("intra_latency")
    # one machine under every rank (an emulated cluster): the cores they share
    shared = measured["shared_cpu"] = measure_shared_cpu(devices_per_host, nic["Bps"] if nic else None,
                                                         intra["Bps"] if intra else None, target_s * 2 / 3,
                                                         iters=iters)
    if not shared:
        return EmulatedCluster(cluster), measured
    load = measured["load"]["load"]
    # compute: a device second is CPU time stretched by the load
    rates: dict[str, float] = dict(
        cores=max(0.5, shared["cores"] - shared["idle_busy_cores"]), compute_cpu_share=min(1.0, 1.0 / load),
        cpu_s_per_param=measured["optimizer"]["cpu_s_per_param"],
        cpu_s_per_nic_byte=shared["nic"]["cpu_s_per_byte"] if "nic" in shared else 0.0,
        cpu_s_per_intra_byte=shared["intra"]["cpu_s_per_byte"] if "intra" in shared else 0.0)
    if runtime_step_cpu is not None:
        probe = ModelShape(world, PROBE["hidden_size"], PROBE["num_attention_heads"], PROBE["seq_length"],
                           PROBE["vocab_size"])
        own = measure_layer(probe, 1, iters=3 * iters)
        own = {k: rank_median(own[k]) for k in ("forward_cpu_s", "input_grad_cpu_s", "weight_grad_cpu_s")}
        runtime = shared["runtime"] = fit_runtime_cpu(runtime_step_cpu, world, own, shared["idle_busy_cores"])
        # a pipeline of one of the model's own layers per rank (the probe's vocabulary), paced as the emulated
        # device paces that layer's forward (the sleep overshoot's chunk): its CPU work per action is what the
        # runs' is, so the cores fill as they do in the runs (the probe's own small layer left them idle: a
        # contention of 0 at points whose configurations then ran the cores 83-99 % busy and measured 1.1-1.4×
        # their prediction, run 90's gpt-deep 8 × 1)
        budget = measured["sleep_overshoot"]["chunk_s"]
        act = model.seq_length * model.hidden_size * micro_batch * 4
        paced_step = functools.partial(runtime_step_cpu, layer={
            "hidden_size": model.hidden_size, "num_attention_heads": model.num_attention_heads,
            "seq_length": model.seq_length, "micro_batch": micro_batch})
        link, lat = (nic, nic_lat) if nic and nic_lat else (intra, intra_lat)
        edge = (lat["seconds"] if lat else 0.0) + (act / link["Bps"] if link else 0.0)
        overhead = action["seconds"] + measured["sleep_overshoot"]["seconds"]
        # what posting a send and a receive holds a rank's program: counted in the contention fit's paced steps
        posts = shared["posts"] = {}

        def simulated(m: int) -> float:
            return pipeline_makespan("1f1b", True, world, m, budget, 2 * budget, budget, edge, overhead,
                                     (posts["send_s"], posts["recv_s"]))

        byte_rate = rates["cpu_s_per_nic_byte" if "nic" in shared else "cpu_s_per_intra_byte"]
        # a microbatch's CPU work as the planner counts it: per rank three actions and the layer's compute (its
        # device time × compute_cpu_share = its CPU time: the load cancels), and the boundary bytes
        own_layer = layer["forward_cpu_s"] + layer["input_grad_cpu_s"] + layer["weight_grad_cpu_s"]
        per_mb = world * (3 * runtime["cpu_s_per_action"] + own_layer) + 2 * (world - 1) * act * byte_rate
        contention = shared["contention"] = fit_contention(paced_step, world, budget, simulated, per_mb,
                                                           rates["cores"], posts=posts)
        cluster = dataclasses.replace(cluster, send_post_s=posts["send_s"], recv_post_s=posts["recv_s"])
        rates |= dict(cpu_s_per_action=runtime["cpu_s_per_action"], cpu_s_per_step=runtime["cpu_s_per_step"],
                      cpu_contention=contention["cpu_contention"])
    return EmulatedCluster(cluster, SharedCores(**rates)), measured


def probe_step_cpu(per_host: int) -> Callable[..., tuple[float, float]]:
    """`calibrate_emulated`'s runtime probe: fn(m, pace=None) builds the trainer for a GPT of one `PROBE` layer per
    rank (pp = world, 1f1b, delayed weight gradients, micro batch 1, m microbatches; every action paced to `pace`
    seconds if given, by the lab's pacing hook; `layer`, a dict of hidden_size, num_attention_heads, seq_length and
    micro_batch, replaces the probe's layer, not its vocabulary), runs one step to warm up and five timed, and
    returns the medians over them of (the machine's busy CPU seconds, wall seconds) of a step, as rank 0 read them
    around it (every process and the kernel; collective: every rank gets them). Given a dict `posts` (paced), it
    also fills in what a send and a receive held a rank's program on average in the last step, over every rank,
    and the mean CPU seconds of its compute actions by kind (``compute_cpu_s``: F, I, W; recorded, not planned
    with)."""
    import io

    import torch
    import torch.distributed as dist

    from lab.cluster.pacing import pacer
    from megareshard.arguments import parse_args
    from megareshard.training import Trainer, build_context

    def step_cpu(m: int, pace: float | None = None, posts: dict[str, float] | None = None,
                 layer: dict[str, int] | None = None) -> tuple[float, float]:
        world = dist.get_world_size()
        shape = PROBE | (layer or {})  # the probe's vocabulary always: the pipeline's ends stay small
        mb = shape.get("micro_batch", 1)
        argv = ["--mock-data", "--num-layers", str(world), "--hidden-size", str(shape["hidden_size"]),
                "--num-attention-heads", str(shape["num_attention_heads"]), "--seq-length", str(shape["seq_length"]),
                "--vocab-size", str(PROBE["vocab_size"]), "--global-batch-size", str(m * mb),
                "--micro-batch-size", str(mb),
                "--pipeline-model-parallel-size", str(world), "--pipeline-schedule", "1f1b",
                "--delay-wgrad-compute", "--train-iters", "1000000", "--lr", "1e-4", "--device", "cpu",
                "--log-interval", "1000000", "--hidden-dropout", "0", "--attention-dropout", "0",
                "--nproc-per-node", str(per_host)]
        cfg = parse_args(argv, world_size=world)
        ctx, _ = build_context(cfg, world)
        trainer = Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())
        if pace is not None:  # every action paced to `pace` seconds (a backward, unsplit, to two)
            pacer(trainer.pipeline).budgets = {"F": pace, "B": 2 * pace, "I": pace, "W": pace}
        batch = trainer._microbatches(trainer.train_data, next(trainer._train_iter))
        busy_wall = busy_over(lambda: trainer.train_step(batch), iters=5)
        if posts is not None:  # the last step's sends and receives over every rank (paced runs count them)
            st = trainer.pipeline.last_stats
            sums = torch.tensor([float(st.get(f"paced_{w}_{k}_{d}", 0)) for k in ("SEND", "RECV") for d in "FB"
                                 for w in ("n", "wall_us")], dtype=torch.float64)
            dist.all_reduce(sums)
            n_send, us_send, n_recv, us_recv = (float(sums[i] + sums[i + 2]) for i in (0, 1, 4, 5))
            if n_send == 0 or n_recv == 0:
                raise RuntimeError(f"the paced probe over {world} ranks counted {n_send:g} sends and {n_recv:g} "
                                   f"receives (paced to {pace}): a pipeline of one layer per rank has both")
            posts.update(send_s=us_send / n_send / 1e6, recv_s=us_recv / n_recv / 1e6, sends=int(n_send),
                         recvs=int(n_recv))
            # and what its compute actions took of their ranks' CPU (thread time), per kind: recorded beside the
            # layer's own CPU times, which the plan counts (not used by the planner)
            kinds = ("F", "I", "W")
            comp = torch.tensor([float(st.get(f"paced_{w}_{k}", 0)) for k in kinds for w in ("n", "cpu_us")],
                                dtype=torch.float64)
            dist.all_reduce(comp)
            posts["compute_cpu_s"] = {k: float(comp[2 * i + 1]) / float(comp[2 * i]) / 1e6
                                      for i, k in enumerate(kinds) if comp[2 * i] > 0}
        trainer.close()
        trainer.release_communicators()
        return busy_wall

    return step_cpu


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.cluster.calibrate_emulated", description=__doc__.splitlines()[0])
    g = p.add_argument_group("model (Megatron-LM's flags)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--vocab-size", type=int, default=512)
    g.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2, help="ranks when this tool starts torchrun itself")
    p.add_argument("--procs-per-host", type=int, default=None, help="default: torchrun's LOCAL_WORLD_SIZE")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory per device (default: the GPU's, on CPU the RAM per process)")
    p.add_argument("--iters", type=int, default=3, help="timed repetitions of every measurement (median)")
    p.add_argument("--pace-margin", type=float, default=1.0,
                   help="an emulation paces compute this much slower than measured (lab.validation.validate_planner): "
                        "the sleep overshoot is measured at the CPU demand of such runs")
    p.add_argument("--json", default=None, help="write the cluster JSON here (rank 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="plain launch: kill torchrun after this long")
    return p


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from megareshard.planner.auto import device_memory_gib

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    per_host = a.procs_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    model = ModelShape(a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.vocab_size,
                       ffn_hidden_size=a.ffn_hidden_size)
    em, measured = calibrate_emulated(model, a.micro_batch_size, per_host, a.device_memory_gib or
                                      device_memory_gib(per_host), iters=a.iters, pace_margin=a.pace_margin,
                                      runtime_step_cpu=probe_step_cpu(per_host))
    if dist.get_rank() == 0:
        c, s = em.cluster, em.shared
        print(f"[calibrate_emulated] {c.hosts} host(s) × {c.devices_per_host}: matmul {c.device_tflops * 1e3:.1f} "
              f"GFLOP/s, NIC {c.nic_gbps:.3f} Gbit/s, sleep overshoot "
              f"{measured['sleep_overshoot']['seconds'] * 1e3:.2f} ms; "
              + (f"{s.cores:.2f} shared cores, contention {s.cpu_contention:.2f}" if s else "no shared cores"),
              flush=True)
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(write_cluster(em, measured), f, indent=1)
            print(f"[calibrate_emulated] wrote {a.json}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get(ENV_ARGV) is not None and "RANK" in os.environ:
        argv = json.loads(os.environ[ENV_ARGV])
    a = p.parse_args(argv)
    if min(a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.micro_batch_size, a.nproc,
           a.iters) < 1 or a.hidden_size % a.num_attention_heads:
        p.exit(2, f"{p.prog}: error: sizes must be positive and --hidden-size {a.hidden_size} divisible by "
                  f"--num-attention-heads {a.num_attention_heads}\n")
    if a.pace_margin < 1.0:
        p.exit(2, f"{p.prog}: error: --pace-margin {a.pace_margin:g} is below 1: an emulation paces compute no "
                  "faster than measured\n")
    if "RANK" in os.environ:
        return worker(a)
    # the arguments travel in the environment: torchrun's own parser would claim --nproc
    cmd = module_command("torch.distributed.run", ["--standalone", "--nproc-per-node", str(a.nproc), "-m",
                                                   "lab.cluster.calibrate_emulated"])
    # torchrun's torchelastic_* dirs and torch's compile cache (created when the runtime probe's trainer imports
    # torch._dynamo) land in a private temp dir, removed at the end
    tmp = tempfile.mkdtemp(prefix="mr-calibrate-")
    env = env_with_root(OMP_NUM_THREADS="1", TMPDIR=tmp, **{ENV_ARGV: json.dumps(argv)})
    try:
        return subprocess.run(cmd, env=env, timeout=a.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"{p.prog}: error: torchrun did not finish within {a.timeout:.0f} s", file=sys.stderr)
        return 124
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
