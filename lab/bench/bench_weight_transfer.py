#!/usr/bin/env python3
"""Benchmark live weight transfer (issue #50): a trainer's weights at tp 2 · pp 2 on two hosts to generator
replicas on two other hosts, five ways side by side in one launch (docs/benchmarks.md, "Live weight transfer").

    # the emulated cluster: 4 hosts of 3 ranks behind 1 Gbit/s NICs (docs/design.md §7)
    python -m lab.cluster.emulate_cluster --hosts 4 --procs-per-host 3 --nic-rate 1gbit -- \
        -m lab.bench.bench_weight_transfer --nic-gbps 1 --out docs/bench/weight_transfer.json
    # plain torchrun (hosts are labels only: rank // LOCAL_WORLD_SIZE), a correctness check of the methods
    torchrun --nproc-per-node 12 -m lab.bench.bench_weight_transfer --ranks-per-host 3 --hidden 64 --vocab 1000 --repeat 1

Ranks: host h holds ranks 3h .. 3h+2. The trainer (tp 2 · pp 2, a Llama-style GPT, fp32) is ranks 0,1 (stage 0,
host 0) and 3,4 (stage 1, host 1). The two shapes, fixed before running:

* **A**, one replica per host on two hosts: tp 2 on ranks 6,7 (host 2) and tp 2 on ranks 9,10 (host 3);
* **B**, two replicas per host with different tp: tp 2 on 6,7 and tp 1 on 8 (host 2); tp 2 on 9,10 and tp 1 on
  11 (host 3).

The methods (every rank of the launch takes part in each, ranks without a part stay idle):

* ``planned``: megareshard's transfer (`resharding.weight_transfer`: pieces from every source rank, buckets,
  a load-balanced pipelined broadcast through the receiving hosts, fan-out inside a host);
* ``per_param``: what RL frameworks did first: one rank per source stage gathers each whole parameter from its
  tp peers and sends it, one message per parameter, to every destination rank (which keeps its slice);
* ``round_robin``: Megatron-Core's refit plan: shard-to-shard point-to-point, every destination rank's cells
  from one holder chosen round-robin by destination rank over the holders (data-parallel replicas), one message
  per (parameter, cell, destination), all posted at once;
* ``dcp``: a DCP save of the trainer's shards into a temp directory on the local disk, then a DCP load of every
  destination rank's box (megareshard's checkpoint planners, `checkpoint/dcp_io.py`);
* the network lower bound: the busiest NIC side's bytes of the planned transfer over the NIC goodput measured
  once at start (one 64 MiB message host 0 -> host 1), and the bytes each destination host must receive at least
  once over that goodput (no plan can do better).

Per (shape, method): one warm-up run whose received weights are checked bitwise against the source, then
``--repeat`` timed runs (barrier, run, barrier; the median is reported), then one more run with each host's
eth0 byte counters sampled every 5 ms by a thread on its first rank (the per-NIC timeline of the picture; not
timed). Rank 0 writes the JSON; ``python -m lab.bench.transfer_timeline JSON -o PNG`` draws it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megareshard.resharding.decompose import cells
from megareshard.resharding.network import NetworkModel
from megareshard.resharding.weight_transfer import (ParamInfo, Replica, TransferExecutor, layout_boxes,
                                                    plan_weight_transfer)
from megareshard.resharding.weight_transfer.boxes import ITEMSIZE
from megareshard.transfer import Destination, destination_boxes

Region = tuple[tuple[int, int], ...]
SHAPES = {"A": [("gen_a_tp2", (6, 7), 2), ("gen_b_tp2", (9, 10), 2)],
          "B": [("gen_a_tp2", (6, 7), 2), ("gen_a_tp1", (8,), 1), ("gen_b_tp2", (9, 10), 2), ("gen_b_tp1", (11,), 1)]}
TRAINER = (0, 1, 3, 4)  # tp innermost, then pp: stage 0 on host 0, stage 1 on host 1


# ------------------------------------------------------------------------------------------------ the model
def model_params(a: argparse.Namespace) -> list[ParamInfo]:
    """The GPT's global tensors, read from a real GPTModel at tp 1 (built on rank 0 only, then shared)."""
    from megareshard.models import GPTModel
    from megareshard.parallel import ParallelContext
    from megareshard.transfer import source_boxes

    ctx = ParallelContext.single_process()
    m = GPTModel(model_config(a), ctx, device="cpu")
    return source_boxes(m, ctx)[0]


