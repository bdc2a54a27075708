#!/usr/bin/env python3
"""Fault trials for numerics, storage, checkpoints, data and arguments — the part of ``lab/chaos/chaos.py``
that corrupts what a run reads and computes (``lab/chaos/chaos_ranks.py`` kills processes).

    python -m lab.chaos.chaos_data worker PRETRAIN_GPT_FLAGS...   # under torchrun: a run with CHAOS_INJECT's fault

``FAULTS`` is a list of ``(name, fn)``; ``fn(workdir, quick) -> dict`` runs ONE trial in ``workdir`` — real
2-process gloo runs started with torchrun — and returns ``{"fault", "detected", "how", "detect_s",
"recovered", "steps_lost", "data_lost"}``. Faults injected mid-run (``CHAOS_INJECT``, read by the worker
only: nothing in megareshard knows about it) are timed from the injection to the exit of the last rank;
faults in the inputs are timed from the launch (Python and torch start-up included).

The helpers here (``Inject``, ``build_trainer``, ``tmpfs``, ``fill_disk``) are shared with the tests in
``tests/reliability``.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lab import ROOT, free_port

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "100",
        "--eval-interval", "0", "--device", "cpu"]


class Inject:
    """Wraps a Trainer's forward/backward: at ``iteration`` (1-based) on ``rank``, poison the loss and/or
    the gradient of parameter ``param`` (with ``value``: nan or inf) after the backward."""

    def __init__(self, trainer, *, iteration: int, rank: int, loss: bool = False, param: str | None = None,
                 value: float = math.nan) -> None:
        self.trainer, self.inner = trainer, trainer.forward_backward_fn
        self.finalizes_grads = getattr(self.inner, "finalizes_grads", False)
        self.iteration, self.rank, self.loss, self.param, self.value = iteration, rank, loss, param, value

    def __call__(self, model, microbatches, device, **kw):
        out = self.inner(model, microbatches, device, **kw)
        hit = self.trainer.iteration + 1 == self.iteration and self.trainer.ctx.rank == self.rank
        if hit and kw.get("backward", True):
            print(f"CHAOS injected {time.time():.3f}", flush=True)
            if self.param is not None:
                p = dict(model.named_parameters())[self.param]
                with torch.no_grad():
                    p.grad.view(-1)[0] = self.value
            if self.loss:
                out = out + self.value
        return out


def build_trainer(argv: list[str], world_size: int):
    """A Trainer on this process's rank of ``world_size`` (torch.distributed initialised when > 1)."""
    from megareshard.arguments import parse_args
    from megareshard.training import Trainer, build_context

    cfg = parse_args(TINY + argv, world_size=world_size)
    ctx, _ = build_context(cfg, world_size)
    return Trainer(cfg, ctx, torch.device("cpu"), out=io.StringIO())


def params_snapshot(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@contextlib.contextmanager
def tmpfs(kib: int):
    """A fresh tmpfs of ``kib`` KiB mounted on a temp dir (unmounted and removed on exit). Needs root and
    a kernel that lets this process mount; otherwise pytest skips (in tests) with the precise reason."""
    reason = None
    if os.geteuid() != 0:
        reason = "a tmpfs for the disk-full fault needs root (mount -t tmpfs)"
    mnt = tempfile.mkdtemp(prefix="mr-tmpfs-")
    if reason is None:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", mnt], capture_output=True,
                           text=True)
        if r.returncode:
            reason = f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"
    if reason is not None:
        os.rmdir(mnt)
        raise NoTmpfs(reason)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=False)
        os.rmdir(mnt)


class NoTmpfs(RuntimeError):
    """No tmpfs could be mounted here (not root, or mounting is not allowed)."""


def fill_disk(path: str, leave: int = 4096) -> None:
    """Fill the file system of ``path`` with a file ``filler`` until fewer than ``leave`` bytes are free."""
    free = shutil.disk_usage(path).free
    with open(os.path.join(path, "filler"), "wb") as f:
        try:
            f.write(b"\0" * max(free - leave, 0))
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            pass


