"""What one candidate layout costs: compute, tensor- and data-parallel collectives, memory (pure).

Every formula is per device and per microbatch of ``b`` samples of ``s`` tokens:

* forward GEMM FLOPs of one Transformer layer: ``2·b·s·h·(h + 2·kv)`` (q, k, v), ``2·b·s·h²``
  (output projection), ``4·b·s²·h`` (scores and their product with V, counted non-causal as
  Megatron does), and the MLP ``2·b·s·h·f`` per matrix (2 matrices, 3 with SwiGLU); the
  logits ``2·b·s·h·V`` on the last stage. Backward = 2 × forward (``ClusterSpec.backward_factor``, measured by
  the calibration) (input and weight
  gradients one forward each); full recomputation adds the layers' forward to the backward. Divided by
  tp and by the device's achieved FLOP/s; each layer adds ``layer_overhead_s`` (× ``backward_factor``
  backward), the part of its time that does not scale with FLOPs (launches, Python; calibrated).
  Under delayed weight gradients the backward splits into W, ``wgrad_share`` of its compute (the
  weight-gradient GEMMs' FLOP share, or the calibrated ``wgrad_fraction``), and I, the rest and
  every collective.
* tensor parallelism: 2 all-reduces (or all-gather + reduce-scatter with sequence
  parallelism, the same bytes) of ``b·s·h`` activations per layer forward and 2 backward,
  ring cost ``2·(tp−1)/tp·bytes`` over the intra-host link (tp stays inside a host); the ends add
  theirs (`end_collectives`): the embedding's all-reduce forward on the first stage, the output
  layer's backward all-reduce and the cross entropy's three small forward all-reduces on the last.
* data parallelism: the stage's fp32 gradients, ring all-reduce (or reduce-scatter +
  all-gather under ZeRO: the same bytes) ``2·(dp−1)/dp·bytes`` over every edge of the ring; a
  host's NIC carries it once for every ring edge that leaves the host (rings in dp order: one
  edge per ring and host when a ring's ranks sit together, one per rank when they alternate).
* fixed costs (latency, `ClusterSpec`'s ``*_latency_s`` and ``action_overhead_s``, measured by the
  calibration): each tensor-parallel collective of a layer costs ``collective_latency_s`` + its ring steps
  × ``intra_latency_s`` (2 all-reduces per direction, or 2 all-gathers + 2 reduce-scatters with sequence
  parallelism); each gradient bucket (the trainer's 25 MiB of fp32 gradients) one collective of 2·(dp−1)
  ring steps at the slowest link's latency. Every compute action of the pipeline (F, B, I, W) also pays
  ``action_overhead_s``: the search adds it to the simulator's costs, not to `StageCosts` (whose F and B
  are the compute a validation run paces to).
  Posting a stage-boundary send or receive holds the rank's program ``send_post_s`` / ``recv_post_s`` (0
  unless given: the lab measures ~1 ms on its emulated cluster, whose ranks share the cores), also in the
  simulator.
* the optimizer step: the parameters a device updates (divided by dp under ZeRO >= 1) × the measured
  seconds per parameter (`ClusterSpec.optimizer_s_per_param`, 0 unless calibrated), after the pipeline; and
  the other passes over the gradients (non-finite check, bucket packing, norm): the parameters a device holds
  × `ClusterSpec.grad_pass_s_per_param`.
* memory: bf16 weights (2 B/param), fp32 gradients (4), fp32 master weights (4) and Adam
  moments (8) — the latter two divided by dp under ZeRO ≥ 1, gradients too under ZeRO 2, everything
  under ZeRO 3 plus what a step holds gathered (`_zero3`, which also adds its per-layer all-gathers and
  reduce-scatters to the forward and backward) —;
  activations per layer and microbatch ``34·s·b·h/tp`` bytes with sequence parallelism and
  ``s·b·h·(10 + 24/tp)`` without (Korthikanti et al., with a fused attention that keeps no
  score matrix), ``2·s·b·h`` (/tp with sequence parallelism) under full recomputation; times
  the schedule's live microbatches; plus the last stage's fp32 logits ``4·s·b·V/tp``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..resharding.network import NetworkModel

MAX_INFLIGHT_REDUCTIONS = 2
"""`optim.zero.MAX_INFLIGHT_REDUCTIONS` (the planner imports no torch): gradient reductions a ZeRO-3 rank keeps in
flight, each holding one layer's packed fp32 gradients."""

