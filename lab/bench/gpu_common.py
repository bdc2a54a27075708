"""What the GPU checks' parts share (``lab/bench/gpu_checks.py``): running a process with its log, reading the
trainer's iteration and start-up lines, the device's ceilings."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import time

from lab import ROOT

ROOT = str(ROOT)
ENV = {"WANDB_MODE": "disabled"}
#: seconds a run needs at least to be worth starting with --tiny (CPU)
TINY_MIN_START_S = 3.0


# ---- processes and their logs -----------------------------------------------------------------------------
def _run(cmd: list[str], log: str, timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, **(env or {})))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        rc, text = 124, f"{out[0]}{out[1]}\n[timed out after {timeout:.0f} s]"
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n" + text)
    return rc, text, time.perf_counter() - t0


_ITER = re.compile(r"^ iteration +(\d+)/ *\d+ \|(.*)$", re.M)
_FIELDS = {"ms": r"elapsed time per iteration \(ms\): ([0-9.]+)", "loss": r"lm loss: ([^ |]+)",
           "grad_norm": r"grad norm: ([^ |]+)", "tokens_per_s": r"tokens/s: ([0-9.]+)",
           "tflops_per_rank": r"TFLOP/s per rank: ([0-9.]+)"}


def log_iterations(text: str) -> list[dict]:
    """The trainer's iteration lines (``tracking.format_log_line``): iteration, ms, loss and grad norm as printed
    (strings: compared bitwise as logged), tokens/s and TFLOP/s per rank (floats)."""
    recs = []
    for m in _ITER.finditer(text):
        rec: dict = {"iteration": int(m.group(1))}
        for key, pat in _FIELDS.items():
            f = re.search(pat, m.group(2))
            if f:
                rec[key] = f.group(1) if key in ("loss", "grad_norm") else float(f.group(1))
        recs.append(rec)
    return recs


def fast_path_line(text: str) -> str | None:
    m = re.search(r"^megareshard: fast path: (.*)$", text, re.M)
    return m.group(1) if m else None


def attention_of(text: str) -> dict:
    """The attention kernel the run's start-up line names (``fast path: attention KERNEL (why); ...``) and whether
    it was the checkpoint's recorded choice, reused (``as recorded in``)."""
    line = fast_path_line(text) or ""
    m = re.search(r"(attention .*?); cross-entropy", line)
    phrase = m.group(1) if m else None
    return {"attention": phrase, "attention_kernels": re.findall(r"attention ([^\s,(]+)", phrase or ""),
            "attention_reused": None if phrase is None else "as recorded in" in phrase}


def _failed(rc: int) -> str:
    return "timed out" if rc == 124 else "failed"


def _error_line(text: str) -> str:
    """The line that says why a run failed: its time-out, else its last line naming an error, else its last line."""
    lines = [x for x in text.strip().splitlines() if x.strip()]
    if lines and lines[-1].startswith("[timed out after"):
        return lines[-1]
    for x in reversed(lines):
        if "error" in x.lower() or "Error" in x:
            return x.strip()[:500]
    return lines[-1].strip()[:500] if lines else "no output"


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
    del a, b, x, y
    torch.cuda.empty_cache()  # the training processes after this one get the card's memory
    return rec
