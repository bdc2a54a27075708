#!/usr/bin/env python
"""Everything that needs one CUDA GPU (issue #53), in one run on one card, the most important first: the bf16 path's
determinism, the speed grid against a lean single-file peer, every ``--torch-compile-mode`` that ``--help`` offers.

    python -m lab.bench.gpu_checks --out DIR                      # DIR/gpu_checks.json, DIR/*.log (about 540 s)
    python -m lab.bench.gpu_checks --out DIR --skip determinism,compile_modes --deadline-s 540   # the grid alone
    python -m lab.bench.gpu_checks --out DIR --tiny               # the same machinery on CPU, tiny models

``--tiny`` runs every part on CPU with tiny shapes: the determinism runs on ``--device cpu`` (not compiled: the
CPU default), the grid's megareshard-cli and lean-compile with torch.compile's aot_eager backend, the compile
modes with aot_eager (which runs the default mode only: the others are refused for that backend).

Parts 1 and 3 are in ``gpu_determinism.py``, what the parts share in ``gpu_common.py``, the lean peer in
``lean_peer.py``, the profile's analysis in ``gpu_profile.py``. The JSON is rewritten as soon as any run or point
finishes, so a run cut off at its limit keeps what it finished; every run's command, return code, seconds and log
(DIR/*.log) are in it. The parts, in this order:

1. **determinism** (``--determinism-budget-s``, 240 s): ``pretrain_gpt.py`` on a small GPT (4 layers, hidden 512,
   8 heads, sequence 512, vocabulary 8192, micro batch 4, global batch 8, 20 iterations, ``--bf16``) as a user
   runs it: torch.compile on (the default on CUDA) and **Megatron's default dropout 0.1** (no dropout flags).
   (a) the same command twice: ``same_command_bitwise_equal`` (the 20 printed ``lm loss:`` and ``grad norm:``
   fields equal); (b) ``--save D --exit-interval 10`` then ``--load D``: ``resume_bitwise_equal`` with the
   uninterrupted run; (c) the same pair again with ``--deterministic-mode`` (``deterministic_mode``); then the
   fp32 run (``max_rel_diff_bf16_vs_fp32``: mock tokens keep the loss near ln V, so this compares the arithmetic).
   Each run's attention kernel is read from its start-up line (``fast path: attention ...``), and whether the
   resumed run reused the checkpoint's recorded choice (``as recorded in``). H200 estimate (the earlier H200 runs:
   megareshard's regional compile 7-13 s cold, 3 s from inductor's cache): the first run 30-40 s (process start,
   imports, CUDA, attention measured, compiling cold), the runs of the same graphs after it 15-20 s each, the first
   deterministic-mode and the fp32 run compile again (25-35 s each): 150-200 s for all nine. A run that cannot
   start within the budget is recorded as skipped.
2. **speed** (until ``--compile-modes-reserve-s`` before the deadline): the grid, fixed before running, in the
   issue's order: GPT 125M, GPT 1.3B, the Llama-style "1.2B" (ffn 5632, GQA 32/8, 16 layers: 0.93 B parameters
   with this vocabulary; the name is the earlier tables'), GPT 350M (760M only with ``--models``);
   sequence 2048, vocabulary 50304, bf16, the micro and global batch of `GRID`, mock tokens, dropout 0, gradient
   clipping 1.0, AdamW. A first round runs ``--variants`` (default ``megareshard-cli``, then ``lean-compile``)
   model by model, a second round ``--late-variants`` (default ``megareshard-cli-model``, then ``hf-compile``) over
   the models in the time left.
   The models run by priority: each may use all the time left, a variant that cannot start with
   ``MIN_START_S`` left is recorded as skipped. H200 estimates (start-up and compiling dominate; the timed
   iterations take seconds): megareshard-cli 25-45 s (process start and imports about 10 s, at 1.3B the model's
   build and initialisation 10-20 s, compiling 7-13 s, the 125M trace's export a few seconds), lean-compile 30-60 s
   (the whole unrolled model compiled cold: not measured before), hf-compile 10-15 s: about 60 s for 125M, 100 s
   each for 1.3B and the Llama, 80 s for 350M, 60 s for the hf-compile round: more than the default deadline
   leaves after the determinism part, so 350M and the hf-compile round may be recorded as skipped (run the grid
   alone, ``--skip determinism,compile_modes``, to get them all).
3. **compile_modes** (the rest, at least ``--compile-modes-reserve-s``, 90 s): the small model of part 1 for 5
   iterations under every mode ``pretrain_gpt.py --help`` offers for ``--torch-compile-mode`` (read from
   megareshard's parser): rc, losses, whether it trained, seconds; a mode refused with one line (the CUDA-graph
   modes, ``compile_config.CUDA_GRAPH_MODES``, run first) is recorded as ``refused`` with that line. H200
   estimate: the refused ones under 1 s each, default 15 s (the determinism part's graphs, from the cache),
   max-autotune-no-cudagraphs 60-120 s (autotuning the GEMMs; a guess). A mode that cannot start with 30 s left
   is recorded as skipped.
4. **tests** (only with ``--parts``): the CUDA tests (pytest, up to 400 s).

**The speed grid's variants** (every one the same shapes, batch, clipping, dropout 0 and mock tokens):

* ``megareshard-cli`` (the megareshard number; "the number a user sees is the one that counts"): the point run
  by ``python pretrain_gpt.py --mock-data --device cuda --bf16 <model flags> --seq-length 2048
  --max-position-embeddings 2048 --vocab-size 50304 --micro-batch-size M --global-batch-size G
  --cross-entropy-loss-fusion --hidden-dropout 0 --attention-dropout 0 --train-iters W+I --log-interval 1
  --eval-interval 0`` in its own process as a user launches it (torch.compile by its default: on with CUDA), its
  tokens/s read from its log lines (``tokens/s:``, the trainer's own count); steady state is the median over the
  ``--iters`` iterations after the ``--warmup`` ones. The command line is in the JSON. For ``--profile-model``
  (GPU default: gpt-125m) two iterations more run under Megatron's ``--profile --profile-step-start
  --profile-step-end --tensorboard-dir`` (after the timed ones, left out of the median): the chrome trace's path
  is ``profile_trace``.
* ``megareshard-cli-model``: the same launch with ``--torch-compile-scope model`` (the whole GPT as one graph
  instead of each layer and the loss head: design.md §5b), profiled the same way; whether it beats the default
  scope, and at which size, is what this point measures.
* ``lean-compile``: our lean single-file peer (``lab/bench/lean_peer.py``: nanoGPT-style GPT or Llama-style
  decoder, fp32 parameters under bf16 autocast, SDPA causal attention, ``F.cross_entropy``, fused AdamW with
  megareshard's defaults, clipping at 1.0, the whole model under one torch.compile); ``lean-eager`` on request.
* ``hf-compile``: Hugging Face transformers' ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` of the same shapes, SDPA,
  fp32 parameters under bf16 autocast, fused AdamW, torch.compile per decoder layer (``--hf-compile full``: the
  whole model); ``hf-eager`` on request.
* in-process megareshard on request: ``megareshard-fast`` (the Trainer's step with the fast path: regional
  torch.compile, ``--cross-entropy-loss-fusion``, ``--attention-backend auto``), ``megareshard-eager``
  (``--no-torch-compile``), ``megareshard-fast-unfused-ce``.

Every ok point has ``vs_lean`` (its tokens/s over lean-compile's, same model and run) and ``vs_hf_compile``. One
FLOP count for all: Megatron-LM's model FLOPs (``models/gpt.py: gpt_flops_per_token``; per token and layer
2·h·(q + 2·kv) + 2·q·h + 2·h·f·(3 with SwiGLU, else 2) + 4·s·q forward, attention counted non-causal, plus 2·h·V
for the logits, times 3 for forward and backward). TFLOP/s = that × tokens/s; MFU against the datasheet peak
(``--peak-tflops``, H100/H200 SXM dense bf16: 989) and against the bf16 matrix-product rate measured at the start.
The issue's targets (``TARGETS``, in the JSON): megareshard ≥ 1.0× lean-compile at 125M, 350M, 1.3B and the Llama
1.2B; MFU ≥ 45 % at 125M and ≥ 55 % at 1.3B against 989 TFLOP/s.

The in-process variants of one model run in one worker process (``--worker``), one after another (a crash costs
that model's remaining variants, recorded as such); the in-process steady state is the median of the timed
iterations after the warm-up ones, compile time the first iteration's time less that median, peak memory the
allocator's peak over the timed iterations.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import re
import shlex
import statistics
import sys
import time

from lab.bench.gpu_common import (ENV, ROOT, TINY_MIN_START_S, _error_line, _run, ceilings, fast_path_line,
                                  log_iterations)
from lab.bench.gpu_determinism import DETERMINISM_RUNS, compile_mode_choices, compile_modes, determinism

# (name, family, megareshard model flags, micro batch, global batch): fixed before running, in the order
GRID = [
    ("gpt-125m", "gpt", "--num-layers 12 --hidden-size 768 --num-attention-heads 12", 8, 32),
    ("gpt-1.3b", "gpt", "--num-layers 24 --hidden-size 2048 --num-attention-heads 16", 4, 16),
    ("llama-1.2b", "llama", "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
     "--num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope "
     "--untie-embeddings-and-output-weights --disable-bias-linear --ffn-hidden-size 5632", 4, 16),
    ("gpt-350m", "gpt", "--num-layers 24 --hidden-size 1024 --num-attention-heads 16", 8, 32),
    ("gpt-760m", "gpt", "--num-layers 24 --hidden-size 1536 --num-attention-heads 16", 4, 16),
]
DEFAULT_MODELS = ("gpt-125m", "gpt-1.3b", "llama-1.2b", "gpt-350m")
SEQ, VOCAB = 2048, 50304
TINY_GRID = [
    ("gpt-tiny", "gpt", "--num-layers 2 --hidden-size 64 --num-attention-heads 4", 2, 4),
    ("llama-tiny", "llama", "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
     "--num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
     "--untie-embeddings-and-output-weights --disable-bias-linear --ffn-hidden-size 96", 2, 4),
]
TINY_SEQ, TINY_VOCAB = 64, 512
#: the issue's targets (#53 part 2), fixed before running
TARGETS = {"vs_lean": {"gpt-125m": 1.0, "gpt-350m": 1.0, "gpt-1.3b": 1.0, "llama-1.2b": 1.0},
           "mfu_vs_peak": {"gpt-125m": 0.45, "gpt-1.3b": 0.55}}
CLI_VARIANT = "megareshard-cli"
#: megareshard-cli with these flags added: the same launch, another choice a user can make
CLI_VARIANTS = {CLI_VARIANT: [], "megareshard-cli-model": ["--torch-compile-scope", "model"]}
MEGARESHARD_VARIANTS = {
    "megareshard-fast": ["--torch-compile", "--cross-entropy-loss-fusion", "--attention-backend", "auto"],
    "megareshard-eager": ["--no-torch-compile"],
    "megareshard-fast-unfused-ce": ["--torch-compile"],
}
LEAN_VARIANTS = ("lean-compile", "lean-eager")
HF_VARIANTS = ("hf-compile", "hf-eager")
ALL_VARIANTS = (*CLI_VARIANTS, *LEAN_VARIANTS, *MEGARESHARD_VARIANTS, *HF_VARIANTS)
DEFAULT_VARIANTS = (CLI_VARIANT, "lean-compile")
DEFAULT_LATE_VARIANTS = ("megareshard-cli-model", "hf-compile")
#: seconds a variant needs at least to be worth starting on the GPU (start-up, compile, a few iterations)
MIN_START_S = {"megareshard-eager": 15.0, "hf-eager": 15.0, "lean-eager": 15.0, "hf-compile": 45.0}
MIN_START_COMPILED_S = 35.0
PROFILED_ITERS = 2  # --profile-model: iterations after the timed ones, under the profiler
PARTS = ("determinism", "speed", "compile_modes", "tests")
DEFAULT_PARTS = ("determinism", "speed", "compile_modes")
FLOP_FORMULA = ("Megatron-LM model FLOPs per token: 3 × [layers × (2·h·(q + 2·kv) + 2·q·h + 2·h·f·m + 4·s·q) "
                "+ 2·h·V], m = 3 with SwiGLU else 2, attention counted non-causal (models/gpt.py)")


def _min_start(variant: str, tiny: bool) -> float:
    return TINY_MIN_START_S if tiny else MIN_START_S.get(variant, MIN_START_COMPILED_S)


# ---- part 2: one model's variants, in a worker process -----------------------------------------------------
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
    """Train with megareshard's Trainer in this process. megareshard-fast after megareshard-eager compiles that
    run's model in place, with the product's own set-up (``fast_path.set_up_fast_path``) and its config's flags,
    instead of building and initialising the model a second time (tens of seconds at 1.3B)."""
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


def cli_command(spec: dict, profile_dir: str | None, variant: str = CLI_VARIANT) -> list[str]:
    """The grid point as a user launches it: ``python pretrain_gpt.py ...`` (torch.compile by its default on CUDA;
    the tiny CPU variant asks for it, with the tiny backend), the variant's own flags (`CLI_VARIANTS`); Megatron's
    profiler flags when ``profile_dir``."""
    n = spec["warmup"] + spec["iters"]
    cmd = [sys.executable, "pretrain_gpt.py", "--mock-data", "--device", spec["device"], "--bf16",
           *spec["flags"].split(), "--seq-length", str(spec["seq"]), "--max-position-embeddings", str(spec["seq"]),
           "--vocab-size", str(spec["vocab"]), "--micro-batch-size", str(spec["mbs"]), "--global-batch-size",
           str(spec["gbs"]), "--cross-entropy-loss-fusion", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--lr", "3e-4", "--lr-warmup-iters", "1", "--train-iters", str(n + (PROFILED_ITERS if profile_dir else 0)),
           "--log-interval", "1", "--eval-interval", "0", *CLI_VARIANTS[variant]]
    if spec["device"] != "cuda":
        cmd += ["--torch-compile", "--torch-compile-backend", spec["compile_backend"]]
    if profile_dir:
        cmd += ["--profile", "--profile-step-start", str(n), "--profile-step-end", str(n + PROFILED_ITERS),
                "--tensorboard-dir", profile_dir]
    return cmd


def _profile_summary(trace: str, stem: str) -> dict:
    """lab.bench.gpu_profile's summary of the profiled iterations (STEM_summary.json in full, STEM.png drawn); the
    summary less its timeline goes into the point's record. A failed analysis is recorded, not raised: the
    point's timing stands without it."""
    try:
        from lab.bench import gpu_profile

        summary = gpu_profile.summarize(trace, iterations=PROFILED_ITERS)
        with open(stem + "_summary.json", "w") as f:
            json.dump(summary, f)
        gpu_profile.draw(summary, stem + ".png")
        return {k: v for k, v in summary.items() if k != "timeline"} | {"png": stem + ".png"}
    except Exception as e:  # pragma: no cover - recorded with the point
        return {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}


