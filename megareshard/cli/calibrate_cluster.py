"""Measure the machines at hand for the layout planner and write a cluster JSON.

    # this machine, 2 local gloo ranks (torchrun started here)
    python tools/calibrate_cluster.py --nproc 2 --num-layers 4 --hidden-size 256 --num-attention-heads 4 \\
        --seq-length 256 --vocab-size 512 --micro-batch-size 2 --json cluster.json
    # several hosts: under your launcher, one process per device (torchrun --nnodes ... tools/calibrate_cluster.py ...)
    # then
    python tools/plan_layout.py ... --cluster cluster.json
    torchrun ... pretrain_gpt.py ... --auto-layout --auto-layout-cluster cluster.json

Measures (megareshard/planner/calibration.py): matmul FLOP/s at the model's sizes, one layer's
forward and backward at its shape, send/recv bandwidth inside a host (ranks 0 and 1) and across
hosts (rank 0 of hosts 0 and 1), latencies, the optimizer. Model flags keep Megatron-LM's names.
Inside torchrun (RANK set) this script is the worker; otherwise it starts ``torchrun --standalone
--nproc-per-node N -m megareshard.cli.calibrate_cluster`` (itself). Rank 0 prints the cluster and writes ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from megareshard.planner.calibration import calibrate, cluster_to_json
from megareshard.planner.costs import ModelShape

ENV_ARGV = "MR_CALIBRATE_ARGV"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="calibrate_cluster.py", description=__doc__.splitlines()[0])
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
    p.add_argument("--json", default=None, help="write the cluster JSON here (rank 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="plain launch: kill torchrun after this long")
    return p


def model_of(a: argparse.Namespace) -> ModelShape:
    return ModelShape(a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.vocab_size,
                      ffn_hidden_size=a.ffn_hidden_size)


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from megareshard.planner.auto import device_memory_gib

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    per_host = a.procs_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    memory = a.device_memory_gib or device_memory_gib(per_host)
    cluster, measured = calibrate(model_of(a), a.micro_batch_size, per_host, memory, iters=a.iters)
    if rank == 0:
        print(f"[calibrate_cluster] {cluster.hosts} host(s) × {cluster.devices_per_host}: matmul "
              f"{cluster.device_tflops * 1e3:.1f} GFLOP/s, layer efficiency {cluster.efficiency:.2f}, backward "
              f"{cluster.backward_factor:.2f}× forward, intra-host {cluster.intra_gbps:.2f} Gbit/s, NIC "
              f"{cluster.nic_gbps:.3f} Gbit/s; latency intra {cluster.intra_latency_s * 1e6:.0f} µs, NIC "
              f"{cluster.nic_latency_s * 1e6:.0f} µs, collective {cluster.collective_latency_s * 1e6:.0f} µs, "
              f"action {cluster.action_overhead_s * 1e6:.0f} µs"
              + (f" (not measured, default: {', '.join(measured['not_measured'])})"
                 if measured["not_measured"] else ""), flush=True)
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(cluster_to_json(cluster, measured), f, indent=1)
            print(f"[calibrate_cluster] wrote {a.json}", flush=True)
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
    if "RANK" in os.environ:
        return worker(a)
    # the arguments travel in the environment: torchrun's own parser would claim --nproc
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
           "-m", "megareshard.cli.calibrate_cluster"]
    # torchrun's torchelastic_* dirs land in a private temp dir, removed at the end
    tmp = tempfile.mkdtemp(prefix="mr-calibrate-")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp, **{ENV_ARGV: json.dumps(argv)})
    try:
        return subprocess.run(cmd, env=env, timeout=a.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"{p.prog}: error: torchrun did not finish within {a.timeout:.0f} s", file=sys.stderr)
        return 124
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
