"""Calibration: measure the machines at hand and describe them as a cluster JSON the planner reads.

What is measured (`tools/calibrate_cluster.py` runs it under torchrun, the emulated cluster included):

* **device FLOP/s**: a matmul of the model's own sizes (``b·s × h`` by ``h × f``, the MLP's first
  GEMM): its median CPU time stretched by the **load** — wall over CPU time while every rank repeats it
  for a common window (`measure_load`) — → ``device_tflops``;
* **per-layer forward and backward** of one Transformer layer of the model at its shape (our
  GPT layer, one process) → ``efficiency`` = the layer's achieved FLOP/s over the matmul's, and
  ``backward_factor`` = backward / forward, both from CPU times (the matmul's too), which the
  scheduler's preemptions do not stretch; the load enters once, through `measure_load`. The layer
  is timed at the micro batch, at twice and at four times it: the forward's fixed part of a line fitted
  to the three (least squares) is ``layer_overhead_s`` (launches, Python), and ``efficiency`` is the
  rate of the part that grows. The
  backward is also run split as delayed weight gradients run it (I, then the queued W): W's share of the
  CPU time → ``wgrad_fraction``;
* **the optimizer step**: the trainer's AdamW step over ~1 Mi fp32 parameters shaped as the model's layers →
  ``optimizer_s_per_param``, and its passes over the gradients around the reduction (non-finite check, bucket
  packing, norm) → ``grad_pass_s_per_param``;
* **intra-host bandwidth**: send/recv between two ranks of one host, and **NIC bandwidth**:
  between rank 0 of host 0 and rank 0 of host 1 (gloo; messages sized so a transfer takes about
  `target_s`), each direction reported as Gbit/s;
* **latencies**: the round trip of a one-element message between the same pairs (half of it →
  ``intra_latency_s``, ``nic_latency_s``), a one-element all-reduce over ranks 0 and 1 of host 0
  (less its two ring steps' ``intra_latency_s`` → ``collective_latency_s``; with one rank per host, over
  ranks 0 and 1 less two ``nic_latency_s``), a ring all-reduce over one rank per host (more than two
  hosts) against the ring model at the measured NIC rate → ``ring_efficiency``, and the per-action
  overhead: half the time of a forward + backward of a one-element autograd step → ``action_overhead_s``;
* **a tp all-reduce under load**: every rank busy at once, tp-2 pairs inside each host alternating a
  compute chunk (a quarter of the layer's forward) with an all-reduce of one microbatch's activation,
  against the chunks alone; the difference, less the ring steps' latency and the bytes at the measured
  intra-host rate, raises ``collective_latency_s`` when larger. On an oversubscribed machine (the
  emulated cluster: 8 ranks on 2 cores) it is the wait for the partner to be scheduled, which the
  idle two-rank all-reduce misses. With one rank per host the pairs are neighbouring hosts, across
  the NIC (at its measured rate and latency).

What a real cluster does not have is not measured here: the lab calibrates its emulated cluster (hosts that
share one machine's cores, compute paced with sleeps) around `calibrate` (``lab/cluster/calibrate_emulated.py``).

Compute times (matmul, layer, optimizer, action) are measured by every rank at once and the median over
ranks is kept.

Every rank issues the same point-to-point operations in the same order (NCCL's rules); ranks not in
a pair wait at a barrier. The JSON (`CLUSTER_FORMAT`) holds `ClusterSpec`'s fields plus
``measured`` (the raw timings); `load_cluster` reads it back, the launch's host and device counts
replacing the measured machine's.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any

from .cluster_file import CLUSTER_FORMAT, cluster_to_json, load_cluster
from .costs import ClusterSpec, ModelShape, layer_flops

__all__ = ["CLUSTER_FORMAT", "load_cluster", "cluster_to_json", "measure_matmul", "measure_layer",
           "measure_optimizer", "measure_load", "measure_p2p", "measure_latency", "measure_small_allreduce",
           "measure_action_overhead", "measure_ring_allreduce", "measure_loaded_collective", "rank_median",
           "fit_fixed_and_scaling", "calibrate"]

def _median_time(fn, iters: int, warmup: int = 1, clock=time.perf_counter) -> float:
    """Median seconds of `fn` on `clock`: wall time, or ``time.thread_time`` for CPU time, which the scheduler's
    preemptions do not lengthen."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def measure_matmul(rows: int, inner: int, cols: int, dtype: str = "float32", iters: int = 5) -> dict[str, float]:
    """FLOP/s of a ``rows × inner`` by ``inner × cols`` matmul (median of `iters` wall times), and its CPU time."""
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(rows, inner, dtype=dt), torch.randn(inner, cols, dtype=dt)
    s = _median_time(lambda: a @ b, iters)
    cpu = _median_time(lambda: a @ b, iters, clock=time.thread_time)
    return {"rows": rows, "inner": inner, "cols": cols, "seconds": s, "flops": 2.0 * rows * inner * cols / s,
            "cpu_seconds": cpu}


