#!/usr/bin/env python
"""Everything that needs one CUDA GPU, in one run: the device's ceilings, the CUDA tests, the bf16 training path
(fp32 vs bf16 loss, save and resume bitwise) and a fixed speed grid, side by side on the same card.

    python -m lab.bench.gpu_checks --out DIR                        # DIR/gpu_checks.json, DIR/*.log
    python -m lab.bench.gpu_checks --out DIR --skip tests,bf16      # the speed grid alone (about 8 minutes, H100)
    python -m lab.bench.gpu_checks --out DIR --tiny                 # the same machinery on CPU, tiny models

**The speed grid** (fixed here, before running): GPT 125M, 350M, 760M, 1.3B and a Llama-style 1.2B at sequence
2048, vocabulary 50304, bf16, AdamW, each trained by

* ``megareshard-fast``: megareshard with the fast path (``--torch-compile``: every layer and the loss head
  compiled, ``--cross-entropy-loss-fusion``, ``--attention-backend auto``, fused AdamW), bf16 parameters
  with fp32 master weights;
* ``hf-compile``: Hugging Face transformers' ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` of the same shapes,
  SDPA attention, fp32 parameters under bf16 autocast, PyTorch's fused AdamW, torch.compile — per decoder
  layer by default (regional compilation, the fast-starting scheme that megareshard's fast path also uses),
  or of the whole model with ``--hf-compile full`` (longer to compile);
* ``megareshard-eager``: megareshard with ``--no-torch-compile`` (the earlier tables' configuration);

and, on request (``--variants``), ``megareshard-fast-unfused-ce`` (no ``--cross-entropy-loss-fusion``), ``hf-eager``. Every variant runs the
same micro and global batch, gradient clipping at 1.0, dropout 0, mock tokens.

One FLOP count for all: Megatron-LM's model FLOPs (``models/gpt.py: gpt_flops_per_token``; per token and
layer 2·h·(q + 2·kv) + 2·q·h + 2·h·f·(3 with SwiGLU, else 2) + 4·s·q forward, attention counted non-causal,
plus 2·h·V for the logits, times 3 for forward and backward; q, kv the query and key/value channels, f
the MLP width). TFLOP/s = that × tokens/s; MFU against the datasheet peak (``--peak-tflops``, H100 SXM
dense bf16: 989) and against the bf16 matrix-product rate measured at the start of the same run.

Each model runs in its own process, its variants one after another: megareshard eager, then the fast path
compiling that same model in place (one initialisation for both), then transformers (a crash costs that
model's remaining variants, which are recorded as such). Every point is recorded in the JSON as soon as it starts, finished or
not, and the JSON is rewritten after every point. A deadline (``--deadline-s``, counted from the start of the
grid) bounds the grid: each model gets an equal share of the time left, and a variant that cannot start
within its model's share is recorded as skipped. Steady-state time per iteration is the median of the timed
iterations after the warm-up ones; compile time is the first iteration's time less that median; peak memory
is the allocator's peak over the timed iterations.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from lab import ROOT

ROOT = str(ROOT)
# (name, family, megareshard model flags, micro batch, global batch): fixed before running
GRID = [
    ("gpt-125m", "gpt", "--num-layers 12 --hidden-size 768 --num-attention-heads 12", 8, 32),
    ("gpt-350m", "gpt", "--num-layers 24 --hidden-size 1024 --num-attention-heads 16", 8, 32),
    ("gpt-760m", "gpt", "--num-layers 24 --hidden-size 1536 --num-attention-heads 16", 4, 16),
    ("gpt-1.3b", "gpt", "--num-layers 24 --hidden-size 2048 --num-attention-heads 16", 4, 16),
    ("llama-1.2b", "llama", "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
     "--num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope "
     "--untie-embeddings-and-output-weights --disable-bias-linear", 4, 16),
]
SEQ, VOCAB = 2048, 50304
TINY_GRID = [
    ("gpt-tiny", "gpt", "--num-layers 2 --hidden-size 64 --num-attention-heads 4", 2, 4),
    ("llama-tiny", "llama", "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
     "--num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
     "--untie-embeddings-and-output-weights --disable-bias-linear", 2, 4),
]
TINY_SEQ, TINY_VOCAB = 64, 512
MEGARESHARD_VARIANTS = {
    "megareshard-fast": ["--torch-compile", "--cross-entropy-loss-fusion", "--attention-backend", "auto"],
    "megareshard-eager": ["--no-torch-compile"],
    "megareshard-fast-unfused-ce": ["--torch-compile"],
}
HF_VARIANTS = ("hf-compile", "hf-eager")
DEFAULT_VARIANTS = ("megareshard-eager", "megareshard-fast", "hf-compile")
#: seconds a variant needs at least to be worth starting (start-up, compile, a few iterations)
MIN_START_S = {"megareshard-eager": 15.0, "hf-eager": 15.0}
MIN_START_COMPILED_S = 30.0
FLOP_FORMULA = ("Megatron-LM model FLOPs per token: 3 × [layers × (2·h·(q + 2·kv) + 2·q·h + 2·h·f·m + 4·s·q) "
                "+ 2·h·V], m = 3 with SwiGLU else 2, attention counted non-causal (models/gpt.py)")


# ---- the parts that need no model ---------------------------------------------------------------------
def _run(cmd: list[str], log: str, timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, **(env or {})))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = [x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        rc, text = 124, f"{out[0]}{out[1]}\n[timed out after {timeout:.0f} s]"
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n" + text)
    return rc, text, time.perf_counter() - t0


def ceilings(device: str) -> dict:
    """The device and its measured ceilings: a bf16 matrix product's rate (8192³ on CUDA; fp32 512³ on CPU)
    and a device copy's bandwidth."""
    import torch

    if device != "cuda":
        n = 512
        a, b = (torch.randn(n, n) for _ in range(2))
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return {"torch": torch.__version__, "device": "cpu", "fp32_matmul_tflops": 2 * n ** 3 / min(times) / 1e12}
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    rec = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": props.name,
           "sm_count": props.multi_processor_count, "memory_gib": props.total_memory / 2**30}
    n = 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    rec["bf16_matmul_tflops"] = 2 * n**3 / times[len(times) // 2] / 1e12
    x = torch.randn(2**28, device=dev)           # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    rec["copy_tb_per_s"] = 2 * x.numel() * 4 * 10 / (time.perf_counter() - t0) / 1e12
    return rec


def losses(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"lm loss: ([0-9.E+-]+)", text)]