def _run_cli(spec: dict, variant: str = CLI_VARIANT) -> dict:
    """megareshard-cli (and its `CLI_VARIANTS`): ``pretrain_gpt.py`` in its own process; tokens/s as its log lines
    give them, the median over the timed iterations (after the warm-up ones, before the profiled ones)."""
    name = spec["model"]
    tag = "" if variant == CLI_VARIANT else variant[len(CLI_VARIANT):]   # e.g. "-model"
    profile_dir, why_not = None, None
    if spec.get("profile"):
        try:  # --tensorboard-dir writes event files with it
            importlib.import_module("torch.utils.tensorboard")
            profile_dir = os.path.join(spec["out"], f"profile_{name}{tag}")
        except Exception as e:  # pragma: no cover - tensorboard missing on the machine
            why_not = f"not profiled: torch.utils.tensorboard does not import ({type(e).__name__}: {e})"
    cmd = cli_command(spec, profile_dir, variant)
    log = os.path.join(spec["out"], f"speed_{name}_cli{tag}.log")
    rc, text, secs = _run(cmd, log, max(spec["deadline"] + 20 - time.time(), 10), {**ENV, "PYTHONPATH": ROOT})
    its = log_iterations(text)
    w, n = spec["warmup"], spec["iters"]
    timed = [r for r in its if w < r["iteration"] <= w + n]
    rec: dict = {"command": shlex.join(cmd), "log": log, "rc": rc, "process_s": round(secs, 1),
                 "fast_path": fast_path_line(text), "logged_iterations": len(its),
                 "iter_s": [round(r["ms"] / 1e3, 4) for r in its if "ms" in r],
                 "logged_tokens_per_s": [r.get("tokens_per_s") for r in its]}
    if why_not:
        rec["profile_trace"], rec["profile_note"] = None, why_not
    elif profile_dir:
        trace = os.path.join(profile_dir, "profile_rank0.json")
        rec["profile_trace"] = trace if os.path.exists(trace) else None
        rec["profiled_iterations"] = [w + n + 1, w + n + PROFILED_ITERS]
        if rec["profile_trace"]:
            rec["profile"] = _profile_summary(trace, os.path.join(spec["out"], f"profile_{name}{tag}"))
    if rc != 0 or len(timed) < n or any("tokens_per_s" not in r for r in timed):
        rec.update(status="failed", error=f"rc {rc}, {len(timed)} of {n} timed iterations logged: {_error_line(text)}")
        return rec
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    first = its[0]["ms"] / 1e3
    setup = re.search(r"set-up done in ([0-9.]+) s", text)
    compiling = re.search(r"torch\.compile: about ([0-9.]+) s of the first iteration was compiling", text)
    peak = re.search(r"peak memory per pipeline stage \(MiB[^)]*\): stage 0 ([0-9.]+)", text)
    rec.update(tokens_per_s=tps, seconds_per_iter=spec["gbs"] * spec["seq"] / tps, first_iter_s=first,
               compile_s=float(compiling.group(1)) if compiling else max(first - spec["gbs"] * spec["seq"] / tps, 0),
               setup_s=float(setup.group(1)) if setup else None,
               logged_tflops_per_rank=statistics.median(r.get("tflops_per_rank", 0.0) for r in timed),
               peak_mem_gib=float(peak.group(1)) / 1024 if peak else None)
    return rec


