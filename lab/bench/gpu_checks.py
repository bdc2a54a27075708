#!/usr/bin/env python
"""Everything that needs one CUDA GPU, in one run: the device's ceilings, the CUDA tests, the bf16
training path (fp32 vs bf16 loss, save and resume bitwise) and a fixed MFU grid.

    python -m lab.bench.gpu_checks --out DIR          # DIR/gpu_checks.json, DIR/*.log

The grid is fixed here, before running; every point started is reported (a failure as an error
record). MFU is given two ways: against the datasheet peak (--peak-tflops, H100 SXM dense bf16:
989) and against the bf16 matrix-product rate measured on this device (the reachable ceiling).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from lab import ROOT, env_with_root

# (name, model flags, micro batch, global batch): fixed before running
GRID = [
    ("gpt-125m", "--num-layers 12 --hidden-size 768 --num-attention-heads 12", 8, 32),
    ("gpt-350m", "--num-layers 24 --hidden-size 1024 --num-attention-heads 16", 8, 32),
    ("gpt-760m", "--num-layers 24 --hidden-size 1536 --num-attention-heads 16", 4, 16),
    ("gpt-1.3b", "--num-layers 24 --hidden-size 2048 --num-attention-heads 16", 4, 16),
    ("llama-1.2b", "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
     "--num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope "
     "--untie-embeddings-and-output-weights --disable-bias-linear", 4, 16),
]
SEQ, VOCAB = 2048, 50304


def _run(cmd: list[str], log: str, timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=env_with_root(**(env or {})))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"{e.stdout or ''}{e.stderr or ''}\n[timed out after {timeout:.0f} s]"
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n" + (text if isinstance(text, str) else text.decode()))
    return rc, text if isinstance(text, str) else text.decode(), time.perf_counter() - t0


def ceilings() -> dict:
    import torch

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
    interrupted at 10 and resumed must equal the whole run bitwise."""
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


def mfu_grid(out: str, peak: float, ceiling: float, recs: list[dict], save) -> None:
    for name, flags, mbs, gbs in GRID:
        js = os.path.join(out, f"mfu_{name}.json")
        cmd = [sys.executable, "-m", "lab.bench.bench_train", "--nproc", "1", "--layouts", "tp1", "--device", "cuda",
               "--bf16", "--seq-length", str(SEQ), "--vocab-size", str(VOCAB), "--micro-batch-size", str(mbs),
               "--global-batch-size", str(gbs), "--iters", "10", "--warmup", "3", "--peak-tflops", str(peak),
               "--json", js] + flags.split()[:6] + [f"--model-args={' '.join(flags.split()[6:])}"]
        rc, text, secs = _run(cmd, os.path.join(out, f"mfu_{name}.log"), 420, {"WANDB_MODE": "disabled"})
        rec = {"model": name, "flags": flags, "micro_batch": mbs, "global_batch": gbs, "seq_length": SEQ,
               "rc": rc, "seconds": round(secs, 1)}
        if rc == 0:
            r = json.load(open(js))[0]
            rec.update(ms_per_iter=r["ms_per_iter"], tokens_per_s=r["tokens_per_s"],
                       tflops=r["tflops_per_rank"], mfu_vs_peak=r["mfu"], mfu_vs_measured=r["tflops_per_rank"] / ceiling)
        else:
            rec["error"] = text.strip().splitlines()[-1] if text.strip() else "no output"
        recs.append(rec)
        save()
        print(f"[gpu_checks] {name}: {rec.get('tflops', 0):.0f} TFLOP/s" if rc == 0 else
              f"[gpu_checks] {name}: failed ({rec['error']})", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_checks.json and the logs")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="datasheet dense bf16 peak per device")
    p.add_argument("--skip", default="", help="comma list of parts to skip: tests,bf16,mfu")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    skip = set(a.skip.split(",")) - {""}
    result = {"ceilings": ceilings(), "peak_tflops": a.peak_tflops}

    def save() -> None:  # after every part: a run cut off at its limit keeps what it finished
        with open(os.path.join(a.out, "gpu_checks.json"), "w") as f:
            json.dump(result, f, indent=1)

    print(f"[gpu_checks] {json.dumps(result['ceilings'])}", flush=True)
    if "tests" not in skip:
        rc, text, secs = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               "tests/test_gpt_model.py", "tests/test_bf16_convergence.py", "tests/test_mixed_precision.py"],
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
    if "mfu" not in skip:
        result["mfu"] = []
        mfu_grid(a.out, a.peak_tflops, result["ceilings"]["bf16_matmul_tflops"], result["mfu"], save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
