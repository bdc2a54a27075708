#!/usr/bin/env python
"""ZeRO 0/1/2/3: memory per rank against the planner's accounting, and step time against DeepSpeed's ZeRO.

Three parts, on gloo ranks (CPU), each rank a fresh process of ``tests.harness.run_ranks``:

* ``memory``: for every dp of ``--dps`` and every ZeRO stage of ``--stages``, one launch trains
  ``--steps`` steps of the memory model (fp32, dp only). Per rank, above the resident set before the model
  was built: the resident set after the first step (the model's initialisation, which builds every full
  tensor once, behind it) and its high-water mark over the later steps (Linux's ``VmHWM``, reset after the
  first step: the process's real peak), with glibc's malloc mapping blocks of 64 KiB and more on their own
  (``MMAP_ENV``: otherwise the resident set follows the allocator's history, not the tensors);
  the tensors that exist after a step (``megareshard.memory.memory_report``: parameters — at ZeRO 3 their
  shards —, gradients, optimizer state) and the activations saved over one step; at ZeRO 3 the most bytes
  of gathered parameters at once. Beside them the planner's prediction (``planner.costs.stage_costs``:
  weights + gradients + optimizer state, with ZeRO 3's gathered layers and unsharded gradients, plus one
  microbatch's activations and the logits). Max over ranks.
* ``time``: one launch at ``--time-dp`` builds every variant on the same model and data — ours at ZeRO 0,
  1, 2, 3 (and 3 without resharding after forward, and 3 with DeepSpeed's default persistence threshold:
  parameters under 100 000 elements kept for the step), DeepSpeed at ZeRO 2 and 3 (its defaults, and ZeRO 3
  with ``stage3_param_persistence_threshold`` 0: every parameter sharded, as ours) — and runs their steps
  round-robin (step k of every variant, then step k+1), so a change of load on the shared cores hits all of
  them alike. A step is what the trainer does: per microbatch forward and backward, then the dp reduction,
  clipping and the optimizer step (DeepSpeed: ``engine(batch)``, ``engine.backward``, ``engine.step``).
  Reported: the median step over the steps after the first (and the CPU seconds a rank spends in it,
  steadier than wall time on shared cores but blind to waiting), and the ratios ours ZeRO 2 / DeepSpeed ZeRO 2,
  ours ZeRO 3 / DeepSpeed ZeRO 3 (both everything sharded; both with the default persistence threshold;
  ours everything sharded against DeepSpeed's default), ours ZeRO 3 / ours ZeRO 2.
* ``pipeline``: pp 2 · dp ``--time-dp`` through the trainer (1F1B, and eager-1F1B with delayed weight
  gradients), ZeRO 2 beside ZeRO 3 gathering each layer per microbatch (the default) or keeping a stage's
  layers gathered for the step (``--torch-fsdp2-no-reshard-after-forward``), stepped round-robin: the
  step time, the all-gathers per step and the most gathered bytes at once — what the choice between the
  two trades.

    python -m lab.bench.bench_memory [--part memory|time|pipeline|both|all] [--dps 2,4,8] [--time-dp 2] [--steps 8]
                                 [--json out.json] [--tiny]

``--tiny``: a two-layer model and two steps (checks that the script runs end to end; its numbers mean
nothing). Timings on shared CPU cores vary from run to run: compare ratios inside one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from lab import env_with_root

# step time: the model the first version of this benchmark measured (ZeRO 2 at 1.38× DeepSpeed's)
TIME_CFG = dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=128,
                vocab_size=1024, make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0)
# memory: large enough that its tensors stand out of a process's resident set (~17 M parameters)
MEM_CFG = dict(num_layers=8, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1536, seq_length=128,
               vocab_size=8192, make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0)
TINY_CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                vocab_size=64, make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0)
MB, NMB, LR, WD, BETAS, EPS, CLIP = 4, 2, 1e-3, 0.1, (0.9, 0.95), 1e-8, 1.0


def _data(cfg, dp_rank, steps):
    g = torch.Generator().manual_seed(100 + dp_rank)
    return [[torch.randint(0, cfg["vocab_size"], (MB, cfg["seq_length"] + 1), generator=g) for _ in range(NMB)]
            for _ in range(steps)]


def _proc_status(key: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak_rss() -> None:
    """Set this process's resident high-water mark to what is resident now (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Ours:
    """megareshard's GPT and ZeroOptimizer, stepped as the trainer steps them."""

    def __init__(self, ctx, cfg, stage, **zero3):
        from megareshard.arguments import ModelConfig
        from megareshard.models import GPTModel
        from megareshard.optim.zero import ZeroOptimizer

        self.model = GPTModel(ModelConfig(**cfg), ctx, seed=1)
        self.opt = ZeroOptimizer(self.model.named_parameters(), ctx, stage=stage, lr=LR, weight_decay=WD,
                                 betas=BETAS, eps=EPS, module=self.model if stage == 3 else None, **zero3)

    def step(self, mbs, meter=None):
        self.opt.zero_grad()
        total = 0.0
        for tokens in mbs:
            ctx = meter if meter is not None else _null()
            with ctx:
                loss = self.model(tokens[:, :-1], labels=tokens[:, 1:]).mean() / len(mbs)
            loss.backward()
            total += loss.item()
        self.opt.finish_grad_sync()
        self.opt.clip_grad_norm(CLIP)
        self.opt.step()
        return total


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DeepSpeed:
    """DeepSpeed's engine over the same GPT, AdamW (torch's) and clipping; ``extra`` joins its ZeRO config."""

    def __init__(self, ctx, cfg, stage, extra=None):
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401
        from megareshard.arguments import ModelConfig
        from megareshard.models import GPTModel

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None   # no JIT-compiled shm op on CPU

        class LossModule(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, tokens):
                return self.m(tokens[:, :-1], labels=tokens[:, 1:]).mean()

        module = LossModule(GPTModel(ModelConfig(**cfg), ctx, seed=1))
        decay = [p for p in module.parameters() if p.ndim >= 2]
        no_decay = [p for p in module.parameters() if p.ndim < 2]
        config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": NMB,
                  "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                           "weight_decay": WD, "torch_adam": True}},
                  "gradient_clipping": CLIP, "zero_optimization": {"stage": stage, **(extra or {})},
                  "steps_per_print": 10 ** 9}
        self.engine, _, _, _ = deepspeed.initialize(model=module, config=config, dist_init_required=False,
                                                    model_parameters=[{"params": decay, "weight_decay": WD},
                                                                      {"params": no_decay, "weight_decay": 0.0}])

    def step(self, mbs, meter=None):
        total = 0.0
        for tokens in mbs:
            loss = self.engine(tokens)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.item() / len(mbs)
        return total