def _run_lean(spec: dict, variant: str) -> dict:
    """Our lean single-file peer (lab/bench/lean_peer.py) of the grid point's shapes."""
    import torch

    from lab.bench import lean_peer

    backend = spec["compile_backend"] if variant == "lean-compile" else None
    model, step = lean_peer.build(_model_config(spec, []), spec["family"], torch.device(spec["device"]),
                                  compile_backend=backend)
    rec = _timed(step, spec)
    rec["params"] = sum(p.numel() for p in model.parameters())
    rec["compile"] = f"the whole model, backend {backend}" if backend else None
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
            if variant not in MEGARESHARD_VARIANTS:
                shared.clear()
            for c, name, value in configs:
                setattr(c, name, value)
            need = _min_start(variant, spec["device"] != "cuda")
            if time.time() + need > spec["deadline"]:
                out.write(json.dumps({"variant": variant, "status": "skipped",
                                      "error": f"not started: under {need:.0f} s left of the grid's time"}) + "\n")
                out.flush()
                continue
            out.write(json.dumps({"variant": variant, "status": "started"}) + "\n")
            out.flush()
            t0, breaks = time.time(), _graph_breaks()
            try:
                if variant in CLI_VARIANTS:
                    rec = _run_cli(spec, variant)
                elif variant in LEAN_VARIANTS:
                    rec = _run_lean(spec, variant)
                elif variant in HF_VARIANTS:
                    rec = _run_hf(spec, variant)
                else:
                    rec = _run_megareshard(spec, variant, shared)
                if rec.get("status") != "failed":
                    tps = rec.get("tokens_per_s") or tokens / rec["seconds_per_iter"]
                    rec.update(status="ok", tokens_per_s=tps, tflops=flops_tok * tps / 1e12,
                               graph_breaks=None if variant in CLI_VARIANTS else _graph_breaks() - breaks)
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


