"""Parts 1 and 3 of the GPU checks (``lab/bench/gpu_checks.py``, whose docstring says what they run and why):
the bf16 path's determinism and every ``--torch-compile-mode`` offered."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time

from lab.bench.gpu_common import (ENV, TINY_MIN_START_S, _error_line, _failed, _run, attention_of, fast_path_line,
                                  log_iterations)

# ---- part 1: determinism of the bf16 path ---------------------------------------------------------------
SMALL_MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
               "--vocab-size", "8192", "--micro-batch-size", "4", "--global-batch-size", "8"]
TINY_SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                    "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "4"]
DETERMINISM_ITERS, TINY_DETERMINISM_ITERS = 20, 6
DETERMINISM_RUNS = ("bf16", "bf16_again", "bf16_first_half", "bf16_resumed", "det", "det_again", "det_first_half",
                    "det_resumed", "fp32")


def small_command(device: str, tiny: bool, iters: int) -> list[str]:
    """``pretrain_gpt.py`` on the small model as a user runs it: Megatron's default dropout (0.1, no flags),
    torch.compile by its default (on with CUDA; the tiny CPU variant: off, its CPU default)."""
    return [sys.executable, "pretrain_gpt.py", "--mock-data", "--device", device,
            *(TINY_SMALL_MODEL if tiny else SMALL_MODEL), "--train-iters", str(iters), "--lr", "3e-4",
            "--lr-warmup-iters", "2", "--log-interval", "1"]


def _same(a: list[dict], b: list[dict], n: int) -> bool:
    """Both runs logged iterations 1..n with the same loss and grad norm (as printed, or at full precision)."""
    def key(recs: list[dict]) -> list:
        return [(r["iteration"], r.get("loss"), r.get("grad_norm")) for r in sorted(recs, key=lambda r: r["iteration"])]
    return [r[0] for r in key(a)] == list(range(1, n + 1)) and key(a) == key(b)


def _first_difference(a: list[dict], b: list[dict]) -> dict | None:
    by = {r["iteration"]: r for r in b}
    for r in sorted(a, key=lambda r: r["iteration"]):
        o = by.get(r["iteration"])
        if o is None or (o.get("loss"), o.get("grad_norm")) != (r.get("loss"), r.get("grad_norm")):
            return {"iteration": r["iteration"], "a": [r.get("loss"), r.get("grad_norm")],
                    "b": None if o is None else [o.get("loss"), o.get("grad_norm")]}
    return None


def _metrics(path: str) -> list[dict]:
    """--metrics-file's records: iteration, loss and grad norm at full precision (the floats the trainer holds)."""
    if not os.path.exists(path):
        return []
    recs = [json.loads(line) for line in open(path) if line.strip()]
    return [{"iteration": r["iteration"], "loss": r.get("loss"), "grad_norm": r.get("grad_norm")} for r in recs]


