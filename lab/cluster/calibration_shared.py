"""Calibration of what an emulated cluster adds to a real one: the cores its hosts share (`SharedCores`) and how
late a paced action's sleep ends (`measure_sleep_overshoot`); `calibrate_emulated.py` runs them after the
product's calibration.

Collective calls: every rank of the default process group calls them in the same order. Where the ranks
run on more than one kernel (a real cluster: the hosts' boot ids differ) nothing is measured and the
cluster has no shared cores. Otherwise (network namespaces on one machine, or one host) the
machine's busy time is read from ``/proc/stat`` — every process and the kernel, which moves the emulated
NICs' packets — around three patterns, each after a barrier and timed to the next one:

* every rank idle (a sleep): what the machine keeps busy anyway, taken off its cores (``cores``) and
  off the two patterns below;
* every rank in a two-rank all-reduce across a NIC at once (ranks of host 2k with those of host 2k + 1),
  what the end of a step does on a data-parallel layout → ``cpu_s_per_nic_byte`` per byte a rank sends;
* with two or more ranks per host, every rank in a two-rank all-reduce inside its host at once →
  ``cpu_s_per_intra_byte``.

And the pipeline runtime's own CPU work (`fit_runtime_cpu`): a real training step of a pipeline of one `PROBE`
layer per rank at two microbatch counts (the caller builds it: this module does not import the trainer) →
``cpu_s_per_action`` and ``cpu_s_per_step``; then a pipeline of one of the model's own layers per rank with
every action paced as the emulated device paces that layer's forward (`fit_contention`; the layer's CPU work
fills the cores as the runs' does) → ``cpu_contention``: how much longer each microbatch makes the step than
the simulator says, per second of the CPU work it adds over the cores.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

from megareshard.planner.calibration import rank_median

__all__ = ["machine_busy_s", "boot_id", "busy_over", "measure_shared_cpu", "PROBE", "fit_runtime_cpu",
           "fit_contention", "measure_sleep_overshoot"]

PROBE = {"hidden_size": 16, "num_attention_heads": 2, "seq_length": 8, "vocab_size": 64}
"""The GPT of the runtime probe (`fit_runtime_cpu`): one layer per rank, so small that what a step costs is
the runtime's own work."""
PROBE_MICROBATCHES = (4, 20)

MAX_BYTES = 16 << 20
"""The largest buffer a pattern all-reduces (a loopback pair at gigabytes per second would otherwise take
hundreds of megabytes to last the target time)."""