# ---- part 2: the grid, in the parent ------------------------------------------------------------------------
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


def ratios(recs: list[dict]) -> None:
    """Every ok point's tokens/s over its model's lean-compile (``vs_lean``) and hf-compile (``vs_hf_compile``)
    of the same run, and, for the megareshard points, whether the issue's targets are met."""
    for rec in recs:
        if rec.get("status") != "ok":
            continue
        for key, peer in (("vs_lean", "lean-compile"), ("vs_hf_compile", "hf-compile")):
            ref = next((r for r in recs if r["model"] == rec["model"] and r["variant"] == peer
                        and r.get("status") == "ok"), None)
            if ref is not None:
                rec[key] = rec["tokens_per_s"] / ref["tokens_per_s"]
        if rec["variant"].startswith("megareshard"):
            want = TARGETS["vs_lean"].get(rec["model"])
            if want is not None and "vs_lean" in rec:
                rec["meets_vs_lean_target"] = rec["vs_lean"] >= want
            want = TARGETS["mfu_vs_peak"].get(rec["model"])
            if want is not None and rec.get("mfu_vs_peak") is not None:
                rec["meets_mfu_target"] = rec["mfu_vs_peak"] >= want


def speed_grid(out: str, a: argparse.Namespace, until: float, ceiling: float | None, recs: list[dict],
               save) -> None:
    """Part 2: round 1 (``--variants``) model by model, then round 2 (``--late-variants``) in the time left; each
    model's variants of a round in one worker process; every point on record before it runs."""
    grid = TINY_GRID if a.tiny else GRID
    names = a.models.split(",") if a.models else [g[0] for g in grid if a.tiny or g[0] in DEFAULT_MODELS]
    unknown = set(names) - {g[0] for g in grid}
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(sorted(unknown))}; known: {', '.join(g[0] for g in grid)}")
    grid = sorted((g for g in grid if g[0] in names), key=lambda g: names.index(g[0]))
    seq, vocab = (TINY_SEQ, TINY_VOCAB) if a.tiny else (SEQ, VOCAB)
    rounds = [v for v in (a.variants.split(","), a.late_variants.split(",")) if v != [""]]
    for variants in rounds:
        for name, family, flags, mbs, gbs in grid:
            spec = {"model": name, "family": family, "flags": flags, "mbs": mbs, "gbs": gbs, "seq": seq,
                    "vocab": vocab, "device": a.device, "variants": variants, "warmup": a.warmup, "iters": a.iters,
                    "compile_backend": a.compile_backend, "hf_compile": a.hf_compile, "deadline": until, "out": out,
                    "profile": name in a.profile_model.split(",")}
            base = {"model": name, "flags": flags, "micro_batch": mbs, "global_batch": gbs, "seq_length": seq,
                    "vocab": vocab}
            mine = [dict(base, variant=v, status="started") for v in variants]
            recs.extend(mine)  # every point is on record before it runs
            save()
            left = until - time.time()
            if left < min(_min_start(v, a.tiny) for v in variants):
                for rec in mine:
                    rec.update(status="skipped", error=f"not started: {max(left, 0):.0f} s left of the grid's time")
                save()
                continue
            tag = "late" if variants is not rounds[0] else "main"
            spec_path, result_path = (os.path.join(out, f"speed_{name}_{tag}.{ext}") for ext in ("spec.json", "jsonl"))
            json.dump(spec, open(spec_path, "w"))
            if os.path.exists(result_path):
                os.remove(result_path)
            rc, text, secs = _run([sys.executable, "-m", "lab.bench.gpu_checks", "--worker", spec_path, result_path],
                                  os.path.join(out, f"speed_{name}_{tag}.log"), max(left, 1.0) + 30,
                                  {**ENV, "PYTHONPATH": ROOT})
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
            ratios(recs)
            save()
            print("[gpu_checks] " + name + ": " + ", ".join(
                f"{r['variant']} " + (f"{r['tokens_per_s']:.0f} tok/s {r['tflops']:.0f} TFLOP/s"
                                      if r.get("status") == "ok" else r.get("status", "?")) for r in mine), flush=True)