def model_config(a: argparse.Namespace):
    from megareshard.models.config import ModelConfig

    return ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=128,
                       vocab_size=a.vocab, make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                       attention_dropout=0.0, normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                       group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=True,
                       disable_bias_linear=True)


def truth(p: ParamInfo, region: Region) -> torch.Tensor:
    """The parameter's value on ``region``: a pattern of its name and global index (cheap, exact in fp32)."""
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(p.shape))):
        a, b = region[d]
        r = torch.arange(a, b, dtype=torch.int64).view(*([1] * d), b - a, *([1] * (len(p.shape) - d - 1)))
        idx = idx + r * stride
        stride *= p.shape[d]
    return ((idx * 7 + zlib.crc32(p.name.encode())) % 8191).to(torch.float32) / 64.0


def view(t: torch.Tensor, region: Region, base: Region) -> torch.Tensor:
    for d, ((a, b), (o, _)) in enumerate(zip(region, base)):
        t = t.narrow(d, a - o, b - a)
    return t


# ------------------------------------------------------------------------------------------------ methods
class Setup:
    """What every method gets: the parameters, the source boxes, the replicas' boxes, the hosts, this rank's source
    tensors and fresh destination tensors."""

    def __init__(self, params: list[ParamInfo], source: dict[int, list], replicas: list[Replica],
                 hosts: dict[int, int], rank: int) -> None:
        self.params, self.source, self.replicas, self.hosts, self.rank = params, source, replicas, hosts, rank
        self.by_name = {p.name: p for p in params}
        self.src_boxes = {b.name: b.region for b in source.get(rank, [])}
        self.dst_boxes: dict[str, Region] = {}
        for rep in replicas:
            for b in rep.boxes.get(rank, []):
                self.dst_boxes[b.name] = b.region
        self.sources = {n: truth(self.by_name[n], reg) for n, reg in self.src_boxes.items()}
        self.dst_ranks = sorted(r for rep in replicas for r in rep.boxes)

    def fresh_dests(self) -> dict[str, torch.Tensor]:
        return {n: torch.full(tuple(b - a for a, b in reg), float("nan")) for n, reg in self.dst_boxes.items()}

    def check(self, dests: dict[str, torch.Tensor]) -> int:
        """Elements received that differ from the source (0 = bitwise)."""
        bad = 0
        for n, reg in self.dst_boxes.items():
            want = truth(self.by_name[n], reg)
            bad += int((dests[n] != want).sum())
        return bad


def _side_bytes(msgs, hosts: dict[int, int]) -> dict[str, int]:
    """Bytes per host NIC side ("h2 in", "h0 out") of ``(src, dst, nbytes)`` messages between hosts."""
    out: dict[str, int] = {}
    for a, b, n in msgs:
        if hosts[a] != hosts[b]:
            out[f"h{hosts[a]} out"] = out.get(f"h{hosts[a]} out", 0) + n
            out[f"h{hosts[b]} in"] = out.get(f"h{hosts[b]} in", 0) + n
    return out


def _numel(region: Region) -> int:
    n = 1
    for a, b in region:
        n *= b - a
    return n


def _wait_all(ops: list) -> None:
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