def determinism(out: str, a: argparse.Namespace, until: float, rec: dict, save) -> dict:
    """Part 1 (see the module docstring): every run recorded (rc, seconds, log, losses and grad norms as printed
    and at full precision from ``--metrics-file``, the attention kernel), then the booleans; a run that cannot
    start before ``until`` is recorded as skipped. Every run writes the same --metrics-file path (moved aside
    after it), so that "the same command twice" is the same command, character for character."""
    n = TINY_DETERMINISM_ITERS if a.tiny else DETERMINISM_ITERS
    half = n // 2
    metrics = os.path.join(out, "determinism_metrics.jsonl")
    base = small_command(a.device, a.tiny, n) + ["--metrics-file", metrics]
    wanted = a.determinism_runs.split(",")
    rec.update(command=shlex.join(base + ["--bf16"]), iterations=n, exit_interval=half, dropout="Megatron's "
               "default 0.1 (no dropout flags)", compile="torch.compile by its default (on with CUDA)" if not a.tiny
               else "the CPU default (off)", runs={})
    need = TINY_MIN_START_S if a.tiny else 15.0
    with tempfile.TemporaryDirectory(prefix="gpu-ckpt-") as tmp:
        ck = {"bf16": os.path.join(tmp, "bf16"), "det": os.path.join(tmp, "det")}
        cmds = {"bf16": base + ["--bf16"], "bf16_again": base + ["--bf16"],
                "bf16_first_half": base + ["--bf16", "--save", ck["bf16"], "--exit-interval", str(half)],
                "bf16_resumed": base + ["--bf16", "--load", ck["bf16"]],
                "det": base + ["--bf16", "--deterministic-mode"],
                "det_again": base + ["--bf16", "--deterministic-mode"],
                "det_first_half": base + ["--bf16", "--deterministic-mode", "--save", ck["det"], "--exit-interval",
                                          str(half)],
                "det_resumed": base + ["--bf16", "--deterministic-mode", "--load", ck["det"]],
                "fp32": base}
        for name in DETERMINISM_RUNS:
            left = until - time.time()
            if name not in wanted:
                rec["runs"][name] = {"status": "skipped", "error": "not asked (--determinism-runs)"}
                continue
            if left < need:
                rec["runs"][name] = {"status": "skipped", "error": f"not started: {max(left, 0):.0f} s left of the "
                                     "determinism part's budget", "command": shlex.join(cmds[name])}
                save()
                continue
            log = os.path.join(out, f"determinism_{name}.log")
            if os.path.exists(metrics):
                os.remove(metrics)
            rc, text, secs = _run(cmds[name], log, min(left + 30, 400), ENV)
            its = log_iterations(text)
            full = _metrics(metrics)
            if os.path.exists(metrics):
                os.replace(metrics, os.path.join(out, f"determinism_{name}.metrics.jsonl"))
            run = {"status": "ok" if rc == 0 else _failed(rc), "rc": rc, "seconds": round(secs, 1), "log": log,
                   "command": shlex.join(cmds[name]).replace(tmp, "CKPT"),
                   "loss": [r.get("loss") for r in its], "grad_norm": [r.get("grad_norm") for r in its],
                   "iterations": [r["iteration"] for r in its], "full_precision": full, **attention_of(text)}
            if rc != 0:
                run["error"] = _error_line(text)
            rec["runs"][name] = run
            save()
            print(f"[gpu_checks] determinism {name}: rc {rc}, {len(its)} iterations, {secs:.0f} s, "
                  f"{run['attention']}", flush=True)

    def its(name: str, full: bool = False) -> list[dict]:
        r = rec["runs"].get(name, {})
        if full:
            return r.get("full_precision", [])
        return [{"iteration": i, "loss": x, "grad_norm": g} for i, x, g in zip(r.get("iterations", []),
                                                                                 r.get("loss", []),
                                                                                 r.get("grad_norm", []))]

    def ran(*names: str) -> bool:
        return all(rec["runs"].get(x, {}).get("status") == "ok" for x in names)

    def compare(res: dict, key: str, a_: str, b_: list[str]) -> None:
        """res[key]: the printed fields equal and, where both wrote them, the full-precision ones too."""
        pa, pb = its(a_), [r for x in b_ for r in its(x)]
        fa, fb = its(a_, True), [r for x in b_ for r in its(x, True)]
        printed, full = _same(pa, pb, n), (_same(fa, fb, n) if fa and fb else None)
        res[key] = printed and full is not False
        res[f"{key}_printed"], res[f"{key}_full_precision"] = printed, full
        res[key.replace("bitwise_equal", "first_difference")] = _first_difference(*((fa, fb) if full is not None
                                                                                   else (pa, pb)))

    for prefix, key in (("bf16", None), ("det", "deterministic_mode")):
        res: dict = {}
        if ran(prefix, f"{prefix}_again"):
            compare(res, "same_command_bitwise_equal", prefix, [f"{prefix}_again"])
        else:
            res["same_command_bitwise_equal"] = None  # not measured (a run failed or was skipped)
        if ran(prefix, f"{prefix}_first_half", f"{prefix}_resumed"):
            compare(res, "resume_bitwise_equal", prefix, [f"{prefix}_first_half", f"{prefix}_resumed"])
            res["resumed_attention_reused"] = rec["runs"][f"{prefix}_resumed"]["attention_reused"]
        else:
            res["resume_bitwise_equal"] = None
        if key is None:
            rec.update(res)
        else:
            rec[key] = res
    f32, b16 = (rec["runs"].get(x, {}).get("loss", []) for x in ("fp32", "bf16"))
    rec["max_rel_diff_bf16_vs_fp32"] = (max(abs(float(x) - float(y)) / abs(float(x)) for x, y in zip(f32, b16))
                                        if len(f32) == len(b16) == n else None)
    save()
    return rec