def table(recs: list[dict]) -> str:
    """The grid as a Markdown table (docs/benchmarks.md)."""
    rows = ["| model | variant | tokens/s | TFLOP/s | MFU vs peak | vs measured | vs lean | vs HF compile | "
            "peak GiB | compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        if r.get("status") != "ok":
            rows.append(f"| {r['model']} | {r['variant']} | {r.get('status')}: {r.get('error', '')} | | | | | | | |")
            continue
        lean = f"{r['vs_lean']:.2f}×" if r.get("vs_lean") else "-"
        vs = f"{r['vs_hf_compile']:.2f}×" if r.get("vs_hf_compile") else "-"
        meas = f"{100 * r['mfu_vs_measured']:.1f}%" if r.get("mfu_vs_measured") else "-"
        peak = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
        rows.append(f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['tflops']:.0f} | "
                    f"{100 * r['mfu_vs_peak']:.1f}% | {meas} | {lean} | {vs} | {peak} | {r['compile_s']:.0f} |")
    return "\n".join(rows)


def cuda_tests(out: str, until: float) -> dict:
    rc, text, secs = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_gpt_model.py", "tests/test_bf16_convergence.py", "tests/test_mixed_precision.py",
                           "tests/test_fast_path.py::test_inductor_on_cuda_matches_eager"],
                          os.path.join(out, "pytest_cuda.log"), max(min(400, until - time.time()), 10), ENV)
    summary = text.strip().splitlines()[-1] if text.strip() else ""
    return {"rc": rc, "summary": summary, "seconds": round(secs, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for gpu_checks.json and the logs")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="datasheet dense bf16 peak per device")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"comma list, run in this order: {', '.join(PARTS)}")
    p.add_argument("--skip", default="", help="comma list of parts to leave out of --parts (bf16 = determinism)")
    p.add_argument("--tiny", action="store_true", help="tiny models on CPU (aot_eager compiles), to check this "
                                                       "script without a GPU (no tests part)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="seconds the whole run may take (after the "
                                                                    "ceilings)")
    p.add_argument("--determinism-budget-s", type=float, default=240.0, help="seconds the determinism part may take")
    p.add_argument("--determinism-runs", default=",".join(DETERMINISM_RUNS), help="comma list of the determinism "
                                                                                  "part's runs, in its order")
    p.add_argument("--compile-modes-reserve-s", type=float, default=90.0,
                   help="seconds the speed grid leaves for the compile modes before the deadline")
    p.add_argument("--compile-modes", default="", help="comma list of the --torch-compile-mode values to run "
                                                       "(default: every one pretrain_gpt.py --help offers)")
    p.add_argument("--models", default="", help="comma list of grid models, in order (default: "
                                                f"{','.join(DEFAULT_MODELS)}; --tiny: all tiny ones)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"the grid's first round, a comma list in order, of {', '.join(ALL_VARIANTS)}")
    p.add_argument("--late-variants", default=",".join(DEFAULT_LATE_VARIANTS),
                   help="the grid's second round over the models, in the time left ('' for none)")
    p.add_argument("--profile-model", default=None, help="comma list of models whose megareshard-cli point also "
                                                         "writes a profiler trace (default gpt-125m; --tiny: none)")
    p.add_argument("--hf-compile", default="regional", choices=("regional", "full"),
                   help="hf-compile: every decoder layer compiled (regional) or the whole model (full)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations per variant (the first compiles)")
    p.add_argument("--iters", type=int, default=4, help="timed iterations per variant")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(*a.worker)
    if not a.out:
        p.error("--out DIR is required")
    unknown = (set(a.variants.split(",")) | set(a.late_variants.split(","))) - set(ALL_VARIANTS) - {""}
    if unknown:
        p.error(f"unknown variant(s) {', '.join(sorted(unknown))}")
    bad = set(a.determinism_runs.split(",")) - set(DETERMINISM_RUNS)
    if bad:
        p.error(f"unknown determinism run(s) {', '.join(sorted(bad))}; known: {', '.join(DETERMINISM_RUNS)}")
    bad = set(a.compile_modes.split(",")) - set(compile_mode_choices()) - {""}
    if bad:
        p.error(f"unknown compile mode(s) {', '.join(sorted(bad))}")
    skip = {"determinism" if s == "bf16" else s for s in a.skip.split(",")} - {""}
    parts = [x for x in a.parts.split(",") if x and x not in skip and not (a.tiny and x == "tests")]
    if set(parts) - set(PARTS):
        p.error(f"unknown part(s) {', '.join(sorted(set(parts) - set(PARTS)))}")
    a.device = "cpu" if a.tiny else "cuda"
    a.compile_backend = "aot_eager" if a.tiny else "inductor"
    if a.profile_model is None:
        a.profile_model = "" if a.tiny else "gpt-125m"
    os.makedirs(a.out, exist_ok=True)
    result: dict = {"ceilings": ceilings(a.device), "peak_tflops": a.peak_tflops, "flop_formula": FLOP_FORMULA,
                    "targets": TARGETS, "parts": parts, "argv": sys.argv[1:] if argv is None else list(argv),
                    "part_seconds": {}}
    start = time.time()
    end = start + a.deadline_s

    def save() -> None:  # after every run and point: a run cut off at its limit keeps what it finished
        tmp = os.path.join(a.out, "gpu_checks.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, os.path.join(a.out, "gpu_checks.json"))

    print(f"[gpu_checks] {json.dumps(result['ceilings'])}", flush=True)
    save()
    for part in parts:
        t0 = time.time()
        reserve = a.compile_modes_reserve_s if "compile_modes" in parts[parts.index(part) + 1:] else 0.0
        if part == "determinism":
            result["determinism"] = {}
            determinism(a.out, a, min(t0 + a.determinism_budget_s, end - reserve), result["determinism"], save)
            d = result["determinism"]
            print(f"[gpu_checks] determinism: same command bitwise {d['same_command_bitwise_equal']}, resume bitwise "
                  f"{d['resume_bitwise_equal']}, with --deterministic-mode {d['deterministic_mode']}, max rel diff "
                  f"vs fp32 {d['max_rel_diff_bf16_vs_fp32']}", flush=True)
        elif part == "speed":
            result["speed"] = {"hf_compile": a.hf_compile, "warmup": a.warmup, "iters": a.iters,
                               "until_s": round(end - reserve - start, 1), "points": []}
            speed_grid(a.out, a, end - reserve, result["ceilings"].get("bf16_matmul_tflops"),
                       result["speed"]["points"], save)
            print(table(result["speed"]["points"]), flush=True)
        elif part == "compile_modes":
            result["compile_modes"] = {}
            compile_modes(a.out, a, max(end, time.time() + 10), result["compile_modes"], save)
        elif part == "tests":
            result["cuda_tests"] = cuda_tests(a.out, end)
            print(f"[gpu_checks] tests: {result['cuda_tests']['summary']}", flush=True)
        result["part_seconds"][part] = round(time.time() - t0, 1)
        save()
    result["total_s"] = round(time.time() - start, 1)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