def measure_load(rows: int, inner: int, cols: int, window_s: float = 0.3) -> dict[str, float]:
    """How much slower than its CPU time compute runs when every rank computes at once: after a barrier (when a
    process group exists) every rank repeats the matmul for `window_s` of wall time, long against the
    scheduler's time slices, so the ranks overlap for the whole window (a few short matmuls per rank, started
    when each rank gets there, mostly do not: their wall/CPU ratio swung 1.1–2.5 between runs of the same
    8 ranks on 2 cores). Returns wall and CPU seconds of the window and their ratio, ``load``."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    a @ b
    if dist.is_initialized():
        dist.barrier()
    t0, c0, n = time.perf_counter(), time.thread_time(), 0
    while time.perf_counter() - t0 < window_s:
        a @ b
        n += 1
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {"window_s": wall, "cpu_s": cpu, "matmuls": n, "load": wall / max(cpu, 1e-12)}


def measure_layer(model: ModelShape, micro_batch: int, iters: int = 3) -> dict[str, float]:
    """Forward and backward seconds of one Transformer layer of `model` (our GPT layer, one process, fp32)."""
    import torch

    from ..models.config import ModelConfig
    from ..models.gpt import GPTModel
    from ..parallel import ParallelContext
    from ..tensor_parallel.layers import WeightGradStore

    cfg = ModelConfig(num_layers=1, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                      ffn_hidden_size=model.ffn_hidden_size, seq_length=model.seq_length, vocab_size=model.vocab_size,
                      hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(cfg, ParallelContext.single_process(), seed=1, device=torch.device("cpu"))
    layer = next(iter(gpt.layers.children()))
    x = torch.randn(model.seq_length, micro_batch, model.hidden_size, requires_grad=True)
    grad = torch.randn(model.seq_length, micro_batch, model.hidden_size)
    fwd, bwd, fwd_cpu, bwd_cpu = [], [], [], []
    for i in range(iters + 1):  # the first is a warm-up
        t0, c0 = time.perf_counter(), time.thread_time()
        y = layer(x)
        t1, c1 = time.perf_counter(), time.thread_time()
        y.backward(grad)
        t2, c2 = time.perf_counter(), time.thread_time()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            fwd_cpu.append(c1 - c0)
            bwd_cpu.append(c2 - c1)
    # the same backward split as the pipeline's delayed weight gradients run it: I (input gradient; the weight
    # gradients queued) then W (the queue flushed)
    store = WeightGradStore()
    gpt.set_wgrad_store(store)
    i_cpu, w_cpu = [], []
    for i in range(iters + 1):
        y = layer(x)
        c0 = time.thread_time()
        y.backward(grad)
        c1 = time.thread_time()
        store.flush()
        c2 = time.thread_time()
        if i:
            i_cpu.append(c1 - c0)
            w_cpu.append(c2 - c1)
    gpt.set_wgrad_store(None)
    return {"micro_batch": micro_batch, "forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
            "forward_cpu_s": statistics.median(fwd_cpu), "backward_cpu_s": statistics.median(bwd_cpu),
            "input_grad_cpu_s": statistics.median(i_cpu), "weight_grad_cpu_s": statistics.median(w_cpu)}


def measure_optimizer(hidden_size: int = 128, params: int = 1 << 20, iters: int = 3) -> dict[str, float]:
    """Seconds per parameter of the trainer's per-step passes over the gradients, on Transformer layers of
    `hidden_size` (at least `params` parameters in all) — the trainer's own optimizer (`ZeroOptimizer`,
    ZeRO 0, one rank), not a stand-in:

    * ``seconds_per_param``: the AdamW step (and the copy of the master weights into the model's);
    * ``grad_pass_s_per_param``: the passes around the data-parallel reduction — the non-finite check
      (``--check-for-nan-in-loss-and-grad``), packing the gradients into buckets and back, the gradient norm.
    """
    import torch

    from ..optim.numerics import grad_norms
    from ..optim.zero import ZeroOptimizer
    from ..parallel import ParallelContext

    h = hidden_size
    shapes = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,), (h,), (h,)]
    per_layer = sum(math.prod(x) for x in shapes)
    named = [(f"layers.{i}.p{k}", torch.nn.Parameter(torch.randn(*x) * 0.02))
             for i in range(max(1, -(-params // per_layer))) for k, x in enumerate(shapes)]
    grads = {n: torch.randn_like(p) * 1e-3 for n, p in named}
    opt = ZeroOptimizer(named, ParallelContext.single_process(), stage=0, lr=1e-4)

    def passes() -> None:
        grad_norms(named)
        opt.finish_grad_sync()
        opt.clip_grads(1.0).item()

    pass_s, step_s, cpu_s = [], [], []
    for _ in range(iters + 1):  # the first builds the optimizer's state
        opt.zero_grad()
        for n, p in named:
            p.grad = grads[n].clone()
        t0, c0 = time.perf_counter(), time.process_time()
        passes()
        t1 = time.perf_counter()
        opt.step()
        pass_s.append(t1 - t0)
        step_s.append(time.perf_counter() - t1)
        cpu_s.append(time.process_time() - c0)
    n = sum(p.numel() for _, p in named)
    s, g, c = statistics.median(step_s[1:]), statistics.median(pass_s[1:]), statistics.median(cpu_s[1:])
    return {"params": n, "seconds": s, "seconds_per_param": s / n, "grad_pass_s": g, "grad_pass_s_per_param": g / n,
            "cpu_s": c, "cpu_s_per_param": c / n}


def measure_p2p(src: int, dst: int, target_s: float = 0.3, max_bytes: int = 64 << 20,
                iters: int = 3) -> dict[str, float] | None:
    """Bytes per second from rank `src` to rank `dst` (gloo send/recv, median of `iters`); every rank calls it
    (those not in the pair only wait at the barriers). A 256 KiB probe sizes the message to take ~`target_s`."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    out: list[float] = []

    def once(n: int) -> float:
        buf = torch.empty(n // 4, dtype=torch.float32)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == src:
            dist.send(buf, dst)
            dist.recv(buf[:1], dst)  # the receiver's acknowledgement closes the timing
        elif rank == dst:
            dist.recv(buf, src)
            dist.send(buf[:1], src)
        t = time.perf_counter() - t0
        box = torch.tensor([t if rank == src else 0.0], dtype=torch.float64)
        dist.all_reduce(box)
        return float(box.item())

    probe = 256 << 10
    t = once(probe)
    n = int(min(max_bytes, max(probe, probe * target_s / max(t, 1e-6))))
    n -= n % 4
    for _ in range(iters):
        out.append(once(n))
    s = statistics.median(out)
    return {"src": src, "dst": dst, "bytes": n, "seconds": s, "Bps": n / s}


def measure_action_overhead(iters: int = 50) -> dict[str, float]:
    """Seconds of one compute action's fixed cost: half a forward + backward of a one-element autograd step
    (a linear layer, its loss and its gradients: the Python and autograd work no FLOPs hide)."""
    import torch

    lin = torch.nn.Linear(1, 1)
    x = torch.ones(1, 1, requires_grad=True)

    def step() -> None:
        lin(x).sum().backward()

    s = _median_time(step, iters, warmup=3)
    return {"forward_backward_s": s, "seconds": s / 2}


def measure_latency(src: int, dst: int, iters: int = 20) -> dict[str, float]:
    """One-way seconds of a one-element message from rank `src` to `dst`: half the median round trip (gloo
    send/recv); every rank calls it (those not in the pair only wait at the barriers)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.zeros(1)
    out = []
    for i in range(iters + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        if rank == src:
            dist.send(buf, dst)
            dist.recv(buf, dst)
        elif rank == dst:
            dist.recv(buf, src)
            dist.send(buf, src)
        box = torch.tensor([time.perf_counter() - t0 if rank == src else 0.0], dtype=torch.float64)
        dist.all_reduce(box)
        if i:
            out.append(float(box.item()))
    rtt = statistics.median(out)
    return {"src": src, "dst": dst, "round_trip_s": rtt, "seconds": rtt / 2}


def measure_ring_allreduce(ranks: list[int], link_Bps: float, target_s: float = 0.3, iters: int = 3
                           ) -> dict[str, float]:
    """A ring all-reduce over `ranks` (one per host), sized so that at `link_Bps` per ring edge it would take
    about `target_s`; ``efficiency`` = that ring model's time over the measured median (at most 1). Every
    rank calls it."""
    import torch

    n = len(ranks)
    per_edge = max(1 << 16, int(target_s * link_Bps))  # the bytes each ring edge carries: 2·(n−1)/n of the buffer
    nbytes = int(per_edge * n / (2 * (n - 1))) // 4 * 4
    seconds = _timed_allreduce(torch.zeros(nbytes // 4), ranks, iters)
    model = 2 * (n - 1) / n * nbytes / link_Bps
    return {"ranks": list(ranks), "bytes": nbytes, "seconds": seconds, "model_s": model,
            "efficiency": min(1.0, model / seconds)}


def measure_small_allreduce(ranks: list[int], iters: int = 20) -> dict[str, float]:
    """Seconds of a one-element all-reduce over `ranks` (median); every rank calls it."""
    import torch

    return {"ranks": list(ranks), "seconds": _timed_allreduce(torch.zeros(1), ranks, iters)}


def _timed_allreduce(buf, ranks: list[int], iters: int) -> float:
    """Median seconds, on ``ranks[0]``, of an all-reduce of `buf` over `ranks` after a barrier (one warm-up);
    every rank of the default group calls it (the others wait) and gets the same number."""
    import torch
    import torch.distributed as dist

    group = dist.new_group(ranks)
    rank = dist.get_rank()
    out = []
    for i in range(iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank in ranks:
            dist.all_reduce(buf, group=group)
        box = torch.tensor([time.perf_counter() - t0 if rank == ranks[0] else 0.0], dtype=torch.float64)
        dist.all_reduce(box)
        if i:
            out.append(float(box.item()))
    return statistics.median(out)


def rank_median(value: float) -> float:
    """The median over every rank of a time each rank measured at once (rank 0's alone swings several-fold on an
    oversubscribed machine); every rank calls it. Without a process group: the value."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    box[dist.get_rank()] = value
    dist.all_reduce(box)
    return statistics.median(box.tolist())


def measure_loaded_collective(model: ModelShape, micro_batch: int, devices_per_host: int, chunk_s: float,
                              reps: int = 20, rounds: int = 5) -> dict[str, Any]:
    """What one tensor-parallel all-reduce costs inside a busy layer, with every rank busy at once (the load of a
    real run): ranks form tp-2 pairs inside each host (with one rank per host: neighbouring hosts, across the
    NIC); each runs `reps` times a compute chunk of about `chunk_s`
    (a matmul of the model's MLP shard) followed by an all-reduce of one microbatch's activation over its pair,
    then the same chunks alone, `rounds` times alternated. The difference per rep (median over rounds, then over
    ranks) is the all-reduce's cost under load:
    on an oversubscribed CPU it includes waiting for the partner to be scheduled, which an idle two-rank
    measurement misses. Every rank calls it."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if devices_per_host > 1:  # tp pairs inside each host
        pairs = [[h + 2 * k, h + 2 * k + 1] for h in range(0, world, devices_per_host)
                 for k in range(devices_per_host // 2)]
    else:  # one rank per host: neighbouring hosts pair up across their NICs (a dp ring's or a step's collectives)
        pairs = [[r, r + 1] for r in range(0, world - 1, 2)]
    groups = [dist.new_group(pr) for pr in pairs]  # every rank creates every group, in one order
    mine = next((g for g, pr in zip(groups, pairs) if rank in pr), None)
    rows, h = model.seq_length * micro_batch, model.hidden_size
    a, w = torch.randn(rows, h), torch.randn(h, max(1, model.ffn // 2))
    one = _median_time(lambda: a @ w, 5)
    inner = max(1, round(chunk_s / max(one, 1e-9)))
    act = torch.randn(rows, h)

    def phase(with_allreduce: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            for _ in range(inner):
                a @ w
            if with_allreduce and mine is not None:
                dist.all_reduce(act, group=mine)
        return (time.perf_counter() - t0) / reps

    phase(True)  # warm-up: the groups' first operations connect
    pairs_of_phases = [(phase(True), phase(False)) for _ in range(rounds)]  # alternated: drifts hit both alike
    with_ar = statistics.median(w for w, _ in pairs_of_phases)
    alone = statistics.median(a for _, a in pairs_of_phases)
    extra = statistics.median(w - a for w, a in pairs_of_phases)
    return {"pairs": pairs, "bytes": act.numel() * 4, "chunk_s": inner * one, "rounds": rounds,
            "with_allreduce_s": rank_median(with_ar), "alone_s": rank_median(alone),
            "seconds": max(0.0, rank_median(extra))}


def fit_fixed_and_scaling(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, per-unit) seconds of a time that grows linearly with the micro batch, least squares through
    `points` [(micro batch in units of the calibrated one, seconds)]: the fixed part clamped to at least 0 (then
    the line through the origin) and the per-unit part to at least a thousandth of the first point's time."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    fixed = my - slope * mx
    if fixed < 0:
        fixed, slope = 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    floor = 1e-3 * points[0][1]
    if slope < floor:
        slope = floor
        fixed = max(0.0, my - slope * mx)
    return fixed, slope


def calibrate(model: ModelShape, micro_batch: int, devices_per_host: int, device_memory_gib: float,
              iters: int = 3, target_s: float = 0.3) -> tuple[ClusterSpec, dict[str, Any]]:
    """Run every measurement (a collective call: every rank of the default process group) and return the
    cluster (this launch's hosts × devices) and the raw measurements."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    hosts = world // devices_per_host
    h, f, rows = model.hidden_size, model.ffn, model.seq_length * micro_batch
    # every rank measures at once (the load the runs will see); the median over ranks is kept
    mm = measure_matmul(rows, h, f, iters=iters)
    mm["cpu_seconds"] = rank_median(mm["cpu_seconds"])
    loaded = measure_load(rows, h, f)
    loaded["load"] = rank_median(loaded["load"])
    # the matmul's time when every rank computes at once: its CPU time stretched by the measured load
    mm["idle_seconds"], mm["seconds"] = rank_median(mm["seconds"]), mm["cpu_seconds"] * loaded["load"]
    mm["flops"] = 2.0 * rows * h * f / mm["seconds"]
    keys = ("forward_s", "backward_s", "forward_cpu_s", "backward_cpu_s", "input_grad_cpu_s", "weight_grad_cpu_s")
    layer = measure_layer(model, micro_batch, iters=3 * iters)
    layer = layer | {k: rank_median(layer[k]) for k in keys}
    double = measure_layer(model, 2 * micro_batch, iters=3 * iters)  # twice the samples: what scales, what not
    double = {k: rank_median(double[k]) for k in keys}
    quadruple = measure_layer(model, 4 * micro_batch, iters=3 * iters)  # the largest micro batch the search tries
    quadruple = {k: rank_median(quadruple[k]) for k in keys}
    # forward CPU time = fixed + per-sample part, fitted to the three micro batches (a difference of two small
    # timings swung the per-sample part 1.0-2.1× between calibrations of one model, and four times the micro
    # batch extrapolated from it measured 0.85× its prediction)
    fixed_cpu, scaling_cpu = fit_fixed_and_scaling([(1, layer["forward_cpu_s"]), (2, double["forward_cpu_s"]),
                                                    (4, quadruple["forward_cpu_s"])])
    layer |= {"double_micro_batch": double, "quadruple_micro_batch": quadruple,
              "scaling_forward_cpu_s": scaling_cpu, "fixed_forward_cpu_s": fixed_cpu}
    # the layer's ratios (to the matmul, backward to forward) come from CPU times, which preemption does not
    # stretch: wall times of a ~10 ms layer among 8 ranks on 2 cores swing 2× between runs; the load itself
    # enters once, measured over a window every rank computes through
    load = loaded["load"]
    layer["under_load_forward_s"] = layer["forward_cpu_s"] * load
    optim = measure_optimizer(model.hidden_size, iters=iters)
    optim = optim | {k: rank_median(optim[k]) for k in ("seconds", "seconds_per_param", "grad_pass_s",
                                                         "grad_pass_s_per_param", "cpu_s", "cpu_s_per_param")}
    flops = layer_flops(model, micro_batch)
    achieved = flops / (layer["scaling_forward_cpu_s"] * load)  # the FLOP rate of the part that scales
    measured: dict[str, Any] = {"matmul": mm, "load": loaded,
                                "layer": layer | {"flops": flops, "achieved_flops": achieved},
                                "optimizer": optim,
                                "world": world, "devices_per_host": devices_per_host}
    action = measure_action_overhead()
    action = action | {k: rank_median(action[k]) for k in ("forward_backward_s", "seconds")}
    measured["action_overhead"] = action
    intra = nic = intra_lat = nic_lat = allreduce = loaded = ring = None
    if dist.is_initialized():
        if devices_per_host > 1:
            intra = measure_p2p(0, 1, target_s, iters=iters)
            measured["intra"] = intra
            intra_lat = measured["intra_latency"] = measure_latency(0, 1)
            allreduce = measured["small_allreduce"] = measure_small_allreduce([0, 1])
            # a tp layer has two all-reduces per forward, each after about a quarter of the layer's tp-1 forward
            loaded = measured["loaded_allreduce"] = measure_loaded_collective(
                model, micro_batch, devices_per_host, chunk_s=layer["under_load_forward_s"] / 4)
        if hosts > 1:
            nic = measure_p2p(0, devices_per_host, target_s, iters=iters)
            measured["nic"] = nic
            nic_lat = measured["nic_latency"] = measure_latency(0, devices_per_host)
            if devices_per_host == 1:  # no two ranks share a host: the collective's fixed cost across a NIC
                allreduce = measured["small_allreduce"] = measure_small_allreduce([0, 1])
                loaded = measured["loaded_allreduce"] = measure_loaded_collective(
                    model, micro_batch, devices_per_host, chunk_s=layer["under_load_forward_s"] / 4)
            if hosts > 2 and nic:  # a dp ring over every host: how much of the NIC rate its steps keep
                ring = measured["ring_allreduce"] = measure_ring_allreduce(
                    list(range(0, world, devices_per_host)), nic["Bps"], target_s, iters=iters)
    defaults = ClusterSpec(1, 1)
    intra_alpha = intra_lat["seconds"] if intra_lat else defaults.intra_latency_s
    collective = defaults.collective_latency_s
    # the pairs of those all-reduces sit inside a host, or (one rank per host) across a NIC
    link, alpha = (intra, intra_alpha) if devices_per_host > 1 else (nic, nic_lat["seconds"] if nic_lat else 0.0)
    if allreduce:  # a 2-rank all-reduce is 2 ring steps of the link's latency plus its own fixed cost
        collective = max(0.0, allreduce["seconds"] - 2 * alpha)
    if loaded and link:  # under load: what is left after the ring steps' latency and the bytes at the link's rate
        wire = loaded["bytes"] / link["Bps"]  # 2·(n−1)/n = 1 for a pair
        loaded["fixed_s"] = max(0.0, loaded["seconds"] - 2 * alpha - wire)
        collective = max(collective, loaded["fixed_s"])
    cluster = ClusterSpec(
        hosts=max(1, hosts), devices_per_host=devices_per_host, device_memory_gib=device_memory_gib,
        # the device's rate is at least what anything reached: the layer's scaling part can beat a small matmul
        device_tflops=max(mm["flops"], achieved) / 1e12, efficiency=achieved / max(mm["flops"], achieved),
        nic_gbps=nic["Bps"] * 8 / 1e9 if nic else defaults.nic_gbps,
        intra_gbps=intra["Bps"] * 8 / 1e9 if intra else defaults.intra_gbps,
        backward_factor=layer["backward_cpu_s"] / layer["forward_cpu_s"],
        wgrad_fraction=layer["weight_grad_cpu_s"] / max(layer["input_grad_cpu_s"] + layer["weight_grad_cpu_s"], 1e-12),
        optimizer_s_per_param=optim["seconds_per_param"], grad_pass_s_per_param=optim["grad_pass_s_per_param"],
        intra_latency_s=intra_alpha,
        nic_latency_s=nic_lat["seconds"] if nic_lat else defaults.nic_latency_s,
        collective_latency_s=collective,
        action_overhead_s=action["seconds"],
        layer_overhead_s=layer["fixed_forward_cpu_s"] * load,
        ring_efficiency=ring["efficiency"] if ring else defaults.ring_efficiency)
    measured["not_measured"] = [k for k, v in (("nic_gbps", nic), ("intra_gbps", intra), ("nic_latency_s", nic_lat),
                                               ("intra_latency_s", intra_lat), ("collective_latency_s", allreduce))
                                if v is None]
    return cluster, measured