# ---- part 3: every --torch-compile-mode -----------------------------------------------------------------
def compile_mode_choices() -> list[str]:
    """The modes ``pretrain_gpt.py --help`` offers for --torch-compile-mode (megareshard's parser)."""
    from megareshard.arguments import build_parser

    for action in build_parser()._actions:
        if "--torch-compile-mode" in action.option_strings:
            return list(action.choices)
    raise RuntimeError("megareshard's parser has no --torch-compile-mode")


def compile_modes(out: str, a: argparse.Namespace, until: float, rec: dict, save, iters: int = 5) -> dict:
    """Part 3: the small model of part 1 for ``iters`` iterations under every mode (tiny: aot_eager, which runs
    only the default mode; the others are then refused for their backend, the CUDA-graph modes for themselves)."""
    from megareshard.compile_config import CUDA_GRAPH_MODES

    modes = compile_mode_choices()
    asked = a.compile_modes.split(",") if a.compile_modes else modes
    base = small_command(a.device, a.tiny, iters) + ["--bf16"]
    if a.tiny:
        base += ["--torch-compile", "--torch-compile-backend", a.compile_backend]
    rec.update(choices=modes, iterations=iters, modes={})
    # the CUDA-graph modes first: refused at once (under a second), they are on record whatever time is left
    for mode in sorted(modes, key=lambda m: m not in CUDA_GRAPH_MODES):
        cmd = base + ["--torch-compile-mode", mode]
        left = until - time.time()
        if mode not in asked:
            rec["modes"][mode] = {"status": "skipped", "error": "not asked (--compile-modes)"}
            continue
        if left < (1.0 if mode in CUDA_GRAPH_MODES else TINY_MIN_START_S if a.tiny else 30.0):
            rec["modes"][mode] = {"status": "skipped", "error": f"not started: {max(left, 0):.0f} s left",
                                  "command": shlex.join(cmd)}
            save()
            continue
        log = os.path.join(out, f"compile_mode_{mode}.log")
        rc, text, secs = _run(cmd, log, max(left, 5.0), ENV)
        loss = [float(r["loss"]) for r in log_iterations(text) if "loss" in r]
        trained = rc == 0 and len(loss) == iters and all(math.isfinite(x) for x in loss)
        refused = re.search(r"^pretrain_gpt\.py: error: (.*)$", text, re.M) if rc != 0 else None
        m = {"status": "trained" if trained else "refused" if refused else _failed(rc), "rc": rc, "trained": trained,
             "loss": loss, "seconds": round(secs, 1), "log": log, "command": shlex.join(cmd),
             "fast_path": fast_path_line(text)}
        if refused:
            m["line"] = refused.group(0)
        elif not trained:
            m["error"] = _error_line(text)
        rec["modes"][mode] = m
        save()
        print(f"[gpu_checks] compile mode {mode}: {m['status']} ({secs:.0f} s)", flush=True)
    return rec