__all__ = ["ModelShape", "ClusterSpec", "StageCosts", "stage_costs", "mesh_dp_seconds", "layer_params", "layer_flops",
           "collective_latency", "tp_collectives_latency", "end_collectives", "wgrad_share", "dp_reduction_latency",
           "GRAD_BUCKET_BYTES"]


@dataclass(frozen=True)
class ModelShape:
    """The model as the planner sees it (a GPT or Llama-style decoder)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads."""
    seq_length: int
    """Tokens per sample s."""
    vocab_size: int
    """Vocabulary V (padded by the framework to a multiple of tp)."""
    ffn_hidden_size: int | None = None
    """MLP width f (default 4h)."""
    num_query_groups: int | None = None
    """Key/value heads under grouped-query attention (default: one per query head)."""
    swiglu: bool = False
    """Gated MLP with three matrices instead of two."""
    untied: bool = False
    """Separate output layer instead of the tied word embedding."""
    learned_positions: bool = True
    """Learned absolute position embeddings (False: rotary or none)."""
    dtype_bytes: int = 2
    """Bytes of a weight or activation element in compute: 2 (bf16/fp16, fp32 master weights kept by the
    optimizer) or 4 (fp32 training: no separate master copy)."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv(self) -> int:
        """Width of k (and of v): groups × head size."""
        return self.groups * (self.hidden_size // self.num_attention_heads)


@dataclass(frozen=True)
class ClusterSpec:
    """The machines: hosts × devices, their memory and speed, and the network between them."""

    hosts: int
    """Number of hosts (one NIC each)."""
    devices_per_host: int
    """Devices (ranks) per host."""
    device_memory_gib: float = 80.0
    """Memory per device, GiB."""
    device_tflops: float = 989.0
    """Peak dense bf16 TFLOP/s per device (H100 SXM: 989)."""
    efficiency: float = 0.45
    """Fraction of the peak a layer's GEMMs achieve (measure it with lab/bench/bench_train.py)."""
    nic_gbps: float = 400.0
    """NIC bandwidth per host and direction, Gbit/s."""
    intra_gbps: float = 3600.0
    """Intra-host link bandwidth per device, Gbit/s (NVLink 4: 450 GB/s)."""
    memory_reserve: float = 0.1
    """Share of device memory kept free (allocator fragmentation, workspaces, communicators)."""
    backward_factor: float = 2.0
    """A layer's backward time over its forward time (2: two GEMMs per forward GEMM; calibration measures it)."""
    optimizer_s_per_param: float = 0.0
    """Seconds of one optimizer step per parameter a device updates (calibration measures it; 0 leaves the
    step out, as on GPUs where it is small next to the pipeline)."""
    grad_pass_s_per_param: float = 0.0
    """Seconds per parameter a device holds of the trainer's other passes over the gradients each step: the
    non-finite check, packing them into the reduction's buckets and back, the norm (calibrated; 0 leaves them
    out, as for the step). Not divided by dp under ZeRO: the check and the packing see every local gradient."""
    intra_latency_s: float = 20e-6
    """Fixed seconds of one point-to-point message inside a host (NCCL over NVLink: ~10-30 µs; calibrated)."""
    nic_latency_s: float = 30e-6
    """Fixed seconds of one point-to-point message between hosts (launch + ~5-10 µs wire and NIC; calibrated)."""
    collective_latency_s: float = 20e-6
    """Fixed seconds of one small collective inside a host on top of its ring steps' `intra_latency_s`
    (launch and synchronisation; calibrated from a small all-reduce over two ranks of one host)."""
    action_overhead_s: float = 1e-4
    """Fixed seconds of one compute action of the pipeline (F, B or W: Python, autograd, waits; calibrated)."""
    send_post_s: float = 0.0
    """Seconds a stage-boundary send holds its rank's program before the transfer starts (the runtime checks
    the tensor, hands it to the communicator's thread and returns; on GPUs tens of µs, left out by default;
    the lab's calibration of its emulated cluster measures it from a paced pipeline's sends, where ranks share
    the cores)."""
    recv_post_s: float = 0.0
    """The same for posting a receive (calibrated with `send_post_s`)."""
    layer_overhead_s: float = 0.0
    """Fixed seconds of one layer's forward that do not shrink with its FLOPs (kernel launches, Python; the
    backward pays `backward_factor` × it). Calibrated from the layer timed at two micro batch sizes; 0 treats
    a layer as pure FLOPs (large GPU microbatches)."""
    ring_efficiency: float = 1.0
    """Share of the NIC rate a data-parallel reduction across hosts keeps when every host's NIC carries one at
    once, as at the end of a step (a ring's 2·(n−1) dependent steps and chunking, the hosts' shared network:
    gloo measured 0.66–0.91 over 8 emulated hosts, and two-rank exchanges beside each other ran at 0.88 and
    below; NCCL's rings come close to 1). Calibrated from an all-reduce over one rank per host, on clusters
    of more than two hosts (two hosts keep the default)."""
    wgrad_fraction: float | None = None
    """Share of a backward's compute that is weight gradients (W under delayed weight gradients; the input
    gradient I does the rest and every collective). None: the FLOP share of the weight-gradient GEMMs; the
    calibration measures it (on a CPU the fixed per-op costs fall mostly in I)."""

    @property
    def world(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def flops(self) -> float:
        return self.device_tflops * 1e12 * self.efficiency

    @property
    def network(self) -> NetworkModel:
        """The resharding network model of these hosts (one NIC each, the intra-host link)."""
        return NetworkModel(self.nic_gbps, self.intra_gbps)

    @property
    def nic_Bps(self) -> float:
        return self.network.nic_Bps

    def ring_nic_Bps(self, n: int) -> float:
        """The NIC rate a ring all-reduce over `n` ranks across hosts keeps per edge: `ring_efficiency` of it."""
        return self.nic_Bps * (self.ring_efficiency if n > 1 else 1.0)

    @property
    def intra_Bps(self) -> float:
        return self.network.intra_Bps

    @property
    def memory_bytes(self) -> float:
        return self.device_memory_gib * 2**30 * (1 - self.memory_reserve)


def layer_flops(m: ModelShape, micro_batch: int) -> int:
    """Forward GEMM FLOPs of one Transformer layer for one microbatch (the module docstring's terms)."""
    b, s, h = micro_batch, m.seq_length, m.hidden_size
    return (2 * b * s * h * (h + 2 * m.kv) + 2 * b * s * h * h + 4 * b * s * s * h
            + 2 * b * s * h * m.ffn * (3 if m.swiglu else 2))


def layer_params(m: ModelShape) -> int:
    """Parameters of one Transformer layer (weights, biases and two norms)."""
    h, f = m.hidden_size, m.ffn
    attn = h * (h + 2 * m.kv) + h * h + (h + 2 * m.kv) + h
    mlp = h * f * (3 if m.swiglu else 2) + f + h
    return attn + mlp + 4 * h


@dataclass(frozen=True)
class StageCosts:
    """One stage of a candidate, per device: seconds per microbatch and bytes."""

    forward_s: float
    """F of one microbatch (compute + tensor-parallel collectives)."""
    backward_s: float
    """B of one microbatch (I + W; + a forward under full recomputation)."""
    params: int
    """Parameters held by one device of the stage."""
    static_bytes: int
    """Weights, gradients and optimizer state on one device."""
    activation_bytes_per_mb: int
    """Activation memory of one live microbatch."""
    extra_bytes: int
    """Memory held once (the last stage's logits)."""
    tp_bytes_per_mb: int
    """Bytes one device moves in tensor-parallel collectives per microbatch (F + B)."""
    dp_seconds: float
    """The stage's gradient reduction per step (ring over dp, on the slowest link it crosses)."""
    dp_nic_bytes: int
    """Bytes the reduction moves through each NIC it crosses (per direction)."""
    optimizer_s: float = 0.0
    """The optimizer step of the parameters one device updates (its ZeRO shard)."""
    tp_latency_s: float = 0.0
    """Fixed (latency) seconds of the tensor-parallel collectives of one microbatch (F + B)."""
    wgrad_s: float = 0.0
    """The weight-gradient part (W) of `backward_s`: compute only, no collective."""
    compute_s: float = 0.0
    """Device seconds of compute (no collectives) in one microbatch's F and B (extra cost terms read it: the lab's
    shared cores turn it into CPU time)."""


GRAD_BUCKET_BYTES = 25 * 2**20
"""The trainer's gradient bucket (`optim.zero.ZeroOptimizer`'s ``bucket_bytes``): one collective per 25 MiB of fp32
gradients. (Megatron-LM's default is max(40 M, 1 M × dp) parameters, one bucket without --overlap-grad-reduce;
the planner counts what this trainer issues.)"""


def collective_latency(c: ClusterSpec, n: int, crosses_hosts: bool = False, steps_per_rank: int = 2) -> float:
    """Fixed seconds of one ring collective over `n` ranks: `collective_latency_s` plus its
    ``steps_per_rank·(n−1)`` ring steps (2 for an all-reduce, 1 for an all-gather or a reduce-scatter) at the
    latency of the link it crosses; 0 for one rank."""
    if n <= 1:
        return 0.0
    alpha = c.nic_latency_s if crosses_hosts else c.intra_latency_s
    return c.collective_latency_s + steps_per_rank * (n - 1) * alpha


def tp_collectives_latency(c: ClusterSpec, tp: int, sequence_parallel: bool) -> float:
    """Fixed seconds of one layer's tensor-parallel collectives in one direction: 2 all-reduces (2·(tp−1) ring
    steps each) or, with sequence parallelism, 2 all-gathers + 2 reduce-scatters (tp−1 steps each)."""
    if sequence_parallel:
        return 4 * collective_latency(c, tp, steps_per_rank=1)
    return 2 * collective_latency(c, tp)


def end_collectives(m: ModelShape, c: ClusterSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                    first: bool, last: bool) -> tuple[float, float, float, float, int]:
    """The tensor-parallel collectives of the model's ends for one microbatch (0 at tp 1), as (forward seconds,
    backward seconds, their fixed parts forward and backward, bytes per device): the first stage's
    vocab-parallel embedding all-reduces its output forward (reduce-scatters it under sequence parallelism);
    the last stage's output layer all-reduces its input gradient backward (all-gather forward and
    reduce-scatter backward under sequence parallelism), and the vocab-parallel cross entropy all-reduces three
    ``b·s`` fp32 vectors forward (maximum, target logit, sum of exponentials)."""
    if tp <= 1 or not (first or last):
        return 0.0, 0.0, 0.0, 0.0, 0
    act = micro_batch * m.seq_length * m.hidden_size * m.dtype_bytes
    all_reduce = collective_latency(c, tp)
    one_way = collective_latency(c, tp, steps_per_rank=1)  # an all-gather or a reduce-scatter
    f_lat = b_lat = 0.0
    f_bytes = b_bytes = 0.0
    if first:
        f_lat += one_way if sequence_parallel else all_reduce
        f_bytes += _ring(tp, act) / (2 if sequence_parallel else 1)
    if last:
        if sequence_parallel:
            f_lat, b_lat = f_lat + one_way, b_lat + one_way
            f_bytes, b_bytes = f_bytes + _ring(tp, act) / 2, b_bytes + _ring(tp, act) / 2
        else:
            b_lat += all_reduce
            b_bytes += _ring(tp, act)
        f_lat += 3 * all_reduce
        f_bytes += 3 * _ring(tp, 4 * micro_batch * m.seq_length)
    return (f_lat + f_bytes / c.intra_Bps, b_lat + b_bytes / c.intra_Bps, f_lat, b_lat, int(f_bytes + b_bytes))


def wgrad_share(m: ModelShape, c: ClusterSpec, layers: int, last: bool) -> float:
    """The weight-gradient share of a stage's backward compute: `ClusterSpec.wgrad_fraction` when calibrated,
    else the FLOPs of the weight-gradient GEMMs (one forward of every weighted GEMM: the layers' without the
    attention core, the logits') over the backward's (two forwards)."""
    if c.wgrad_fraction is not None:
        return c.wgrad_fraction
    b1 = layer_flops(m, 1)
    fwd = layers * b1 + (2 * m.seq_length * m.hidden_size * m.vocab_size if last else 0)
    weighted = fwd - layers * 4 * m.seq_length * m.seq_length * m.hidden_size
    return weighted / (2 * fwd) if fwd else 0.0


def dp_reduction_latency(c: ClusterSpec, params: int, dp: int, crosses_hosts: bool) -> float:
    """Fixed seconds of a stage's gradient reduction: per bucket, a ring's 2·(dp−1) steps at the latency of
    the slowest link it crosses."""
    if dp <= 1:
        return 0.0
    buckets = max(1, math.ceil(4 * params / GRAD_BUCKET_BYTES))  # fp32 gradients
    return buckets * collective_latency(c, dp, crosses_hosts)


def mesh_dp_seconds(c: ClusterSpec, stages: list[StageCosts], dp: int, crosses_hosts: bool) -> float:
    """The gradient reduction of a mesh holding `stages` (several under virtual stages): their rings' bytes, and
    the fixed part of the buckets of all their parameters together — the trainer buckets a mesh's model chunks
    as one model (each stage's own `dp_seconds` counts its buckets' latency alone)."""
    if len(stages) == 1:
        return stages[0].dp_seconds
    return (sum(st.dp_seconds - dp_reduction_latency(c, st.params, dp, crosses_hosts) for st in stages)
            + dp_reduction_latency(c, sum(st.params for st in stages), dp, crosses_hosts))


def _zero3(m: ModelShape, c: ClusterSpec, per_dev: int, layers: int, tp: int, dp: int, layer_f: float,
           recompute: bool, crosses: bool, edges_per_nic: int, opt_bytes: int) -> dict[str, float]:
    """ZeRO-3 (parameters sharded over dp; `optim.zero3`'s default, gathered per layer and microbatch) on one
    device: memory, the extra seconds of a microbatch's forward and backward, the reduction after the step.

    Memory: weights, gradients and optimizer state all 1/dp, plus what a step holds gathered at once — the
    stage module's own parameters (embedding, final norm, output layer: kept from a microbatch's forward to
    its backward), a layer and the next one prefetched, one layer's unsharded gradients, the gradients of
    the stage module's parameters, kept unsharded until the step's end (the tied embedding's all-reduce
    between the first and last stage, and sequence parallelism's over tp, come first), and the packed fp32
    gradients of the reductions in flight (`optim.zero.MAX_INFLIGHT_REDUCTIONS` layers).
    Time: each layer's all-gather (compute dtype, ring (dp−1)/dp of its bytes) is prefetched behind the
    previous layer's forward; in backward its all-gather again and its fp32 reduce-scatter behind the layer's
    backward: only what exceeds the compute shows, plus every collective's fixed cost (issuing it, which no
    compute hides). The stage module's gather adds to the forward (it is the first thing a stage runs).
    After the step: the reduce-scatter of the stage module's gradients; no all-gather (the next use gathers).
    """
    layer_p = layer_params(m) // tp
    root_p = max(0, per_dev - layers * layer_p)

    def seconds(nbytes: float) -> float:
        one_way = _ring(dp, nbytes) / 2  # an all-gather or a reduce-scatter: (dp−1)/dp of the bytes
        if crosses:
            return one_way * edges_per_nic / c.ring_nic_Bps(dp)
        return one_way / c.intra_Bps

    lat = collective_latency(c, dp, crosses, steps_per_rank=1)
    ag, rs = seconds(m.dtype_bytes * layer_p), seconds(4 * layer_p)
    layer_b = c.backward_factor * layer_f + (layer_f if recompute else 0.0)
    forward = layers * (max(0.0, ag + lat - layer_f) + c.collective_latency_s) + seconds(m.dtype_bytes * root_p) + lat
    backward = layers * (max(0.0, ag + rs + 2 * lat - layer_b) + 2 * c.collective_latency_s)
    # gathered: the stage module's parameters and two layers; unsharded gradients (the parameters' dtype): the
    # stage module's and one layer's; packed for their reduce-scatter (fp32): the reductions in flight
    held = m.dtype_bytes * (2 * root_p + (min(2, layers) + 1) * layer_p) + 4 * MAX_INFLIGHT_REDUCTIONS * layer_p
    static = (m.dtype_bytes + 4 + opt_bytes) * per_dev // dp + held
    nic = _ring(dp, 4 * root_p) / 2 * edges_per_nic if crosses else 0
    return {"static": static, "forward": forward, "backward": backward, "dp_s": seconds(4 * root_p) + lat,
            "nic": nic}


def _ring(n: int, nbytes: float) -> float:
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def stage_costs(m: ModelShape, c: ClusterSpec, *, layers: int, first: bool, last: bool, tp: int, dp: int,
                micro_batch: int, sequence_parallel: bool, recompute: bool, zero: int,
                dp_crosses_hosts: bool, dp_ring_edges_per_nic: int, tied_copy: bool = True) -> StageCosts:
    """Per-device costs of a stage of ``layers`` layers (see the module docstring for every term). `tied_copy`:
    the last stage holds its own copy of the output weight tied to the word embedding (False where one mesh holds
    both ends, zbv's V: the trainer keeps one Parameter there, whose gradient and optimizer state the first stage
    already counts)."""
    b, s, h, V = micro_batch, m.seq_length, m.hidden_size, m.vocab_size
    layer_fwd = layer_flops(m, b)
    fwd_flops = layers * layer_fwd + (2 * b * s * h * V if last else 0)
    act = b * s * h * m.dtype_bytes  # the activation of one layer boundary
    tp_bytes_layer = 2 * _ring(tp, act)  # two collectives per layer and direction
    tp_lat = layers * tp_collectives_latency(c, tp, sequence_parallel)
    tp_s = layers * tp_bytes_layer / c.intra_Bps + tp_lat
    compute = fwd_flops / tp / c.flops + layers * c.layer_overhead_s
    end_f, end_b, end_f_lat, end_b_lat, end_bytes = end_collectives(m, c, b, tp, sequence_parallel, first, last)
    f = compute + tp_s + end_f
    wgrad = wgrad_share(m, c, layers, last) * c.backward_factor * compute
    bwd = c.backward_factor * compute + tp_s + end_b
    if recompute:  # the layers' forward again (not the ends': the embedding, output layer and loss are kept)
        bwd += layers * (layer_fwd / tp / c.flops + c.layer_overhead_s) + tp_s
    params = layers * layer_params(m)
    if first:
        params += V * h + (s * h if m.learned_positions else 0)  # word (+ learned position) embedding
    if last:
        params += V * h if (m.untied or (not first and tied_copy)) else 0  # output layer (a tied copy when pp > 1)
        params += 2 * h  # final norm
    per_dev = params // tp
    opt_div = dp if zero >= 1 else 1
    grad_div = dp if zero >= 2 else 1
    # weights in compute precision, fp32 gradients, Adam's two moments (+ fp32 master weights under mixed precision)
    opt_bytes = 12 if m.dtype_bytes < 4 else 8
    static = m.dtype_bytes * per_dev + 4 * per_dev // grad_div + opt_bytes * per_dev // opt_div
    if recompute:
        act_mb = layers * (2 * s * b * h // (tp if sequence_parallel else 1))
    elif sequence_parallel:
        act_mb = layers * 34 * s * b * h // tp
    else:
        act_mb = layers * s * b * h * (10 + 24 // tp)
    act_mb = act_mb * m.dtype_bytes // 2  # Korthikanti et al.'s bytes are for 2-byte activations
    extra = 4 * s * b * V // tp if last else 0
    grads = 4 * per_dev
    ring = _ring(dp, grads)
    if dp_crosses_hosts:
        nic = ring * dp_ring_edges_per_nic  # every ring edge carries 2·(dp−1)/dp of the bytes
        dp_s = nic / c.ring_nic_Bps(dp)
    else:
        nic = 0
        dp_s = ring / c.intra_Bps
    dp_s += dp_reduction_latency(c, per_dev, dp, dp_crosses_hosts)
    if zero >= 3 and dp > 1:
        z3 = _zero3(m, c, per_dev, layers, tp, dp, layer_fwd / tp / c.flops + c.layer_overhead_s, recompute,
                    dp_crosses_hosts, dp_ring_edges_per_nic, opt_bytes)
        static, dp_s, nic = z3["static"], z3["dp_s"], z3["nic"]
        f += z3["forward"]
        bwd += z3["backward"]
    return StageCosts(forward_s=f, backward_s=bwd, params=per_dev, static_bytes=int(static),
                      activation_bytes_per_mb=int(act_mb), extra_bytes=int(extra),
                      tp_bytes_per_mb=int(4 * layers * _ring(tp, act)) + end_bytes, dp_seconds=dp_s,
                      dp_nic_bytes=int(nic), optimizer_s=per_dev / opt_div * c.optimizer_s_per_param
                      + per_dev * c.grad_pass_s_per_param,
                      tp_latency_s=(3 if recompute else 2) * tp_lat + end_f_lat + end_b_lat, wgrad_s=wgrad,
                      compute_s=(1 + c.backward_factor) * compute
                      + (layers * (layer_fwd / tp / c.flops + c.layer_overhead_s) if recompute else 0.0))