# ---- the worker: pretrain_gpt.py with a fault injected (under torchrun) ------------------------------
def worker(argv: list[str]) -> int:
    """``CHAOS_INJECT``: ``nan-grad:ITER:RANK`` (a parameter gradient), ``nan-loss:ITER:RANK``, ``inf-grad:ITER:RANK``
    (an fp16 overflow), ``disk-full:ITER:PATH`` (rank 0 fills PATH's file system before iteration ITER)."""
    from megareshard.arguments import ConfigError, parse_args
    from megareshard.training import RunStopped, Trainer, build_context, init_distributed, pick_device

    try:
        cfg = parse_args(argv)
        device = pick_device(cfg.training.device)
        world, _ = init_distributed(device, cfg.launch.preflight_timeout, cfg.launch.comm_timeout)
        ctx, _ = build_context(cfg, world)
        trainer = Trainer(cfg, ctx, device)
        kind, _, rest = os.environ.get("CHAOS_INJECT", "").partition(":")
        if kind:
            it, _, arg = rest.partition(":")
            if kind == "disk-full":
                trainer.forward_backward_fn = FillDisk(trainer, iteration=int(it), path=arg)
            else:
                trainer.forward_backward_fn = Inject(
                    trainer, iteration=int(it), rank=int(arg), loss=kind == "nan-loss",
                    param=None if kind == "nan-loss" else next(n for n, _ in trainer.model.named_parameters()
                                                              if n.endswith("fc1.weight")),
                    value=math.inf if kind == "inf-grad" else math.nan)
        try:
            records = trainer.train()
        finally:
            trainer.close()
        last = records[-1] if records else {}
        print(f"CHAOS finished iteration {trainer.iteration} skipped {sum(r['skipped'] for r in records)} "
              f"loss_scale {last.get('loss_scale')} save_failures {trainer.save_failures}", flush=True)
    except ConfigError as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    except RunStopped as e:
        print(f"CHAOS stopped {time.time():.3f}", flush=True)
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


class FillDisk(Inject):
    """Rank 0 fills ``path``'s file system right before iteration ``iteration``'s forward."""

    def __init__(self, trainer, *, iteration: int, path: str) -> None:
        super().__init__(trainer, iteration=iteration, rank=0)
        self.path = path

    def __call__(self, model, microbatches, device, **kw):
        if self.trainer.iteration + 1 == self.iteration and self.trainer.ctx.rank == 0 and kw.get("backward", True):
            fill_disk(self.path)
            print(f"CHAOS injected {time.time():.3f}", flush=True)
        return self.inner(model, microbatches, device, **kw)


# ---- trials --------------------------------------------------------------------------------------------
RUN = ["--mock-data", "--vocab-size", "64", "--global-batch-size", "8"]


def torchrun(workdir: str, args: list[str], *, nproc: int = 2, inject: str = "", script: str | None = None,
             timeout: float = 240.0, monitor_interval: float = 1.0) -> dict:
    """One torchrun job of the worker (or ``script``); returns {rc, out, t0, t_end, injected_at, errors}.

    ``monitor_interval`` is torchrun's ``--monitor-interval``: how long its agent may take to notice a failed
    worker and terminate the others. A trial that must see every rank refuse on its own gives the slower rank
    that long to get there (at torchrun's default 0.1 s a rank still importing torch on a loaded machine is
    killed before it prints, and "refused on every rank" cannot be shown)."""
    tmp = os.path.join(workdir, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "CHAOS_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", TMPDIR=tmp, WANDB_MODE="disabled",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), CHAOS_INJECT=inject)
    target = [script] if script else ["-m", "lab.chaos.chaos_data", "worker"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           "--monitor-interval", str(monitor_interval), *target, *args]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, f"{e.stdout or ''}{e.stderr or ''}\nHANG: no exit within {timeout} s"
    t_end = time.time()
    m = re.findall(r"CHAOS injected ([0-9.]+)", out)
    stops = [float(x) for x in re.findall(r"CHAOS stopped ([0-9.]+)", out)]
    # the trial's temp dir is W in the messages (it is gone once the trial ends)
    errors = sorted(set(e.replace(workdir, "W") for e in re.findall(r"pretrain_gpt\.py: error: (.*)", out)))
    return {"rc": rc, "out": out, "t0": t0, "t_end": t_end, "injected_at": float(m[0]) if m else None,
            "errors": errors, "stopped_at": max(stops) if stops else None, "ranks_failed": len(re.findall(r"pretrain_gpt\.py: error: ", out))}