def _env(rank, world_size, ext_dir):
    os.environ.update(TORCH_EXTENSIONS_DIR=ext_dir, LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    from megareshard.parallel import ParallelContext, Topology

    return ParallelContext.create(Topology(world_size))


# ---- memory ------------------------------------------------------------------------------------
def _memory_rank(rank, world_size, stage, steps, cfg, ext_dir):
    from megareshard.memory import ActivationMeter, memory_report

    ctx = _env(rank, world_size, ext_dir)
    base = _proc_status("VmRSS")
    ours = _Ours(ctx, cfg, stage)
    meter = ActivationMeter(exclude=ours.model.parameters(), exclude_live=ours.opt.gathered_ptrs)
    data = _data(cfg, ctx.dp_rank(), max(steps, 2))
    losses = [ours.step(data[0], meter)]  # the first step creates Adam's state; the model's init is behind us
    rest = _proc_status("VmRSS") - base
    _reset_peak_rss()
    for mbs in data[1:]:
        losses.append(ours.step(mbs))
    rep = memory_report(ours.model, ours.opt, meter.peak_bytes)
    sharder = ours.opt.sharder
    return {"rss_rest": rest, "rss_peak": _proc_status("VmHWM") - base, **rep.to_dict(),
            "gathered_peak": sharder.peak_bytes if sharder is not None else 0, "final_loss": losses[-1]}


def _predicted(cfg, dp, stage) -> int:
    """The planner's bytes per device for this run: one stage holding the whole model (fp32), one microbatch of
    activations live (microbatches run one after the other), the logits."""
    from megareshard.planner.costs import ClusterSpec, ModelShape, stage_costs

    m = ModelShape(cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["seq_length"],
                   cfg["vocab_size"], ffn_hidden_size=cfg["ffn_hidden_size"], dtype_bytes=4)
    st = stage_costs(m, ClusterSpec(1, dp, 80.0, 1.0), layers=cfg["num_layers"], first=True, last=True, tp=1, dp=dp,
                     micro_batch=MB, sequence_parallel=False, recompute=False, zero=stage, dp_crosses_hosts=False,
                     dp_ring_edges_per_nic=0)
    return st.static_bytes + st.activation_bytes_per_mb + st.extra_bytes


def memory_part(dps, stages, steps, cfg, run_ranks, ext):
    rows = []
    for dp in dps:
        for stage in stages:
            if stage == 3 and dp < 2:
                continue
            per_rank = run_ranks(_memory_rank, dp, stage, steps, cfg, ext, timeout=1800)
            row = {"dp": dp, "zero": stage}
            for key in per_rank[0]:
                row[key] = max(r[key] for r in per_rank) if key != "final_loss" else per_rank[0][key]
            row["static"] = row["params"] + row["grads"] + row["optimizer"]
            row["predicted"] = _predicted(cfg, dp, stage)
            rows.append(row)
    for row in rows:  # the parameter + gradient + optimizer bytes over ZeRO 0's at the same dp, and 1/dp of it
        z0 = next((r for r in rows if r["dp"] == row["dp"] and r["zero"] == 0), None)
        if z0 is not None:
            row["static_over_zero0"] = row["static"] / z0["static"]
    return rows


# ---- time --------------------------------------------------------------------------------------
DS_PERSISTENCE = 100_000  # DeepSpeed's default stage3_param_persistence_threshold (elements)
TIME_VARIANTS = [("megareshard", 0, {}), ("megareshard", 1, {}), ("megareshard", 2, {}), ("megareshard", 3, {}),
                 ("megareshard", 3, {"reshard_after_forward": False}),
                 ("megareshard", 3, {"param_persistence_threshold": DS_PERSISTENCE}),
                 ("deepspeed", 2, {}), ("deepspeed", 3, {}),
                 ("deepspeed", 3, {"stage3_param_persistence_threshold": 0})]


def _time_rank(rank, world_size, steps, cfg, ext_dir, with_ds):
    ctx = _env(rank, world_size, ext_dir)
    variants = []
    for impl, stage, extra in TIME_VARIANTS:
        if impl == "deepspeed" and not with_ds:
            continue
        if impl == "megareshard":
            v = _Ours(ctx, cfg, stage, **extra)
        else:
            v = _DeepSpeed(ctx, cfg, stage, extra)
        variants.append(((impl, stage, extra), v, [], [], []))
    for mbs in _data(cfg, ctx.dp_rank(), steps):  # round-robin: step k of every variant, then step k+1
        for _, v, times, cpu, losses in variants:
            t0, c0 = time.perf_counter(), time.process_time()
            losses.append(v.step(mbs))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return [{"impl": impl, "zero": stage, "options": extra, "step_s": statistics.median(times[1:] or times),
             "cpu_s": statistics.median(cpu[1:] or cpu), "final_loss": losses[-1]}
            for (impl, stage, extra), _, times, cpu, losses in variants]


def time_part(dp, steps, cfg, run_ranks, ext):
    try:
        import deepspeed  # noqa: F401
        with_ds = True
    except Exception as e:  # the comparison is optional, but its absence is said, not hidden
        with_ds = False
        print(f"[bench_memory] WARNING: deepspeed is not importable ({type(e).__name__}: {e}); the DeepSpeed rows "
              "are left out. Install the extra: pip install -c constraints-cpu.txt -e '.[deepspeed]'",
              file=sys.stderr, flush=True)
    per_rank = run_ranks(_time_rank, dp, steps, cfg, ext, with_ds, timeout=3600)
    rows = []
    for i, row in enumerate(per_rank[0]):  # the slowest rank sets the step; CPU seconds: the mean rank's
        rows.append({**row, "step_s": max(r[i]["step_s"] for r in per_rank),
                     "cpu_s": sum(r[i]["cpu_s"] for r in per_rank) / len(per_rank)})

    def step(impl, stage, options=None):
        return next((r["step_s"] for r in rows if r["impl"] == impl and r["zero"] == stage
                     and r["options"] == (options or {})), None)

    # each ZeRO-3 against the other's with the same parameters sharded: every one (threshold 0), or those of
    # DeepSpeed's default persistence threshold
    ratios = {"ours_zero2_over_deepspeed_zero2": (step("megareshard", 2), step("deepspeed", 2)),
              "ours_zero3_over_deepspeed_zero3_all_sharded": (
                  step("megareshard", 3), step("deepspeed", 3, {"stage3_param_persistence_threshold": 0})),
              "ours_zero3_persistence_over_deepspeed_zero3_default": (
                  step("megareshard", 3, {"param_persistence_threshold": DS_PERSISTENCE}), step("deepspeed", 3)),
              "ours_zero3_over_deepspeed_zero3_default": (step("megareshard", 3), step("deepspeed", 3)),
              "ours_zero3_over_ours_zero2": (step("megareshard", 3), step("megareshard", 2))}
    ratios = {k: (a / b if a and b else None) for k, (a, b) in ratios.items()}
    cpu = {r["impl"] + str(r["zero"]) + json.dumps(r["options"]): r["cpu_s"] for r in rows}
    ratios["cpu_ours_zero2_over_deepspeed_zero2"] = (cpu.get("megareshard2{}", 0) / cpu["deepspeed2{}"]
                                                     if cpu.get("deepspeed2{}") else None)
    return rows, ratios


# ---- pipeline: ZeRO-3 per microbatch or kept for the step --------------------------------------
PIPE_VARIANTS = [("zero 2", ["--zero-stage", "2"]), ("zero 3 per microbatch", ["--zero-stage", "3"]),
                 ("zero 3 kept for the step", ["--zero-stage", "3", "--torch-fsdp2-no-reshard-after-forward"])]


def _pipeline_rank(rank, world_size, steps, cfg, schedule, microbatches):
    import io

    from megareshard.arguments import parse_args
    from megareshard.training import Trainer, build_context

    torch.set_num_threads(1)
    base = ["--mock-data", "--device", "cpu", "--pipeline-model-parallel-size", "2", "--micro-batch-size", str(MB),
            "--global-batch-size", str(MB * microbatches * world_size // 2), "--train-iters", str(steps),
            "--lr", str(LR), "--seed", "1", "--log-interval", "1000", "--hidden-dropout", "0", "--attention-dropout",
            "0", "--num-layers", str(cfg["num_layers"]), "--hidden-size", str(cfg["hidden_size"]),
            "--num-attention-heads", str(cfg["num_attention_heads"]), "--ffn-hidden-size", str(cfg["ffn_hidden_size"]),
            "--seq-length", str(cfg["seq_length"]), "--vocab-size", str(cfg["vocab_size"]), *schedule]
    trainers = []
    for name, flags in PIPE_VARIANTS:
        c = parse_args(base + flags, world_size=world_size)
        ctx, _ = build_context(c, world_size)
        trainers.append((name, Trainer(c, ctx, torch.device("cpu"), out=io.StringIO()), [], []))
    for _ in range(steps):  # round-robin, as the time part
        for name, t, times, losses in trainers:
            batch = t._microbatches(t.train_data, next(t._train_iter))
            t0 = time.perf_counter()
            losses.append(t.train_step(batch).loss)
            times.append(time.perf_counter() - t0)
    out = []
    for name, t, times, losses in trainers:
        sharder = t.optimizer.sharder
        out.append({"variant": name, "step_s": statistics.median(times[1:] or times), "final_loss": losses[-1],
                    "gathers_per_step": sharder.gathers / steps if sharder else 0,
                    "gathered_peak": sharder.peak_bytes if sharder else 0,
                    "memory_per_stage": [m.to_dict() for m in t.memory]})
    return out


def pipeline_part(dp, steps, cfg, run_ranks, microbatches=8):
    """pp 2 · dp ``dp``: ZeRO 2 and ZeRO 3 gathering per microbatch or keeping a stage's layers for the step,
    under 1F1B and eager-1F1B with delayed weight gradients; the slowest rank's median step, the all-gathers a
    rank issues per step and the most gathered bytes at once (max over ranks)."""
    rows = []
    for schedule in (["--pipeline-schedule", "1f1b"], ["--pipeline-schedule", "eager-1f1b", "--delay-wgrad-compute"]):
        per_rank = run_ranks(_pipeline_rank, 2 * dp, steps, cfg, schedule, microbatches, timeout=3600)
        for i, row in enumerate(per_rank[0]):
            rows.append({**row, "schedule": " ".join(schedule[1:]), "microbatches": microbatches,
                         **{k: max(r[i][k] for r in per_rank) for k in ("step_s", "gathers_per_step",
                                                                        "gathered_peak")}})
    return rows


MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_BYTES = "65536"
"""glibc's malloc keeps freed blocks in its heap (and, once a large block was freed, serves later ones from
there too), so a process's resident set follows its allocation history, not its live tensors: ZeRO-3's gather
and free of every layer then shows as growth. Blocks of 64 KiB and more mmapped (and unmapped when freed) make
the resident set follow the tensors; it is read when a process starts, so the memory part runs in a child."""


def _memory_in_child(args, ext) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", dir=ext) as f:
        argv = [sys.executable, "-m", "lab.bench.bench_memory", "--part", "memory", "--dps", args.dps, "--stages",
                args.stages, "--steps", str(args.steps), "--json", f.name] + (["--tiny"] if args.tiny else [])
        import subprocess

        subprocess.run(argv, check=True, env=env_with_root(**{MMAP_ENV: MMAP_BYTES}), stdout=subprocess.DEVNULL)
        with open(f.name) as g:
            return json.load(g)["memory"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("memory", "time", "pipeline", "both", "all"), default="all",
                    help="both: memory and time; all: also pipeline (ZeRO-3 per microbatch or kept for the step)")
    ap.add_argument("--dps", default="2,4,8", help="data-parallel sizes of the memory part")
    ap.add_argument("--stages", default="0,1,2,3", help="ZeRO stages of the memory part")
    ap.add_argument("--time-dp", type=int, default=2, help="data-parallel size of the time part")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="a two-layer model, two steps: the script runs end to end")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    from tests.harness import run_ranks

    mem_cfg, time_cfg, steps = (TINY_CFG, TINY_CFG, 2) if args.tiny else (MEM_CFG, TIME_CFG, args.steps)
    out = {"micro_batch": MB, "microbatches": NMB, "steps": steps}
    mib = lambda v: "-" if v is None else f"{v / 2 ** 20:9.2f}"  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="mr-bench-ext-") as ext:
        if args.part in ("memory", "both", "all") and MMAP_ENV not in os.environ:
            out["memory"] = _memory_in_child(args, ext)
        elif args.part in ("memory", "both", "all"):
            rows = memory_part([int(x) for x in args.dps.split(",")], [int(x) for x in args.stages.split(",")],
                               steps, mem_cfg, run_ranks, ext)
            out["memory"] = {"config": mem_cfg, "rows": rows, "malloc_mmap_threshold": os.environ[MMAP_ENV]}
        if "memory" in out:
            rows = out["memory"]["rows"]
            print(f"memory: GPT {mem_cfg['num_layers']}L h{mem_cfg['hidden_size']} V{mem_cfg['vocab_size']} s"
                  f"{mem_cfg['seq_length']}, micro-batch {MB} × {NMB}, fp32; MiB per rank, max over ranks")
            print(f"{'dp':>3}{'zero':>5}{'params':>9}{'grads':>9}{'optim':>9}{'p+g+o':>9}{'×zero0':>8}{'1/dp':>7}"
                  f"{'gathered':>9}{'activ':>9}{'rss rest':>10}{'rss peak':>10}{'predicted':>10}")
            for r in rows:
                print(f"{r['dp']:>3}{r['zero']:>5}{mib(r['params'])}{mib(r['grads'])}{mib(r['optimizer'])}"
                      f"{mib(r['static'])}{r.get('static_over_zero0', float('nan')):>8.3f}{1 / r['dp']:>7.3f}"
                      f"{mib(r['gathered_peak'])}{mib(r['activations'])} {mib(r['rss_rest'])} {mib(r['rss_peak'])} "
                      f"{mib(r['predicted'])}")
        if args.part in ("pipeline", "all"):
            rows = pipeline_part(args.time_dp, steps, time_cfg, run_ranks)
            out["pipeline"] = {"config": time_cfg, "pp": 2, "dp": args.time_dp, "rows": rows}
            print(f"pipeline: pp 2 · dp {args.time_dp}, {rows[0]['microbatches']} microbatches, GPT "
                  f"{time_cfg['num_layers']}L h{time_cfg['hidden_size']}; slowest rank's median step")
            for r in rows:
                print(f"  {r['schedule']:<32} {r['variant']:<26} {r['step_s']:.4f} s  gathers/step "
                      f"{r['gathers_per_step']:6.1f}  gathered peak {mib(r['gathered_peak'])} MiB")
        if args.part in ("time", "both", "all"):
            rows, ratios = time_part(args.time_dp, steps, time_cfg, run_ranks, ext)
            out["time"] = {"config": time_cfg, "dp": args.time_dp, "rows": rows, "ratios": ratios}
            print(f"time: GPT {time_cfg['num_layers']}L h{time_cfg['hidden_size']} s{time_cfg['seq_length']} "
                  f"V{time_cfg['vocab_size']}, micro-batch {MB} × {NMB}, dp {args.time_dp} (gloo, CPU), fp32, "
                  "variants round-robin; slowest rank's median step")
            for r in rows:
                print(f"  {r['impl']:<12} zero {r['zero']} {json.dumps(r['options']):<44} {r['step_s']:.4f} s  "
                      f"CPU {r['cpu_s']:.4f} s  loss {r['final_loss']:.4f}")
            for k, v in ratios.items():
                print(f"  {k}: {'-' if v is None else f'{v:.3f}'}")
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