def bf16_path(out: str) -> dict:
    """fp32 and bf16 runs of one small GPT on the GPU (mock data: the loss stays near ln(vocab), so this
    compares the arithmetic, not learning; tests/test_bf16_convergence.py checks learning); bf16
    interrupted at 10 and resumed must equal the whole run bitwise. The default path on CUDA: compiled."""
    base = [sys.executable, "pretrain_gpt.py", "--mock-data", "--device", "cuda", "--num-layers", "4",
            "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512", "--vocab-size", "8192",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "20", "--lr", "3e-4",
            "--lr-warmup-iters", "2", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
    rec: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpu-ckpt-") as tmp:
        runs = {"fp32": base, "bf16": base + ["--bf16"],
                "bf16_first_half": base + ["--bf16", "--save", tmp, "--exit-interval", "10"],
                "bf16_resumed": base + ["--bf16", "--load", tmp]}
        for name, cmd in runs.items():
            rc, text, secs = _run(cmd, os.path.join(out, f"bf16_{name}.log"), 300, {"WANDB_MODE": "disabled"})
            rec[name] = {"rc": rc, "seconds": round(secs, 1), "loss": losses(text)}
    whole, resumed = rec["bf16"]["loss"], rec["bf16_first_half"]["loss"] + rec["bf16_resumed"]["loss"]
    rec["resume_bitwise_equal"] = len(whole) == 20 and whole == resumed
    f32, b16 = rec["fp32"]["loss"], rec["bf16"]["loss"]
    rec["max_rel_diff_bf16_vs_fp32"] = (max(abs(a - b) / abs(a) for a, b in zip(f32, b16))
                                        if len(f32) == len(b16) == 20 else None)
    return rec


# ---- one model's variants, in a worker process ----------------------------------------------------------
def _model_config(spec: dict, variant_flags: list[str]):
    """megareshard's Config for this grid point and variant (mock tokens, bf16, dropout 0; data for two variants'
    iterations: megareshard-fast continues megareshard-eager's run)."""
    from megareshard.arguments import parse_args

    argv = (spec["flags"].split() + ["--seq-length", str(spec["seq"]), "--max-position-embeddings", str(spec["seq"]),
            "--vocab-size", str(spec["vocab"]), "--micro-batch-size", str(spec["mbs"]), "--global-batch-size",
            str(spec["gbs"]), "--train-iters", str(2 * (spec["warmup"] + spec["iters"])), "--mock-data", "--bf16",
            "--device", spec["device"], "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "3e-4",
            "--lr-warmup-iters", "1", "--log-interval", "1000000", "--eval-interval", "0"] + variant_flags)
    if spec["compile_backend"] != "inductor" and "--torch-compile" in variant_flags:
        argv += ["--torch-compile-backend", spec["compile_backend"]]
    return parse_args(argv, world_size=1)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float:
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # CPU: the process's max RSS


def _timed(step, spec: dict) -> dict:
    """Run ``step()`` warm-up + timed times; the times, the compile estimate, the timed iterations' peak memory."""
    device, times = spec["device"], []
    for i in range(spec["warmup"] + spec["iters"]):
        if i == spec["warmup"]:
            _peak_reset(device)
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    steady = statistics.median(times[spec["warmup"]:])
    return {"seconds_per_iter": steady, "first_iter_s": times[0], "compile_s": max(times[0] - steady, 0.0),
            "iter_s": [round(t, 4) for t in times], "peak_mem_gib": _peak_gib(device)}


def _run_megareshard(spec: dict, variant: str, shared: dict) -> dict:
    """Train with megareshard's Trainer. megareshard-fast after megareshard-eager compiles that run's model in
    place, with the product's own set-up (``fast_path.set_up_fast_path``) and its config's flags, instead of
    building and initialising the model a second time (tens of seconds at 1.3B)."""
    import io

    import torch

    from megareshard.fast_path import set_up_fast_path
    from megareshard.parallel import ParallelContext
    from megareshard.training import Trainer

    cfg = _model_config(spec, MEGARESHARD_VARIANTS[variant])
    trainer = shared.pop("eager", None) if variant == "megareshard-fast" else None
    if trainer is not None:
        trainer.cfg.model.cross_entropy_loss_fusion = cfg.model.cross_entropy_loss_fusion  # the model reads it
        trainer.fast_path, trainer.compiled_regions = set_up_fast_path(trainer.model, cfg, trainer.device,
                                                                       spec["mbs"], "gpt")
    else:
        trainer = Trainer(cfg, ParallelContext.single_process(), torch.device(spec["device"]), out=io.StringIO())

    def step() -> None:
        trainer.train_step(trainer._microbatches(trainer.train_data, next(trainer._train_iter)))
        trainer.iteration += 1
    rec = _timed(step, spec)
    rec["fast_path"] = trainer.fast_path + [trainer.optimizer.implementation]
    rec["params"] = sum(p.numel() for p in trainer.model.parameters())
    if variant == "megareshard-eager" and "megareshard-fast" in spec["variants"]:
        shared["eager"] = trainer  # megareshard-fast compiles it next
    else:
        trainer.close()
    return rec


def _hf_model(spec: dict):
    """transformers' model of the grid point's shapes (the megareshard config read back), SDPA attention."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    m = _model_config(spec, []).model
    if spec["family"] == "gpt":
        cfg = GPT2Config(vocab_size=m.vocab_size, n_positions=m.max_position_embeddings, n_embd=m.hidden_size,
                         n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size,
                         activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         layer_norm_epsilon=m.norm_epsilon, use_cache=False)
    else:
        cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                          num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                          num_key_value_heads=m.query_groups, max_position_embeddings=m.max_position_embeddings,
                          rms_norm_eps=m.norm_epsilon, tie_word_embeddings=False, attention_bias=False,
                          mlp_bias=False, use_cache=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _run_hf(spec: dict, variant: str) -> dict:
    import torch

    device = torch.device(spec["device"])
    with device:
        model = _hf_model(spec)
    model.train()
    if variant == "hf-compile":
        kw = dict(backend=spec["compile_backend"], dynamic=False)
        if spec["hf_compile"] == "full":
            model.compile(**kw)
        else:  # regional: every decoder layer in place
            for layer in (model.transformer.h if spec["family"] == "gpt" else model.model.layers):
                layer.compile(**kw)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, fused=device.type == "cuda" or None)
    n_micro = spec["gbs"] // spec["mbs"]
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        for _ in range(n_micro):
            x = torch.randint(0, spec["vocab"], (spec["mbs"], spec["seq"]), generator=gen).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec = _timed(step, spec)
    rec["params"] = sum(p.numel() for p in model.parameters())
    rec["hf_compile"] = spec["hf_compile"] if variant == "hf-compile" else None
    return rec


def _graph_breaks() -> int:
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return 0
    return sum(counters["graph_break"].values())


def worker(spec_path: str, result_path: str) -> int:
    """Run one model's variants (spec: a JSON file), one JSON line per variant started and finished."""
    spec = json.load(open(spec_path))
    import torch

    from megareshard.models.gpt import gpt_flops_per_token

    flops_tok = gpt_flops_per_token(_model_config(spec, []).model, spec["seq"])
    tokens = spec["gbs"] * spec["seq"]
    import torch._dynamo
    import torch._functorch.config

    # megareshard's compile sets process-wide compiler settings (models/compile.py: prepare_compiler): every
    # variant starts from torch's own
    configs = [(c, name, getattr(c, name)) for c, names in (
        (torch._dynamo.config, ("recompile_limit", "cache_size_limit", "fail_on_recompile_limit_hit")),
        (torch._functorch.config, ("force_non_lazy_backward_lowering",))) for name in names if hasattr(c, name)]
    shared: dict = {}  # the eager run's trainer, for megareshard-fast to compile
    with open(result_path, "a") as out:
        for variant in spec["variants"]:
            if variant in HF_VARIANTS:
                shared.clear()
            for c, name, value in configs:
                setattr(c, name, value)
            need = MIN_START_S.get(variant, MIN_START_COMPILED_S)
            if time.time() + need > spec["deadline"]:
                out.write(json.dumps({"variant": variant, "status": "skipped",
                                      "error": f"not started: under {need:.0f} s left of this model's share"}) + "\n")
                out.flush()
                continue
            out.write(json.dumps({"variant": variant, "status": "started"}) + "\n")
            out.flush()
            t0, breaks = time.time(), _graph_breaks()
            try:
                rec = _run_hf(spec, variant) if variant in HF_VARIANTS else _run_megareshard(spec, variant, shared)
                tps = tokens / rec["seconds_per_iter"]
                rec.update(status="ok", tokens_per_s=tps, tflops=flops_tok * tps / 1e12,
                           graph_breaks=_graph_breaks() - breaks)
            except Exception as e:  # recorded, and the next variant still runs
                rec = {"status": "failed", "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
                       if str(e).strip() else type(e).__name__}
            rec.update(variant=variant, wall_s=round(time.time() - t0, 1))
            out.write(json.dumps(rec) + "\n")
            out.flush()
            torch._dynamo.reset()
            gc.collect()  # compiled regions hold their modules in reference cycles
            if spec["device"] == "cuda":
                torch.cuda.empty_cache()
    return 0


# ---- the grid, in the parent ------------------------------------------------------------------------------
def _read_results(path: str) -> dict[str, dict]:
    """variant -> its last record (a variant started but never finished stays 'started')."""
    got: dict[str, dict] = {}
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line:
                rec = json.loads(line)
                got[rec["variant"]] = rec
    return got


def speed_grid(out: str, a: argparse.Namespace, ceiling: float | None, recs: list[dict], save) -> None:
    grid = TINY_GRID if a.tiny else GRID
    if a.models:
        grid = [g for g in grid if g[0] in a.models.split(",")]
    seq, vocab = (TINY_SEQ, TINY_VOCAB) if a.tiny else (SEQ, VOCAB)
    variants = a.variants.split(",")
    start = time.time()
    for i, (name, family, flags, mbs, gbs) in enumerate(grid):
        share = (start + a.deadline_s - time.time()) / (len(grid) - i)  # an equal share of what is left
        spec = {"model": name, "family": family, "flags": flags, "mbs": mbs, "gbs": gbs, "seq": seq, "vocab": vocab,
                "device": a.device, "variants": variants, "warmup": a.warmup, "iters": a.iters,
                "compile_backend": a.compile_backend, "hf_compile": a.hf_compile, "deadline": time.time() + share}
        base = {"model": name, "flags": flags, "micro_batch": mbs, "global_batch": gbs, "seq_length": seq,
                "vocab": vocab}
        mine = [dict(base, variant=v, status="started") for v in variants]
        recs.extend(mine)  # every point is on record before it runs
        save()
        if share < min(MIN_START_S.get(v, MIN_START_COMPILED_S) for v in variants):
            for rec in mine:
                rec.update(status="skipped", error=f"not started: {max(share, 0):.0f} s left for this model")
            save()
            continue
        spec_path, result_path = (os.path.join(out, f"speed_{name}.{ext}") for ext in ("spec.json", "jsonl"))
        json.dump(spec, open(spec_path, "w"))
        if os.path.exists(result_path):
            os.remove(result_path)
        rc, text, secs = _run([sys.executable, "-m", "lab.bench.gpu_checks", "--worker", spec_path, result_path],
                              os.path.join(out, f"speed_{name}.log"), max(share, 1.0) + 60,
                              {"WANDB_MODE": "disabled", "PYTHONPATH": ROOT})
        got = _read_results(result_path)
        for rec in mine:
            r = got.get(rec["variant"])
            if r is None or r.get("status") == "started":
                last = text.strip().splitlines()[-1] if text.strip() else "no output"
                rec.update(status="failed" if r is not None else "not reached",
                           error=f"worker exit {rc} after {secs:.0f} s: {last[:300]}")
                continue
            rec.update(r)
            if r.get("status") == "ok":
                rec["mfu_vs_peak"] = r["tflops"] / a.peak_tflops
                rec["mfu_vs_measured"] = r["tflops"] / ceiling if ceiling else None
        by = {r["variant"]: r for r in mine}
        hf = by.get("hf-compile", {})
        for rec in mine:
            if rec.get("status") == "ok" and hf.get("status") == "ok":
                rec["vs_hf_compile"] = rec["tokens_per_s"] / hf["tokens_per_s"]
        save()
        print("[gpu_checks] " + name + ": " + ", ".join(
            f"{r['variant']} " + (f"{r['tokens_per_s']:.0f} tok/s {r['tflops']:.0f} TFLOP/s" if r.get("status") == "ok"
                                  else r.get("status", "?")) for r in mine), flush=True)


def table(recs: list[dict]) -> str:
    """The grid as a Markdown table (docs/benchmarks.md)."""
    rows = ["| model | variant | tokens/s | TFLOP/s | MFU vs peak | vs measured | vs HF compile | peak GiB | "
            "compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        if r.get("status") != "ok":
            rows.append(f"| {r['model']} | {r['variant']} | {r.get('status')}: {r.get('error', '')} | | | | | | |")
            continue
        vs = f"{r['vs_hf_compile']:.2f}×" if r.get("vs_hf_compile") else "-"
        meas = f"{100 * r['mfu_vs_measured']:.1f}%" if r.get("mfu_vs_measured") else "-"
        rows.append(f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['tflops']:.0f} | "
                    f"{100 * r['mfu_vs_peak']:.1f}% | {meas} | {vs} | {r['peak_mem_gib']:.1f} | {r['compile_s']:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for gpu_checks.json and the logs")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="datasheet dense bf16 peak per device")
    p.add_argument("--skip", default="", help="comma list of parts to skip: tests,bf16,speed")
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (aot_eager compiles), to check this "
                                                       "script without a GPU; implies --skip tests,bf16")
    p.add_argument("--models", default="", help="comma list of grid models to run (default: all)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma list, in order, of {', '.join([*MEGARESHARD_VARIANTS, *HF_VARIANTS])}")
    p.add_argument("--hf-compile", default="regional", choices=("regional", "full"),
                   help="hf-compile: every decoder layer compiled (regional) or the whole model (full)")
    p.add_argument("--deadline-s", type=float, default=480.0, help="seconds the speed grid may take in all")
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations per variant (the first compiles)")
    p.add_argument("--iters", type=int, default=4, help="timed iterations per variant")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    if not a.out:
        p.error("--out DIR is required")
    unknown = set(a.variants.split(",")) - set(MEGARESHARD_VARIANTS) - set(HF_VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {', '.join(sorted(unknown))}")
    a.device = "cpu" if a.tiny else "cuda"
    a.compile_backend = "aot_eager" if a.tiny else "inductor"
    os.makedirs(a.out, exist_ok=True)
    skip = set(a.skip.split(",")) - {""} | ({"tests", "bf16"} if a.tiny else set())
    result = {"ceilings": ceilings(a.device), "peak_tflops": a.peak_tflops, "flop_formula": FLOP_FORMULA}

    def save() -> None:  # after every point: a run cut off at its limit keeps what it finished
        with open(os.path.join(a.out, "gpu_checks.json"), "w") as f:
            json.dump(result, f, indent=1)

    print(f"[gpu_checks] {json.dumps(result['ceilings'])}", flush=True)
    save()
    if "tests" not in skip:
        rc, text, secs = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               "tests/test_gpt_model.py", "tests/test_bf16_convergence.py", "tests/test_mixed_precision.py",
                               "tests/test_fast_path.py::test_inductor_on_cuda_matches_eager"],
                              os.path.join(a.out, "pytest_cuda.log"), 400, {"WANDB_MODE": "disabled"})
        summary = text.strip().splitlines()[-1] if text.strip() else ""
        result["cuda_tests"] = {"rc": rc, "summary": summary, "seconds": round(secs, 1)}
        print(f"[gpu_checks] tests: {summary}", flush=True)
        save()
    if "bf16" not in skip:
        result["bf16_path"] = bf16_path(a.out)
        print(f"[gpu_checks] bf16: resume bitwise {result['bf16_path']['resume_bitwise_equal']}, "
              f"max rel diff vs fp32 {result['bf16_path']['max_rel_diff_bf16_vs_fp32']}", flush=True)
        save()
    if "speed" not in skip:
        result["speed"] = {"hf_compile": a.hf_compile, "warmup": a.warmup, "iters": a.iters,
                           "deadline_s": a.deadline_s, "points": []}
        speed_grid(a.out, a, result["ceilings"].get("bf16_matmul_tflops"), result["speed"]["points"], save)
        print(table(result["speed"]["points"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