STARTUP_MONITOR_S = 5.0
"""torchrun's ``--monitor-interval`` for the trials whose bad input every rank must refuse at start-up: the
ranks reach the check after importing torch, and two ranks on a loaded 2-core machine got there more than
the default 1 s apart (CI: "1 of 2 ranks reported" for zero-blend-weight, the other killed while importing)."""


def _result(fault, detected, how, detect_s, recovered, steps_lost, data_lost) -> dict:
    return {"fault": fault, "detected": bool(detected), "how": how,
            "detect_s": None if detect_s is None else round(detect_s, 2), "recovered": recovered,
            "steps_lost": steps_lost, "data_lost": data_lost}


def _latest(root: str) -> str | None:
    try:
        return open(os.path.join(root, "latest")).read().strip()
    except OSError:
        return None


def _not_everywhere(job: dict, nproc: int) -> str:
    """What a failed ``_stopped_everywhere`` saw: exit code, how many ranks reported, every distinct error."""
    return f"rc {job['rc']}, {job['ranks_failed']} of {nproc} ranks reported: {job['errors']}"


def _stopped_everywhere(job: dict, nproc: int, needle: str) -> bool:
    """Every rank printed the same one-line error holding ``needle`` and the job exited non-zero."""
    return (job["rc"] not in (0, None) and job["ranks_failed"] == nproc and len(job["errors"]) == 1
            and needle in job["errors"][0])


def _resume(workdir: str, root: str, iters: int, load: str | None = None) -> tuple[bool, int | None]:
    """A clean job resuming from ``load`` (default: the root's latest) to ``iters``: (completed, start iteration)."""
    job = torchrun(workdir, TINY + RUN + ["--train-iters", str(iters), "--save", root, "--load", load or root])
    m = re.search(r"loaded \S+iter_(\d+)", job["out"])
    return job["rc"] == 0 and f"CHAOS finished iteration {iters}" in job["out"], int(m.group(1)) if m else None