class Planned:
    name = "planned"

    def __init__(self, s: Setup, bucket_mb: float, net: NetworkModel) -> None:
        self.s = s
        self.plan = plan_weight_transfer(s.params, s.source, s.replicas, s.hosts, bucket_mb=bucket_mb, network=net)
        self.exe = TransferExecutor(self.plan)
        self.last: dict[str, Any] = {}

    def nic_bytes(self) -> dict[str, int]:
        item = {b.index: ITEMSIZE[b.dtype] for b in self.plan.buckets}
        return _side_bytes([(m.src, m.dst, (m.stop - m.start) * item[b.index]) for b in self.plan.buckets
                            for m in b.msgs], self.s.hosts)

    def run(self, dests: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.last = self.exe.run(self.s.sources, dests)
        return dests


class PerParam:
    """One rank per source stage (its tp rank 0) gathers each whole parameter from its tp peers (inside the host)
    and sends it to every destination rank that needs any of it, one message each; parameters go in lockstep,
    both stages at once."""

    name = "per_param"

    def __init__(self, s: Setup) -> None:
        self.s = s
        stage_ranks = [(TRAINER[0], TRAINER[1]), (TRAINER[2], TRAINER[3])]
        self.steps: list[list[tuple[str, int, tuple[int, ...], list[int]]]] = []  # per step: (name, sender, peers, dsts)
        per_stage = []
        for ranks in stage_ranks:
            names = [p.name for p in s.params if any(b.name == p.name for r in ranks for b in s.source.get(r, []))]
            per_stage.append([(n, ranks[0], ranks, [d for d in s.dst_ranks if any(
                b.name == n for rep in s.replicas for b in rep.boxes.get(d, []))]) for n in names])
        for k in range(max(len(x) for x in per_stage)):
            self.steps.append([x[k] for x in per_stage if k < len(x)])

    def nic_bytes(self) -> dict[str, int]:
        s = self.s
        return _side_bytes([(sender, d, s.by_name[name].nbytes) for step in self.steps
                            for name, sender, _, dsts in step for d in dsts], s.hosts)

    def run(self, dests: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s, me = self.s, self.s.rank
        for step in self.steps:
            # 1. gather each whole parameter on its stage's sender (tp peers' boxes, inside the host)
            ops, full, parts = [], {}, []
            for name, sender, peers, _ in step:
                whole = tuple((0, n) for n in s.by_name[name].shape)
                if me == sender:
                    full[name] = torch.empty(s.by_name[name].shape)
                    view(full[name], s.src_boxes[name], whole).copy_(s.sources[name])
                    for q in peers:
                        reg = next(b.region for b in s.source[q] if b.name == name)
                        if q != sender and reg != s.src_boxes[name]:
                            buf = torch.empty(tuple(b - a for a, b in reg))
                            ops.append(dist.P2POp(dist.irecv, buf, q))
                            parts.append((name, reg, buf, whole))
                elif me in peers and s.src_boxes[name] != next(b.region for b in s.source[sender] if b.name == name):
                    ops.append(dist.P2POp(dist.isend, s.sources[name].contiguous(), sender))
            _wait_all(ops)
            for name, reg, buf, whole in parts:
                view(full[name], reg, whole).copy_(buf)
            # 2. the whole parameter to every destination rank that needs part of it
            ops, got = [], {}
            for name, sender, _, dsts in step:
                if me == sender:
                    ops += [dist.P2POp(dist.isend, full[name], d) for d in dsts]
                elif me in dsts:
                    got[name] = torch.empty(s.by_name[name].shape)
                    ops.append(dist.P2POp(dist.irecv, got[name], sender))
            _wait_all(ops)
            for name, t in got.items():
                reg = s.dst_boxes[name]
                dests[name].copy_(view(t, reg, tuple((0, n) for n in t.shape)))
        return dests


class RoundRobin:
    """Megatron-Core's refit plan: per destination rank and parameter, the cells of its box against the source
    boxes, each from holder ``holders[destination rank % len(holders)]``; one message per cell, all at once."""

    name = "round_robin"

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.msgs: list[tuple[str, Region, int, int]] = []  # (name, region, src, dst) in one global order
        for p in s.params:
            src = {r: b.region for r, bs in s.source.items() for b in bs if b.name == p.name}
            for d in s.dst_ranks:
                mine = [b.region for rep in s.replicas for b in rep.boxes.get(d, []) if b.name == p.name]
                if not mine:
                    continue
                for sl, holders, _ in cells(p.shape, src, {d: mine[0]}):
                    hs = sorted(holders)
                    self.msgs.append((p.name, tuple((x.start, x.stop) for x in sl), hs[d % len(hs)], d))

    def nic_bytes(self) -> dict[str, int]:
        s = self.s
        return _side_bytes([(a, b, _numel(reg) * s.by_name[n].itemsize) for n, reg, a, b in self.msgs], s.hosts)

    def run(self, dests: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s, me = self.s, self.s.rank
        ops, into = [], []
        for name, reg, src, dst in self.msgs:
            if me == src:
                ops.append(dist.P2POp(dist.isend, view(s.sources[name], reg, s.src_boxes[name]).contiguous(), dst))
            elif me == dst:
                buf = torch.empty(tuple(b - a for a, b in reg))
                ops.append(dist.P2POp(dist.irecv, buf, src))
                into.append((name, reg, buf))
        _wait_all(ops)
        for name, reg, buf in into:
            view(dests[name], reg, s.dst_boxes[name]).copy_(buf)
        return dests


class DCP:
    """A DCP save of the trainer's shards to the trainer hosts' local disk, the files copied to every generator
    host (its first destination rank receives each file, one message per file, all at once), then a DCP load of
    every destination box from its host's copy. ``phases``: the last run's save, copy and load seconds (rank 0,
    between barriers); save + load alone is the round trip where both sides share a disk."""

    name = "dcp"

    def __init__(self, s: Setup, root: str, save_group, load_group) -> None:
        self.s, self.root, self.save_group, self.load_group = s, root, save_group, load_group
        self.n = 0
        self.phases: dict[str, float] = {}
        self.copied: list[tuple[int, int, int]] = []  # (from, to, bytes) of the last copy
        self.host_head = {}
        for r in s.dst_ranks:
            self.host_head.setdefault(s.hosts[r], r)

    def _boxes(self, regions: dict[str, Region]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        return {f"model.{n}": (self.s.by_name[n].shape, tuple(a for a, _ in reg)) for n, reg in regions.items()}

    def nic_bytes(self) -> dict[str, int]:
        return _side_bytes(self.copied, self.s.hosts)

    def _copy(self, src_dir: str, dst_dir: str) -> None:
        """Every file of ``src_dir`` from the trainer rank that wrote it to each generator host's head rank."""
        me = self.s.rank
        listing = [sorted((f, os.path.getsize(os.path.join(src_dir, f))) for f in os.listdir(src_dir))
                   if me == TRAINER[0] else None]
        dist.broadcast_object_list(listing, TRAINER[0])
        ops, into = [], []
        self.copied = []
        for f, size in listing[0]:
            owner = TRAINER[int(f[2:].split("_")[0])] if f.startswith("__") else TRAINER[0]
            for h, head in sorted(self.host_head.items()):
                self.copied.append((owner, head, size))
                if me == owner:
                    with open(os.path.join(src_dir, f), "rb") as fh:
                        data = torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8)
                    ops.append(dist.P2POp(dist.isend, data, head))
                elif me == head:
                    buf = torch.empty(size, dtype=torch.uint8)
                    ops.append(dist.P2POp(dist.irecv, buf, owner))
                    into.append((f, buf))
        _wait_all(ops)
        if into:
            os.makedirs(dst_dir, exist_ok=True)
            for f, buf in into:
                with open(os.path.join(dst_dir, f), "wb") as fh:
                    fh.write(buf.numpy().tobytes())

    def run(self, dests: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from megareshard.checkpoint.dcp_io import load_pieces, save_pieces

        s, me = self.s, self.s.rank
        self.n += 1
        path = os.path.join(self.root, f"step{self.n}")
        t0 = time.perf_counter()
        if me in s.source:
            save_pieces({f"model.{n}": t for n, t in s.sources.items()}, os.path.join(path, "trainer"),
                        self._boxes(s.src_boxes), process_group=self.save_group, no_dist=False)
        dist.barrier()
        t1 = time.perf_counter()
        host_dir = os.path.join(path, f"host{s.hosts[me]}")
        self._copy(os.path.join(path, "trainer"), host_dir)
        dist.barrier()
        t2 = time.perf_counter()
        if s.dst_boxes:
            load_pieces({f"model.{n}": t for n, t in dests.items()}, host_dir, self._boxes(s.dst_boxes),
                        process_group=self.load_group, no_dist=False)
        dist.barrier()
        self.phases = {"save_s": t1 - t0, "copy_s": t2 - t1, "load_s": time.perf_counter() - t2}
        if me == 0:
            shutil.rmtree(path, ignore_errors=True)
        return dests


# ------------------------------------------------------------------------------------------------ measuring
class NicSampler:
    """A thread reading this host's eth0 byte counters every ``period`` seconds (first rank of a host only)."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        base = "/sys/class/net/eth0/statistics"
        self.paths = (f"{base}/tx_bytes", f"{base}/rx_bytes")
        self.ok = all(os.path.exists(p) for p in self.paths)
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def counters(self) -> tuple[int, int]:
        out = []
        for p in self.paths:
            with open(p) as f:
                out.append(int(f.read()))
        return out[0], out[1]

    def start(self) -> None:
        if not self.ok:
            return
        self.samples, self._stop = [], threading.Event()

        def loop():
            while not self._stop.is_set():
                self.samples.append((time.time(), *self.counters()))
                time.sleep(self.period)
            self.samples.append((time.time(), *self.counters()))

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()

    def stop(self) -> list[tuple[float, int, int]]:
        if self._t is not None:
            self._stop.set()
            self._t.join()
        return self.samples


def relative(samples: list[tuple[float, int, int]], t0: float) -> list[list[float]]:
    """Samples as [seconds since ``t0``, bytes sent, bytes received since the first sample]."""
    if not samples:
        return []
    _, tx0, rx0 = samples[0]
    return [[round(t - t0, 4), tx - tx0, rx - rx0] for t, tx, rx in samples]


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def calibrate(mb: int, hosts: dict[int, int], P: int) -> float:
    """Goodput in Gbit/s of one message from rank 0 (host 0) to rank P (host 1), after a small warm-up."""
    me = dist.get_rank()
    n = mb * 2**20 // 4
    buf = torch.zeros(n)
    res = []
    for size in (n // 16, n):
        dist.barrier()
        t0 = time.perf_counter()
        if me == 0:
            dist.send(buf[:size], P)
        elif me == P:
            dist.recv(buf[:size], 0)
        dist.barrier()
        res.append(size * 4 * 8 / (time.perf_counter() - t0) / 1e9)
    out = torch.tensor([res[-1]], dtype=torch.float64)
    dist.broadcast(out, 0)
    return float(out.item())


def dest_floor_bytes(s: Setup) -> dict[int, int]:
    """Per destination host: the bytes of distinct global cells its ranks need that no rank on it holds — what
    must cross its NIC at least once."""
    out: dict[int, int] = {}
    for p in s.params:
        src = {r: b.region for r, bs in s.source.items() for b in bs if b.name == p.name}
        dst = {r: b.region for rep in s.replicas for r, bs in rep.boxes.items() for b in bs if b.name == p.name}
        for sl, holders, needers in cells(p.shape, src, dst):
            n = p.itemsize
            for x in sl:
                n *= x.stop - x.start
            for h in {s.hosts[r] for r in needers} - {s.hosts[r] for r in holders}:
                out[h] = out.get(h, 0) + n
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--shapes", default="A,B")
    ap.add_argument("--methods", default="planned,per_param,round_robin,dcp")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="the planned transfer's staging bound")
    ap.add_argument("--nic-gbps", type=float, default=1.0, help="the NIC rate the emulator was given (reported)")
    ap.add_argument("--calibrate-mb", type=int, default=64)
    ap.add_argument("--ranks-per-host", type=int, default=None,
                    help="host labels for a plain torchrun (default: LOCAL_WORLD_SIZE, torchrun's node layout)")
    ap.add_argument("--out", default=None, help="JSON to write (rank 0)")
    a = ap.parse_args(argv)
    dist.init_process_group("gloo")
    me, world = dist.get_rank(), dist.get_world_size()
    P = a.ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", "3"))
    if world != 12 or P != 3:
        raise SystemExit(f"bench_weight_transfer needs 4 hosts × 3 ranks (12), got {world} ranks, {P} per host")
    hosts = {r: r // P for r in range(world)}
    obj = [model_params(a) if me == 0 else None]
    dist.broadcast_object_list(obj, 0)
    params: list[ParamInfo] = obj[0]
    cfg = model_config(a)
    source = layout_boxes(params, list(TRAINER), tp=2, pp=2, divisible_by=cfg.make_vocab_size_divisible_by,
                          num_layers=cfg.num_layers, tied=False)
    gbps = calibrate(a.calibrate_mb, hosts, P)
    net = NetworkModel(gbps)
    sampler = NicSampler() if me % P == 0 else None
    root = None
    if me == 0:
        root = tempfile.mkdtemp(prefix="mr-bench-wt-")
    obj = [root]
    dist.broadcast_object_list(obj, 0)
    root = obj[0]
    save_group = dist.new_group(list(TRAINER))
    load_groups = {sh: dist.new_group(sorted(r for _, rs, _ in SHAPES[sh] for r in rs)) for sh in SHAPES}
    total = sum(p.nbytes for p in params)
    doc: dict[str, Any] = {"model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "vocab": a.vocab,
                                     "tensors": len(params), "bytes": total, "dtype": "float32"},
                           "nic_gbps_nominal": a.nic_gbps, "nic_gbps_measured": gbps, "bucket_mb": a.bucket_mb,
                           "repeat": a.repeat, "trainer": {"ranks": list(TRAINER), "tp": 2, "pp": 2},
                           "hosts": {str(r): h for r, h in hosts.items()}, "shapes": {}}
    if me == 0:
        print(f"# model {len(params)} tensors, {total / 2**20:.1f} MiB fp32; NIC goodput {gbps:.3f} Gbit/s "
              f"(nominal {a.nic_gbps:g})", flush=True)
    try:
        for sh in a.shapes.split(","):
            reps = [Replica(n, destination_boxes(Destination(n, rs, tp=tp), params, cfg)) for n, rs, tp in SHAPES[sh]]
            s = Setup(params, source, reps, hosts, me)
            floor = dest_floor_bytes(s)
            entry: dict[str, Any] = {"replicas": [{"name": n, "ranks": list(rs), "tp": tp} for n, rs, tp in SHAPES[sh]],
                                     "dest_floor_bytes": {str(h): b for h, b in floor.items()},
                                     "floor_s": max(floor.values()) * 8 / (gbps * 1e9), "methods": {}}
            for mname in a.methods.split(","):
                if mname == "planned":
                    m = Planned(s, a.bucket_mb, net)
                    entry["plan"] = {"bound_s": m.plan.lower_bound_s(), "wire_bytes": m.plan.wire_bytes,
                                     "delivered_bytes": m.plan.delivered_bytes, "buckets": len(m.plan.buckets),
                                     "waves": m.plan.num_waves, "steps": m.plan.num_steps,
                                     "staging_bytes_max": max(m.plan.staging_bytes().values()),
                                     "describe": m.plan.describe()}
                elif mname == "per_param":
                    m = PerParam(s)
                elif mname == "round_robin":
                    m = RoundRobin(s)
                elif mname == "dcp":
                    m = DCP(s, root, save_group, load_groups[sh])
                else:
                    raise SystemExit(f"unknown method {mname}")
                box: dict[str, Any] = {}
                bad = torch.tensor([s.check(m.run(s.fresh_dests()))])
                dist.all_reduce(bad)
                times, phases = [], []
                for _ in range(a.repeat):
                    dests = s.fresh_dests()  # allocated and filled outside the timed region
                    times.append(timed(lambda: m.run(dests)))
                    phases.append(dict(getattr(m, "phases", {})))
                dests = s.fresh_dests()
                if sampler is not None:
                    sampler.start()
                t_start = time.time()
                traced = timed(lambda: m.run(dests))
                samples = sampler.stop() if sampler is not None else []
                got: list[Any] = [None] * world
                dist.all_gather_object(got, (hosts[me], samples) if sampler is not None else None)
                nic = m.nic_bytes()
                box.update(nic_bytes=nic, bound_s=max(nic.values(), default=0) * 8 / (gbps * 1e9))
                box.update(seconds=statistics.median(times), repeats=times, wrong_elements=int(bad.item()),
                           traced_s=traced, nic_samples={str(h): relative(smp, t_start) for x in got if x
                                                         for h, smp in [x]})
                if mname == "dcp":
                    box["phases"] = phases
                    box["save_load_s"] = statistics.median(p["save_s"] + p["load_s"] for p in phases)
                if mname == "planned":
                    peak = torch.tensor([m.last.get("rank_staging_bytes", 0)])
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                    box["staging_bytes_peak"] = int(peak.item())
                entry["methods"][mname] = box
                if me == 0:
                    print(f"shape {sh} {mname:12s} {box['seconds']:.3f} s (repeats "
                          f"{', '.join(f'{t:.3f}' for t in times)}), wrong elements {box['wrong_elements']}",
                          flush=True)
            doc["shapes"][sh] = entry
            if me == 0:
                print(entry.get("plan", {}).get("describe", ""), flush=True)
    finally:
        dist.barrier()
        if me == 0:
            shutil.rmtree(root, ignore_errors=True)
    if me == 0:
        summarize(doc)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(dump(doc))
            print(f"wrote {a.out}")
    dist.destroy_process_group()
    return 0


def dump(doc: dict[str, Any]) -> str:
    """The JSON text: indented, except each host's NIC samples, one line apiece (thousands of triples)."""
    lines: list[str] = []
    copy = json.loads(json.dumps(doc))
    for e in copy["shapes"].values():
        for box in e["methods"].values():
            for h, smp in box.get("nic_samples", {}).items():
                lines.append(json.dumps(smp, separators=(",", ":")))
                box["nic_samples"][h] = f"@@{len(lines) - 1}@@"
    text = json.dumps(copy, indent=1)
    for i, line in enumerate(lines):
        text = text.replace(f'"@@{i}@@"', line, 1)
    return text + "\n"


def summarize(doc: dict[str, Any]) -> None:
    from lab.bench.transfer_report import verdicts

    for v in verdicts(doc):
        print(f"shape {v['shape']}: {v['target']} {v['value']:.2f} (limit {v['limit']:g}): "
              f"{'holds' if v['met'] else 'MISSED'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