def machine_busy_s() -> float:
    """CPU seconds this machine's cores have been busy since boot, all cores together (``/proc/stat``: user,
    nice, system, irq, softirq, steal)."""
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def boot_id() -> str | None:
    """This kernel's boot id (one per machine and boot; network namespaces share it), None where unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def busy_over(fn: Callable[[], None], iters: int) -> tuple[float, float]:
    """(machine CPU seconds, wall seconds) of `fn` run by every rank between two barriers, medians of `iters`
    after one warm-up, as rank 0 read them (every rank gets the same numbers)."""
    import torch
    import torch.distributed as dist

    busy, wall = [], []
    for i in range(iters + 1):
        dist.barrier()
        b0, t0 = machine_busy_s(), time.perf_counter()
        fn()
        dist.barrier()
        box = torch.tensor([machine_busy_s() - b0, time.perf_counter() - t0], dtype=torch.float64)
        dist.broadcast(box, src=0)
        if i:
            busy.append(float(box[0]))
            wall.append(float(box[1]))
    return statistics.median(busy), statistics.median(wall)


def _pairs_rate(pairs: list[tuple[int, int]], nbytes: int, idle_cores: float, iters: int) -> dict[str, Any]:
    """Every pair all-reduces `nbytes` at once (ranks in no pair wait at the barriers): machine CPU seconds per
    byte a rank sends (a two-rank ring sends its buffer once), less the idle machine's share."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = [dist.new_group(list(p)) for p in pairs]  # every rank creates every group, in one order
    mine = next((g for g, p in zip(groups, pairs) if rank in p), None)
    buf = torch.zeros(max(1, nbytes // 4))

    def run() -> None:
        if mine is not None:
            dist.all_reduce(buf, group=mine)

    busy, wall = busy_over(run, iters)
    sent = 2 * len(pairs) * buf.numel() * 4
    for g in groups:
        dist.destroy_process_group(g)
    return {"pairs": [list(p) for p in pairs], "bytes": buf.numel() * 4, "busy_s": busy, "seconds": wall,
            "cpu_s_per_byte": max(0.0, busy - idle_cores * wall) / sent}


def measure_shared_cpu(devices_per_host: int, nic_Bps: float | None, intra_Bps: float | None,
                       target_s: float = 0.2, iters: int = 3) -> dict[str, Any] | None:
    """The shared cores and their CPU rates (module docstring); None where the ranks run on more than one kernel
    or ``/proc/stat`` cannot be read. Every rank calls it."""
    import torch.distributed as dist

    world = dist.get_world_size()
    ids: list[Any] = [None] * world
    readable = os.path.exists("/proc/stat")
    dist.all_gather_object(ids, (boot_id(), readable))
    if world < 2 or len(set(ids)) != 1 or ids[0][0] is None or not ids[0][1]:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy, wall = busy_over(lambda: time.sleep(target_s / 2), iters)
    idle = min(cores / 2, busy / wall)
    out: dict[str, Any] = {"cores": cores, "idle_busy_cores": idle}
    hosts = world // devices_per_host
    if hosts > 1 and nic_Bps:
        pairs = [(h * devices_per_host + d, (h + 1) * devices_per_host + d)
                 for h in range(0, hosts - 1, 2) for d in range(devices_per_host)]
        out["nic"] = _pairs_rate(pairs, min(MAX_BYTES, int(target_s * nic_Bps)), idle, iters)
    if devices_per_host > 1 and intra_Bps:
        pairs = [(h * devices_per_host + 2 * k, h * devices_per_host + 2 * k + 1)
                 for h in range(hosts) for k in range(devices_per_host // 2)]
        out["intra"] = _pairs_rate(pairs, min(MAX_BYTES, int(target_s * intra_Bps)), idle, iters)
    return out


def fit_runtime_cpu(step_cpu: Callable[[int], tuple[float, float]], world: int, layer: dict[str, float],
                    idle_cores: float, counts: tuple[int, int] = PROBE_MICROBATCHES) -> dict[str, Any]:
    """The runtime's CPU seconds per compute action and per rank and step, from `step_cpu(m)`: (the machine's
    busy CPU seconds, wall seconds) of one training step of m microbatches through a pipeline of one `PROBE`
    layer on each of the `world` ranks (1f1b with delayed weight gradients: F, I and W per microbatch and
    rank); what the idle machine keeps busy (`idle_cores` × wall) is taken off. `layer`: the probe layer's own
    CPU times (`measure_layer`: forward, input and weight gradient), taken off each microbatch's three
    actions. Every rank calls it (`step_cpu` is collective)."""
    m1, m2 = counts
    (b1, w1), (b2, w2) = step_cpu(m1), step_cpu(m2)
    c1, c2 = max(0.0, b1 - idle_cores * w1), max(0.0, b2 - idle_cores * w2)
    per_mb = max(0.0, (c2 - c1) / (m2 - m1) / world)  # one rank's microbatch: three actions and the layer
    own = layer["forward_cpu_s"] + layer["input_grad_cpu_s"] + layer["weight_grad_cpu_s"]
    return {"microbatches": [m1, m2], "step_busy_s": [b1, b2], "step_wall_s": [w1, w2], "layer_cpu_s": own,
            "cpu_s_per_action": max(0.0, per_mb - own) / 3,
            "cpu_s_per_step": max(0.0, c1 / world - m1 * per_mb)}


def fit_contention(step_cpu: Callable[..., tuple[float, float]], world: int, budget_s: float,
                   simulated_s: Callable[[int], float], cpu_per_microbatch_s: float, cores: float,
                   posts: dict[str, float] | None = None) -> dict[str, Any]:
    """``cpu_contention`` from `step_cpu(m, pace=budget_s)`: (the machine's busy CPU seconds, wall seconds) of a
    training step of m microbatches through a pipeline of one layer on each of the `world` ranks (`calibrate`
    gives the model's own; 1f1b with delayed weight gradients) with every action paced to `budget_s`, at m = 2 and 6 ×
    `world` (past the warm-up, so the pipeline's fill and the step's fixed work cancel in the difference; 4 ×
    `world` more microbatches, so that a step's few milliseconds of noise weigh little per microbatch).
    `simulated_s(m)`: the simulator's step of m microbatches (each action its budget plus the late wake-up and
    the runtime's overhead, the planner's emulated device), whose growth per microbatch is the period;
    `cpu_per_microbatch_s`: the CPU work a
    microbatch adds, as the planner counts it (`shared_cpu_s`'s terms); `cores`: `SharedCores.cores`. The measured
    growth beyond the period is the waiting, taken per second of that CPU work over the cores. Every rank
    calls it (`step_cpu` is collective). `posts` (a dict) is handed to the m = 2 × `world` step, which fills in
    what posting a send and a receive cost (`calibrate`), before `simulated_s` is called."""
    m1, m2 = 2 * world, 6 * world
    first = step_cpu(m1, pace=budget_s) if posts is None else step_cpu(m1, pace=budget_s, posts=posts)
    (b1, w1), (b2, w2) = first, step_cpu(m2, pace=budget_s)
    growth = (w2 - w1) / (m2 - m1)
    period_s = (simulated_s(m2) - simulated_s(m1)) / (m2 - m1)
    per_core = cpu_per_microbatch_s / cores
    return {"microbatches": [m1, m2], "budget_s": budget_s, "step_busy_s": [b1, b2], "step_wall_s": [w1, w2],
            "growth_s": growth, "period_s": period_s, "cpu_per_microbatch_s": cpu_per_microbatch_s,
            "cpu_contention": max(0.0, (growth - period_s) / per_core) if per_core > 0 else 0.0}


def measure_sleep_overshoot(chunk_s: float, cpu_s: float, reps: int = 40) -> dict[str, float]:
    """How late a sleep ends under the load of paced runs: every rank alternates `cpu_s` of CPU time (a
    paced action's compute: a layer's forward) with a sleep to the chunk's end (`chunk_s`: the action's
    budget) and records how far past the end it wakes. The ranks start out of phase (rank r waits r/world of
    a chunk first), as the stages of a pipeline are, not all sleeping and waking together. The CPU demand
    is the runs' (world × cpu_s / chunk_s cores): at a higher one, every waking rank queues behind the
    others and the lateness is several times what the runs see. Kept: the mean over every sleep of every
    rank (what a chain of actions adds up), and the median. Not a `ClusterSpec` term: a device has no such
    sleep; an emulation that paces compute with sleeps (`lab.validation.validate_planner`) adds it to each action's
    overhead. Every rank calls it."""
    import torch
    import torch.distributed as dist

    a, w = torch.randn(64, 64), torch.randn(64, 64)
    late = []
    if dist.is_initialized():
        dist.barrier()
        time.sleep(chunk_s * dist.get_rank() / dist.get_world_size())
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.thread_time() - c0 < cpu_s and time.perf_counter() - t0 < chunk_s:
            a @ w
        left = chunk_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
            late.append(time.perf_counter() - t0 - chunk_s)
    mean = statistics.mean(late) if late else 0.0
    return {"chunk_s": chunk_s, "cpu_s": cpu_s, "reps": reps, "sleeps": _rank_sum(len(late)),
            "seconds": _rank_sum(mean * len(late)) / max(1, _rank_sum(len(late))),
            "median_s": rank_median(statistics.median(late) if late else 0.0)}


def _rank_sum(value: float) -> float:
    """The sum over every rank (every rank calls it); without a process group: the value."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(box)
    return float(box.item())