def trial_nan(kind: str):
    """nan-grad / nan-loss (pp 2) / fp16-overflow: a rank's gradient or loss goes non-finite at iteration 3."""
    def trial(workdir: str, quick: bool) -> dict:
        root = os.path.join(workdir, "ckpt")
        iters = 4 if quick else 8
        extra = {"nan-grad": [], "nan-loss": ["--pipeline-model-parallel-size", "2"],
                 "fp16-overflow": ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"]}[kind]
        inject = {"nan-grad": "nan-grad:3:1", "nan-loss": "nan-loss:3:1", "fp16-overflow": "inf-grad:3:1"}[kind]
        job = torchrun(workdir, TINY + RUN + extra + ["--train-iters", str(iters), "--save", root,
                                                      "--save-interval", "2"], inject=inject)
        took = job["stopped_at"] - job["injected_at"] if job["injected_at"] and job["stopped_at"] else None
        latest = _latest(root)
        if kind == "fp16-overflow":
            ok = job["rc"] == 0 and f"CHAOS finished iteration {iters} skipped 1 loss_scale 512.0" in job["out"]
            return _result(kind, ok, "found_inf all-reduced: the step skipped on every rank, loss scale 1024 -> 512, "
                           "training went on" if ok else f"rc {job['rc']}: {job['out'][-300:]}", None, ok,
                           1 if ok else None,
                           "none (the skipped step is the batch's only loss)")
        needle = ("iteration 3: first non-finite parameter gradient: " if kind == "nan-grad"
                  else "iteration 3: non-finite loss on rank 1")
        detected = _stopped_everywhere(job, 2, needle)
        recovered, start = _resume(workdir, root, iters) if detected else (False, None)
        how = (f"every rank stopped before the step: {job['errors'][0]}" if detected
               else _not_everywhere(job, 2))
        return _result(kind, detected, how, took, recovered, (3 - start) if start is not None else None,
                       f"none (parameters never stepped with the NaN; resumed from {latest})")
    return trial


def trial_disk_full(workdir: str, quick: bool) -> dict:
    """The disk fills during the run (rank 0 fills a 2 MiB tmpfs before iteration 3): the save at 4 fails."""
    iters = 4 if quick else 6
    disk = tmpfs(2048)
    try:
        mnt = disk.__enter__()
    except NoTmpfs as e:
        return _result("disk-full-save", False, f"skipped: {e}", None, None, None, "n/a")
    try:
        root = os.path.join(mnt, "ckpt")
        job = torchrun(workdir, TINY + RUN + ["--train-iters", str(iters), "--save", root, "--save-interval", "2"],
                       inject=f"disk-full:3:{mnt}")
        took = job["stopped_at"] - job["injected_at"] if job["injected_at"] and job["stopped_at"] else None
        detected = _stopped_everywhere(job, 2, "No space left on device") and _latest(root) == "iter_0000002"
        os.remove(os.path.join(mnt, "filler"))
        recovered, start = _resume(workdir, root, iters) if detected else (False, None)
        how = ("the save failed on every rank (DCP write error agreed), latest still iter_0000002, job stopped "
               "(--on-save-failure stop)" if detected else _not_everywhere(job, 2))
        return _result("disk-full-save", detected, how, took, recovered, (4 - start) if start is not None else None,
                       "none (iter_0000004 never became latest; temp dir removed)")
    finally:
        disk.__exit__(None, None, None)


def _saved_run(workdir: str) -> str:
    root = os.path.join(workdir, "ckpt")
    job = torchrun(workdir, TINY + RUN + ["--train-iters", "2", "--save", root, "--save-interval", "1"])
    if job["rc"] != 0:
        raise RuntimeError(f"the run that saves the checkpoints failed: {job['out'][-2000:]}")
    return root


def trial_checkpoint(kind: str):
    """corrupt-shard / truncated-shard / other-model / missing-latest, on the load of the newest of two saves."""
    def trial(workdir: str, quick: bool) -> dict:
        root = _saved_run(workdir)
        ck = os.path.join(root, "iter_0000002")
        shard = os.path.join(ck, "__0_0.distcp")
        argv = TINY + RUN + ["--train-iters", "3", "--load", root]
        if kind == "corrupt-shard":
            with open(shard, "r+b") as f:
                f.seek(os.path.getsize(shard) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
            needle = "__0_0.distcp is corrupt: CRC-32"
        elif kind == "truncated-shard":
            with open(shard, "r+b") as f:
                f.truncate(os.path.getsize(shard) - 64)
            needle = "__0_0.distcp has"
        elif kind == "other-model":
            argv += ["--hidden-size", "64", "--vocab-size", "80"]
            needle = "hidden_size: checkpoint 32, this run 64"
        else:
            os.remove(os.path.join(root, "latest"))
            needle = "latest missing"
        job = torchrun(workdir, argv, monitor_interval=STARTUP_MONITOR_S)
        detected = _stopped_everywhere(job, 2, needle)
        how = (f"refused on every rank before loading: {job['errors'][0]}" if detected
               else _not_everywhere(job, 2))
        if kind == "other-model":
            return _result(kind, detected, how, job["t_end"] - job["t0"], None, 0, "none (nothing loaded)")
        recovered, start = _resume(workdir, root, 3, load=os.path.join(root, "iter_0000001")) if detected \
            else (False, None)
        return _result(kind, detected, how, job["t_end"] - job["t0"], recovered,
                       (2 - start) if start is not None else None,
                       "iteration 2's checkpoint (resumed from iter_0000001)" if kind != "missing-latest"
                       else "none (the checkpoints are intact; resumed from iter_0000001 given explicitly)")
    return trial


def trial_data(kind: str):
    """truncated-bin / token-beyond-vocab / empty-dataset / zero-blend-weight: refused at start-up."""
    def trial(workdir: str, quick: bool) -> dict:
        from megareshard.data.indexed_dataset import write_indexed_dataset
        import numpy as np

        rng = np.random.default_rng(0)
        prefix = os.path.join(workdir, "corpus")
        docs = [rng.integers(0, 64, 40) for _ in range(50 if quick else 500)]
        if kind == "token-beyond-vocab":
            docs[-1][5] = 64
        write_indexed_dataset(prefix, [] if kind == "empty-dataset" else docs)
        data = ["--data-path", prefix]
        if kind == "truncated-bin":
            with open(prefix + ".bin", "r+b") as f:
                f.truncate(os.path.getsize(prefix + ".bin") - 7)
            needle = "truncated at byte offset"
        elif kind == "token-beyond-vocab":
            needle = f"token id 64 at byte offset {((len(docs) - 1) * 40 + 5) * 2}"
        elif kind == "empty-dataset":
            needle = "empty dataset"
        else:
            write_indexed_dataset(prefix + "2", docs)
            data = ["--data-path", "1", prefix, "0", prefix + "2"]
            needle = "weight 0 for"
        argv = [a for a in TINY + RUN if a != "--mock-data"] + data + ["--train-iters", "2", "--split", "1,0,0"]
        job = torchrun(workdir, argv, monitor_interval=STARTUP_MONITOR_S)
        detected = _stopped_everywhere(job, 2, needle)  # each rank exits 2 (torchrun then exits 1)
        how = (f"ConfigError at start-up: {job['errors'][0]}" if detected
               else _not_everywhere(job, 2))
        return _result(kind, detected, how, job["t_end"] - job["t0"], None, 0,
                       "none (refused before training; the file must be fixed)")
    return trial


def trial_args_fuzz(workdir: str, quick: bool) -> dict:
    """tests/reliability/test_args_fuzz.py with random draws: every combination starts or ends in one ConfigError."""
    n = 60 if quick else 600
    env = {**os.environ, "MEGARESHARD_FUZZ_EXAMPLES": str(n), "TMPDIR": workdir}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "reliability" / "test_args_fuzz.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    ok = p.returncode == 0
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    return _result("args-fuzz", ok, f"{n} random flag combinations (hypothesis): each started or ended in one "
                   "ConfigError line" if ok else f"a combination broke the rule: {tail[0][:150]}",
                   None, None, 0, "none")


FAULTS = [("nan-grad", trial_nan("nan-grad")), ("nan-loss", trial_nan("nan-loss")),
          ("fp16-overflow", trial_nan("fp16-overflow")), ("disk-full-save", trial_disk_full),
          ("corrupt-shard", trial_checkpoint("corrupt-shard")), ("truncated-shard", trial_checkpoint("truncated-shard")),
          ("other-model", trial_checkpoint("other-model")), ("missing-latest", trial_checkpoint("missing-latest")),
          ("truncated-bin", trial_data("truncated-bin")), ("token-beyond-vocab", trial_data("token-beyond-vocab")),
          ("empty-dataset", trial_data("empty-dataset")), ("zero-blend-weight", trial_data("zero-blend-weight")),
          ("args-fuzz", trial_args_fuzz)]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(worker(sys.argv[2:]))
    names = dict(FAULTS)
    for name in sys.argv[1:] or names:
        with tempfile.TemporaryDirectory(prefix="chaos-") as wd:
            print(json.dumps(names[name](wd, True)), flush=True)
