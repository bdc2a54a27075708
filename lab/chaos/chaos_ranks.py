#!/usr/bin/env python3
"""Fault trials for ranks, nodes and preemption — the part of ``lab/chaos/chaos.py`` that kills processes.

    python -m lab.chaos.chaos_ranks [--quick] [--only NAME] [--workdir DIR]   # one trial each, prints JSON lines

``FAULTS`` is a list of ``(name, fn)``; ``fn(workdir, quick) -> dict`` runs ONE trial of real
multi-process training (gloo, CPU) in ``workdir`` and returns exactly::

    {"fault": str, "detected": bool, "how": str, "detect_s": float | None, "recovered": bool,
     "steps_lost": int | None, "data_lost": str}

``lab/chaos/chaos.py`` runs them (``--trials N``, the table, JSON). The trials:

* ``rank-killed-restart``: torchrun ``--max-restarts 1``, ``--save D --load D``; one rank SIGKILLs itself
  mid-iteration (``MEGARESHARD_INJECT_FAULT``). Detected by the survivors' gloo error (report printed)
  and torchrun; recovered when the restarted job resumes from the last save and ends bitwise equal
  (every weight and optimizer tensor) to an uninterrupted run; steps lost = iterations redone.
* ``rank-killed``: the same kill without a launcher restarting anything: every surviving rank must exit
  non-zero with its watchdog report (stage, action, microbatch, peer) within ``--comm-timeout``, and
  ``latest`` must name a complete checkpoint. The job stops (recovered False: the next job resumes).
* ``rank-stopped``: a rank SIGSTOPs itself (a stall that closes no socket): the survivors end in gloo's
  timeout or the watchdog, report, exit non-zero.
* ``preempted``: ``examples/pretrain_gpt_distributed.sh`` gets SIGTERM mid-run (what Slurm's
  ``--signal=TERM@120`` does): the job saves at the next iteration boundary and exits 0; the next job
  continues and ends bitwise equal to an uninterrupted run.
* ``node-missing-static`` / ``node-missing-c10d``: the launch script with ``NNODES=2`` where node 1
  never starts: the node pre-flight names node rank 1 and the host that joined within its timeout.
* ``second-writer``: a second job with the same ``--save`` while the first one trains: it stops at start-up
  with one line naming the first job's rank 0 (host, pid, start time); the first job's checkpoints stay intact.
* ``launcher-killed``: ``kill -9`` of torchrun mid-run: every worker ends within ``--comm-timeout`` (it watches
  its launcher), and the next job on the directory takes its lock and resumes from the last save.
* ``nic-down`` (root only: the emulated cluster of ``lab/cluster/emulate_cluster.py``): 2 hosts; host 1's
  NIC goes down mid-run (``ip netns exec <host> ip link set eth0 down``): every rank exits non-zero
  with its report within ``--comm-timeout``. Without root it returns ``how="skipped: needs root"``.

Times are wall seconds on whatever machine runs them (a loaded 2-core machine stretches them).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from lab import ROOT, free_port
KEYS = ("fault", "detected", "how", "detect_s", "recovered", "steps_lost", "data_lost")
REPORT_RE = re.compile(r"\[watchdog\] rank (\d+): '([^']*)' (failed after|has run for) ([0-9.]+)s")


# ---- sizes ---------------------------------------------------------------------------------------
def model_args(quick: bool, layers: int | None = None) -> list[str]:
    """A tiny GPT (quick) or a small one; dropout on, so the RNG state must resume exactly too."""
    h, seq = ("32", "16") if quick else ("64", "32")
    layers = str(layers or (2 if quick else 4))
    # every run can take a fault on cue (MEGARESHARD_INJECT_FAULT, read by the step hook lab.chaos.faults registers)
    return ["--custom-import", "lab.chaos.faults", "--mock-data", "--vocab-size", "100", "--num-layers", layers,
            "--hidden-size", h,
            "--num-attention-heads", "4", "--seq-length", seq, "--max-position-embeddings", seq,
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-warmup-iters", "2", "--log-interval", "1", "--device", "cpu", "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1", "--eval-interval", "0"]


def comm_timeout(quick: bool) -> float:
    return 8.0 if quick else 20.0


def _env(workdir: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.pop("MEGARESHARD_INJECT_FAULT", None)
    tmp = os.path.join(workdir, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", TMPDIR=tmp,
               WANDB_MODE="disabled", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


# ---- processes with timestamped output -----------------------------------------------------------
@dataclass
class Job:
    """One process (a rank, torchrun, a launch script): stdout+stderr with the time each line arrived."""

    name: str
    proc: subprocess.Popen
    t0: float
    log: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    exit_t: float | None = None
    _reader: threading.Thread | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @classmethod
    def start(cls, name: str, cmd: list[str], env: dict[str, str], log: str, **kw) -> "Job":
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, **kw)
        job = cls(name, proc, time.monotonic(), log)
        job._reader = threading.Thread(target=job._read, daemon=True)
        job._reader.start()
        return job

    def _read(self) -> None:
        with open(self.log, "w", encoding="utf-8") as f:
            for raw in iter(self.proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                f.write(line + "\n")
                f.flush()
                with self._cond:
                    self.lines.append((time.monotonic(), line))
                    self._cond.notify_all()
        self.proc.wait()
        with self._cond:
            self.exit_t = time.monotonic()
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout: float) -> float | None:
        """Time the first line matching ``pattern`` (regex) arrived; None at timeout or exit without it."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for t, line in self.lines[seen:]:
                    if rx.search(line):
                        return t
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.exit_t is not None:
                    return None
                self._cond.wait(min(left, 0.5))

    def wait(self, timeout: float) -> int | None:
        """Exit code, or None if still running after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.exit_t is None and time.monotonic() < deadline:
                self._cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.proc.returncode if self.exit_t is not None else None

    def text(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)

    def first(self, pattern: str) -> float | None:
        rx = re.compile(pattern)
        with self._cond:
            return next((t for t, line in self.lines if rx.search(line)), None)

    def kill(self) -> None:
        """SIGKILL the process and everything it started (torchrun's workers run in sessions of their own, so
        a process group is not enough)."""
        if self.proc.poll() is not None:  # gone (its pid may be reused): nothing of ours to find below it
            self.wait(10)
            return
        pids = _descendants(self.proc.pid) + [self.proc.pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)  # also ends a stopped process, without letting it run first
            except ProcessLookupError:
                pass
        self.wait(10)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc: field 4 of /proc/N/stat, after the command in parentheses)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def launch_ranks(argv: list[str], world: int, workdir: str, tag: str, env: dict[str, str] | None = None,
                 script: str = "pretrain_gpt.py") -> list[Job]:
    """``world`` processes of ``script`` with torchrun's environment but no torchrun agent: nothing restarts
    or kills them, so each one's own exit (code, time, last words) is observable."""
    port = free_port()
    jobs = []
    for r in range(world):
        e = _env(workdir, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {}))
        jobs.append(Job.start(f"rank{r}", [sys.executable, script, *argv], e,
                              os.path.join(workdir, f"{tag}.rank{r}.log")))
    return jobs


def torchrun(argv: list[str], nproc: int, workdir: str, tag: str, env: dict[str, str] | None = None,
             max_restarts: int = 0) -> Job:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
           "pretrain_gpt.py", *argv]
    return Job.start(tag, cmd, _env(workdir, **(env or {})), os.path.join(workdir, f"{tag}.log"))


def run_to_end(jobs: list[Job], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes = [j.wait(max(0.0, deadline - time.monotonic())) for j in jobs]
    for j in jobs:
        j.kill()
    return codes


# ---- checkpoints ---------------------------------------------------------------------------------
def checkpoint_tensors(ckpt_dir: str) -> dict[str, Any]:
    """Every tensor of a checkpoint directory, read in this process (DCP without a process group), as data."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megareshard.checkpoint.format import Piece, read_metadata, read_pieces

    pieces = {k: Piece(torch.empty(tuple(v.size), dtype=v.properties.dtype), tuple(v.size), (0,) * len(v.size))
              for k, v in read_metadata(ckpt_dir).state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    read_pieces(ckpt_dir, pieces, [], no_dist=True)
    return {k: p.tensor for k, p in pieces.items()}


def bitwise_diff(a_dir: str, b_dir: str) -> str | None:
    """None when both checkpoints hold the same tensors bit for bit, else what differs."""
    import torch

    a, b = checkpoint_tensors(a_dir), checkpoint_tensors(b_dir)
    if set(a) != set(b):
        return f"different keys: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in sorted(a) if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    return None if not bad else f"{len(bad)} of {len(a)} tensors differ (first: {bad[0]})"


def latest_state(root: str) -> tuple[int | None, str]:
    """(iteration ``latest`` names, verdict): complete means checkpoint.json, every file at its size,
    DCP metadata readable (the loader's own checks); no ``latest`` at all is (None, 'none')."""
    from megareshard.checkpoint.format import (CheckpointError, check_files, read_info, read_metadata,
                                               resolve_checkpoint_dir)

    if not os.path.exists(os.path.join(root, "latest")):
        return None, "none"
    try:
        ckpt = resolve_checkpoint_dir(root)
        info = read_info(ckpt)
        check_files(ckpt, info, read_metadata(ckpt))
    except CheckpointError as e:
        return None, f"PARTIAL: {e}"
    return int(info["iteration"]), "complete"


def metrics_iterations(path: str) -> list[int]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["iteration"] for line in f if line.strip()]


def run_job(argv: list[str], world: int, workdir: str, tag: str) -> list[int | None]:
    """A clean training job of ``world`` ranks (no fault); every rank's exit code. The tests swap in
    tests.harness.run_ranks (forked from a process that already imported torch: cheaper, same numerics)."""
    return run_to_end(launch_ranks(argv, world, workdir, tag), 600)


def reference_run(argv: list[str], world: int, workdir: str, train_iters: int) -> str:
    """The uninterrupted run (same flags, seed and layout), saved once at the end; returns its last checkpoint."""
    ref = os.path.join(workdir, "reference")
    codes = run_job(argv + ["--train-iters", str(train_iters), "--save", ref], world, workdir, "reference")
    if codes != [0] * world:
        raise RuntimeError(f"the reference run failed: exit codes {codes}; see {workdir}/reference.rank*.log")
    return os.path.join(ref, f"iter_{train_iters:07d}")


# ---- the trials ----------------------------------------------------------------------------------
def _reports(text: str) -> list[tuple[int, str, str]]:
    """(rank, activity, 'failed after 1.2s' | 'has run for 8.1s') of every watchdog report in ``text``."""
    return [(int(m[1]), m[2], f"{m[3]} {m[4]}s") for m in REPORT_RE.finditer(text)]


def trial_rank_killed_restart(workdir: str, quick: bool) -> dict[str, Any]:
    """SIGKILL of rank 1 in iteration 5 under torchrun --max-restarts 1; compare with an uninterrupted run."""
    iters, save_every, fault_it = (8, 3, 5) if quick else (16, 5, 12)
    argv = model_args(quick) + ["--pipeline-model-parallel-size", "2", "--comm-timeout", str(comm_timeout(quick))]
    ref = reference_run(argv, 2, workdir, iters)
    ck = os.path.join(workdir, "ck")
    metrics = os.path.join(workdir, "metrics.jsonl")
    job = torchrun(argv + ["--train-iters", str(iters), "--save", ck, "--load", ck, "--save-interval",
                           str(save_every), "--metrics-file", metrics], 2, workdir, "torchrun",
                   env={"MEGARESHARD_INJECT_FAULT": f"kill@1:{fault_it}"}, max_restarts=1)
    code = run_to_end([job], 600)[0]
    text = job.text()
    t_fault = job.first(r"injecting fault 'kill'")
    t_restart = job.first(r"checkpoint: loaded .*iter_")
    t_detect = next((t for t, line in job.lines if t_fault is not None and t >= t_fault
                     and re.search(r"\[watchdog\]|failed \(exitcode", line)), None)
    reports = _reports(text)
    diff = bitwise_diff(ref, os.path.join(ck, f"iter_{iters:07d}")) if code == 0 else f"torchrun exit {code}"
    its = metrics_iterations(metrics)
    redone = len(its) - len(set(its))
    last_save = (fault_it - 1) // save_every * save_every
    return {"fault": "rank-killed-restart", "detected": t_fault is not None and t_restart is not None,
            "how": (f"rank 1 SIGKILLed in iteration {fault_it}; survivor reports: "
                    + ("; ".join(f"rank {r} '{w}' {k}" for r, w, k in reports) or "none")
                    + f"; torchrun restarted the workers, which loaded iteration {last_save}"),
            "detect_s": None if t_fault is None or t_detect is None else round(t_detect - t_fault, 2),
            "restart_s": None if t_fault is None or t_restart is None else round(t_restart - t_fault, 2),
            "recovered": code == 0 and diff is None, "steps_lost": redone,
            "data_lost": "none: final weights and optimizer state bitwise equal to the uninterrupted run"
                         if diff is None else f"final state differs from the uninterrupted run: {diff}",
            "exit_code": code, "reports": reports, "iterations": its, "last_save": last_save,
            "expected_redone": fault_it - 1 - last_save, "log": text}


def _survivor_trial(workdir: str, quick: bool, kind: str) -> dict[str, Any]:
    """kill or stop one rank mid-iteration, no launcher: every other rank must exit non-zero with its report."""
    world, pp, victim = (3, 3, 2) if quick else (4, 2, 3)
    iters, save_every, fault_it = (8, 2, 4) if quick else (12, 4, 7)
    timeout = comm_timeout(quick)
    ck = os.path.join(workdir, "ck")
    argv = model_args(quick, layers=pp if quick else 4) + ["--pipeline-model-parallel-size", str(pp),
                                                          "--comm-timeout", str(timeout),
                                "--train-iters", str(iters), "--save", ck, "--save-interval", str(save_every)]
    jobs = launch_ranks(argv, world, workdir, kind, env={"MEGARESHARD_INJECT_FAULT": f"{kind}@{victim}:{fault_it}"})
    t_fault = jobs[victim].wait_line(r"injecting fault", 600)
    limit = timeout + 30.0  # gloo's / the watchdog's timeout, plus a loaded machine's slack
    codes = {}
    for r, j in enumerate(jobs):
        if r != victim:
            codes[r] = j.wait(limit + 600 if t_fault is None else max(0.0, t_fault + limit - time.monotonic()))
    hung = [r for r, c in codes.items() if c is None]
    for j in jobs:
        j.kill()
    per_rank = {}
    for r, j in enumerate(jobs):
        if r == victim:
            continue
        rep = _reports(j.text())
        per_rank[r] = {"code": codes[r], "exit_s": None if j.exit_t is None or t_fault is None
                       else round(j.exit_t - t_fault, 2), "report": rep[0] if rep else None,
                       "last": j.text().splitlines()[-1:]}
    ok = t_fault is not None and not hung and all(v["code"] not in (0, None) and v["report"]
                                                  for v in per_rank.values())
    latest, verdict = latest_state(ck)
    last_save = (fault_it - 1) // save_every * save_every
    exits = [v["exit_s"] for v in per_rank.values() if v["exit_s"] is not None]
    what = "SIGKILLed" if kind == "kill" else "SIGSTOPped"
    return {"fault": f"rank-{'killed' if kind == 'kill' else 'stopped'}", "detected": ok,
            "how": (f"rank {victim} {what} in iteration {fault_it}; " + "; ".join(
                f"rank {r} exit {v['code']} after {v['exit_s']}s: " +
                (f"'{v['report'][1]}' {v['report'][2]}" if v["report"] else "NO REPORT")
                for r, v in per_rank.items()) + (f"; HUNG: ranks {hung}" if hung else "")),
            "detect_s": max(exits) if exits and not hung else None, "recovered": False,
            "steps_lost": fault_it - 1 - last_save,
            "data_lost": (f"none: latest = iteration {latest}, complete"
                          if verdict == "complete" and latest == last_save
                          else f"latest: {latest} ({verdict}), expected iteration {last_save}"),
            "per_rank": per_rank, "hung": hung, "latest": latest, "latest_verdict": verdict,
            "last_save": last_save, "limit_s": limit, "comm_timeout": timeout}


def trial_rank_killed(workdir: str, quick: bool) -> dict[str, Any]:
    return _survivor_trial(workdir, quick, "kill")


def trial_rank_stopped(workdir: str, quick: bool) -> dict[str, Any]:
    return _survivor_trial(workdir, quick, "stop")


def script_env(workdir: str, quick: bool, **extra: str) -> dict[str, str]:
    """Environment for examples/pretrain_gpt_distributed.sh: one node of 2 CPU ranks, the tiny model."""
    h, layers, seq = ("32", "2", "16") if quick else ("64", "4", "32")
    env = _env(workdir, NNODES="1", NODE_RANK="0", GPUS_PER_NODE="2", DEVICE="cpu", TP="1", PP="2",
               NUM_LAYERS=layers, HIDDEN_SIZE=h, NUM_HEADS="4", SEQ_LENGTH=seq, MICRO_BATCH="2", GLOBAL_BATCH="8",
               VOCAB_SIZE="100", LR="1e-3", MIN_LR="1e-4", WARMUP="2", LOG_INTERVAL="1", EVAL_INTERVAL="0",
               RUN_DIR=os.path.join(workdir, "run"), CHECKPOINT_PATH=os.path.join(workdir, "ck"),
               MASTER_PORT=str(free_port()), PYTHON=sys.executable, COMM_TIMEOUT=str(comm_timeout(quick)),
               PREFLIGHT_TIMEOUT="60")
    env.update(extra)
    return env


def script_argv(env: dict[str, str]) -> list[str]:
    """The pretrain_gpt.py arguments the launch script would run (its DRY_RUN output)."""
    import shlex

    out = subprocess.run(["bash", "examples/pretrain_gpt_distributed.sh"], env={**env, "DRY_RUN": "1"}, cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    argv = shlex.split(out.strip().splitlines()[-1])
    return argv[argv.index("pretrain_gpt.py") + 1:]


def _without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` without ``flag VALUE`` pairs (and bare ``--exit-signal-handler``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = a != "--exit-signal-handler"
        else:
            out.append(a)
    return out


def trial_preempted(workdir: str, quick: bool) -> dict[str, Any]:
    """SIGTERM to the launch script mid-run: save at the next iteration boundary, exit 0; the next job
    (the same flags) continues and ends bitwise equal to an uninterrupted run."""
    iters = 40 if quick else 80
    env = script_env(workdir, quick, TRAIN_ITERS=str(iters))
    job = Job.start("script", ["bash", "examples/pretrain_gpt_distributed.sh"], env,
                    os.path.join(workdir, "script.log"))
    t_seen = job.wait_line(r"iteration\s+3/", 600)
    t_term = time.monotonic()
    if t_seen is not None:
        job.proc.send_signal(signal.SIGTERM)
    code = job.wait(300)
    job.kill()
    t_recv = job.first(r"SIGTERM received")
    ck = env["CHECKPOINT_PATH"]
    saved, verdict = latest_state(ck)
    m = re.search(r"exiting at iteration (\d+) on SIGTERM", job.text())
    stopped_at = int(m[1]) if m else None
    argv = _without(script_argv(env), "--save", "--load", "--save-interval", "--metrics-file", "--exit-signal-handler")
    diff, code2, resumed_from = "not run", None, None
    if code == 0 and saved is not None:
        codes = run_job(argv + ["--load", ck, "--save", ck], 2, workdir, "next-job")
        code2 = 0 if codes == [0, 0] else codes
        with open(os.path.join(workdir, "next-job.rank0.log"), encoding="utf-8", errors="replace") as f:
            m = re.search(r"checkpoint: loaded \S+ \(iteration (\d+)", f.read())
        resumed_from = int(m[1]) if m else None
        if resumed_from != saved:  # bitwise equality alone would also hold for a job that started over
            code2 = f"the next job resumed from {resumed_from}, not from the saved iteration {saved}"
        ref = reference_run(_without(argv, "--train-iters"), 2, workdir, iters)
        diff = bitwise_diff(ref, os.path.join(ck, f"iter_{iters:07d}")) if code2 == 0 else f"next job: {code2}"
    detected = t_seen is not None and code == 0 and stopped_at is not None and saved == stopped_at
    return {"fault": "preempted", "detected": detected,
            "how": (f"SIGTERM to examples/pretrain_gpt_distributed.sh at iteration >= 3: the ranks agreed at the next "
                    f"iteration boundary, saved iteration {saved} ({verdict}), exit {code} "
                    f"{round(job.exit_t - t_term, 1) if job.exit_t else '?'}s after the signal"
                    if t_seen is not None else "the run never reached iteration 3"),
            "detect_s": round(t_recv - t_term, 2) if t_recv is not None and t_seen is not None else None,
            "exit_s": round(job.exit_t - t_term, 2) if job.exit_t and t_seen is not None else None,
            "recovered": diff is None, "steps_lost": 0 if detected else None,
            "data_lost": "none: the next job ends bitwise equal to the uninterrupted run" if diff is None
                         else f"the next job differs from the uninterrupted run: {diff}",
            "exit_code": code, "stopped_at": stopped_at, "saved": saved, "resumed_from": resumed_from,
            "log": job.text()}


def _node_missing(workdir: str, quick: bool, rdzv: str) -> dict[str, Any]:
    timeout = 3 if quick else 10
    env = script_env(workdir, quick, NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", RDZV=rdzv,
                     PREFLIGHT_TIMEOUT=str(timeout), TRAIN_ITERS="2")
    job = Job.start("node0", ["bash", "examples/pretrain_gpt_distributed.sh"], env,
                    os.path.join(workdir, f"node0-{rdzv}.log"))
    code = job.wait(timeout + 120)
    job.kill()
    text = job.text()
    named = "missing node rank 1" in text and re.search(r"joined: node 0 on \S+", text) is not None
    t_start = job.first(r"megareshard pre-flight: node 0")
    t_named = job.first(r"missing node rank")
    elapsed = round(t_named - t_start, 2) if t_start is not None and t_named is not None else None
    msg = next((line for line in text.splitlines() if "did not join" in line), "no message")
    return {"fault": f"node-missing-{rdzv}", "detected": named and code not in (0, None),
            "how": f"node pre-flight before torchrun ({rdzv} rendezvous), exit {code}: {msg.strip()[:200]}",
            "detect_s": elapsed, "recovered": False, "steps_lost": 0,
            "data_lost": "none: nothing started", "exit_code": code, "timeout": timeout,
            "wall_s": round(job.exit_t - job.t0, 2) if job.exit_t else None,
            "preflight_started": t_start is not None, "log": text}


def trial_node_missing_static(workdir: str, quick: bool) -> dict[str, Any]:
    return _node_missing(workdir, quick, "static")


def trial_node_missing_c10d(workdir: str, quick: bool) -> dict[str, Any]:
    return _node_missing(workdir, quick, "c10d")


class _LineTap:
    """A text stream for emulate_cluster.run_cluster: keeps timestamped lines, fires a callback once on a pattern."""

    def __init__(self, log: str, pattern: str, on_match: Callable[[], None]) -> None:
        self.lines: list[tuple[float, str]] = []
        self._f = open(log, "w", encoding="utf-8")
        self._rx, self._on, self._fired = re.compile(pattern), on_match, False
        self._buf = ""

    def write(self, s: str) -> None:
        self._f.write(s)
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self.lines.append((time.monotonic(), line))
            if not self._fired and self._rx.search(line):
                self._fired = True
                threading.Thread(target=self._on, daemon=True).start()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def trial_nic_down(workdir: str, quick: bool) -> dict[str, Any]:
    """2 emulated hosts × 1 rank (pp 2); host 1's eth0 goes down in iteration 3: both ranks must report and exit."""
    base = {"fault": "nic-down", "recovered": False, "steps_lost": None}
    if os.geteuid() != 0:
        return {**base, "detected": False, "how": "skipped: needs root", "detect_s": None, "data_lost": "n/a"}
    from lab.cluster import emulate_cluster as ec

    timeout = comm_timeout(quick)
    layout = ec.ClusterLayout(prefix=f"mrc{os.getpid() % 100000}", hosts=2, rate="1gbit")
    ck = os.path.join(workdir, "ck")
    iters = 40 if quick else 80
    cmd = ["pretrain_gpt.py", *model_args(quick), "--pipeline-model-parallel-size", "2", "--comm-timeout",
           str(timeout), "--train-iters", str(iters), "--save", ck, "--save-interval", "2"]
    cut = {}

    def nic_down() -> None:
        cut["t"] = time.monotonic()
        subprocess.run(["ip", "netns", "exec", layout.host_ns(1), "ip", "link", "set", "eth0", "down"], check=False)

    tap = _LineTap(os.path.join(workdir, "cluster.log"), r"iteration\s+3/", nic_down)
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        code = ec.run_cluster(layout, 1, free_port(), cmd, out=tap,
                              timeout_s=600)
    except ec.ClusterError as e:
        return {**base, "detected": False, "how": f"skipped: {e}", "detect_s": None, "data_lost": "n/a"}
    finally:
        os.chdir(cwd)
        tap.close()
    text = "\n".join(line for _, line in tap.lines)
    reports = _reports(text)
    ranks = sorted({r for r, _, _ in reports})
    t_rep = [t for t, line in tap.lines if "[watchdog] rank" in line]
    latest, verdict = latest_state(ck)
    done = [int(m[1]) for m in re.finditer(r"iteration\s+(\d+)/", text)]
    detected = "t" in cut and ranks == [0, 1] and code != 0
    base["steps_lost"] = max(done) - latest if done and latest is not None else None
    return {**base, "detected": detected,
            "how": (f"eth0 of {layout.host_ns(1)} down at iteration >= 3; exit {code}; reports: "
                    + ("; ".join(f"rank {r} '{w}' {k}" for r, w, k in reports) or "none")),
            "detect_s": round(max(t_rep) - cut["t"], 2) if t_rep and "t" in cut else None,
            "data_lost": f"none: latest = iteration {latest}, complete" if verdict == "complete"
                         else f"latest: {latest} ({verdict})", "reports": reports, "log": text}


def _pids_of(job: Job, script: str = "pretrain_gpt.py") -> dict[int, int]:
    """{global rank: pid} of the workers a torchrun job started (its children running ``script``)."""
    out = {}
    for pid in _descendants(job.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if script.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            out[int(env[b"RANK"])] = pid
        except (OSError, KeyError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_workers(job: Job, n: int, timeout: float) -> dict[int, int]:
    """The ``n`` workers of a torchrun job once all have started (or what there is at the deadline)."""
    deadline = time.monotonic() + timeout
    pids = _pids_of(job)
    while len(pids) < n and time.monotonic() < deadline and job.proc.poll() is None:
        job.wait(0.2)                       # returns at once if torchrun ends; else a bounded pause between looks
        pids = _pids_of(job)
    return pids


def writers_trial(workdir: str, quick: bool, *, second: bool = True, kill: bool = True,
                  resume: bool = True) -> dict[str, Any]:
    """Job A (torchrun, 2 ranks, ``--save D --load D``) trains; once it saved, job B starts on the same ``--save``
    and must stop at start-up with one line naming A's rank 0 (host, pid, start time) while A's checkpoints stay
    intact (``second``); then A's torchrun is SIGKILLed and every A worker must be gone within --comm-timeout,
    each node saying why (``kill``); the lock died with A: this process takes it at once, and (``resume``) job C
    on the same directory resumes from A's latest."""
    timeout = comm_timeout(quick)
    ck = os.path.join(workdir, "ck")
    base = model_args(quick) + ["--comm-timeout", str(timeout), "--save", ck, "--load", ck]
    # after its first save A only has to stay alive: its ranks turn stragglers (lab.chaos.faults 'slow') and leave the
    # CPU to B's start-up
    a = torchrun(base + ["--train-iters", "100000", "--save-interval", "5"], 2, workdir, "job-a",
                 env={"MEGARESHARD_INJECT_FAULT": "slow@0:6,slow@1:6"})
    out: dict[str, Any] = {}
    try:
        t_saved = a.wait_line(r"saved iteration 5 ", 600)
        pids = _wait_workers(a, 2, 60)
        out["a_started"] = t_saved is not None and len(pids) == 2
        if second and out["a_started"]:
            before = sorted(n for n in os.listdir(ck) if n.startswith("iter_"))
            b = torchrun(base + ["--train-iters", "4"], 2, workdir, "job-b")
            code = b.wait(600)
            b.kill()
            text = b.text()
            busy = [line for line in text.splitlines() if "is in use by another job" in line]
            latest, verdict = latest_state(ck)
            after = sorted(n for n in os.listdir(ck) if n.startswith("iter_"))
            out["second"] = {"code": code, "lines": busy, "wall_s": round(b.exit_t - b.t0, 2) if b.exit_t else None,
                             "a_rank0_pid": pids.get(0), "iterations_before": before, "iterations_after": after,
                             "latest": latest, "latest_verdict": verdict, "started_training": "iteration " in text
                             and re.search(r"iteration\s+\d+/", text) is not None, "log": text}
        if kill and out["a_started"]:
            t_kill = time.monotonic()
            os.kill(a.proc.pid, signal.SIGKILL)
            deadline = t_kill + timeout
            gone: dict[int, float] = {}
            while len(gone) < len(pids) and time.monotonic() < deadline:
                for r, pid in pids.items():
                    if r not in gone and not _alive(pid):
                        gone[r] = round(time.monotonic() - t_kill, 2)
                if len(gone) < len(pids):
                    a.wait(0.05)            # a bounded pause between looks at /proc (the pipe closes last)
            a.wait(30)                      # its output pipe closes with the last worker
            text = a.text()
            latest, verdict = latest_state(ck)
            from megareshard.checkpoint.lock import try_lock_dir

            probe, holder = try_lock_dir(ck)
            if probe is not None:
                probe.release()
            out["kill"] = {"gone_s": gone, "survivors": sorted(set(pids) - set(gone)), "limit_s": timeout,
                           "lines": [line for line in text.splitlines() if "launcher" in line and "is gone" in line],
                           "latest": latest, "latest_verdict": verdict, "lock_holder_after": holder}
            if latest is not None and resume:  # one process shows the lock is free (it loads A's dp 2 into dp 1)
                c = launch_ranks(base + ["--train-iters", str(latest + 1)], 1, workdir, "job-c")[0]
                out["kill"]["next_code"] = c.wait(600)
                c.kill()
                m = re.search(r"checkpoint: loaded \S+ \(iteration (\d+)", c.text())
                out["kill"]["next_resumed_from"] = int(m[1]) if m else None
                out["kill"]["next_latest"] = latest_state(ck)[0]
                out["kill"]["next_log"] = c.text()
    finally:
        a.kill()
    out["log"] = a.text()
    return out


def trial_second_writer(workdir: str, quick: bool) -> dict[str, Any]:
    r = writers_trial(workdir, quick, kill=False)
    s = r.get("second") or {}
    ok = (s.get("code") not in (0, None) and len(s.get("lines", [])) == 1 and f"pid {s.get('a_rank0_pid')} "
          in s["lines"][0] and s.get("latest_verdict") == "complete" and not s.get("started_training"))
    return {"fault": "second-writer", "detected": ok,
            "how": (f"a second job on the same --save while the first trains: exit {s.get('code')} at start-up: "
                    + (s["lines"][0].split("error: ", 1)[-1].replace(workdir, "W")[:150] if s.get("lines")
                       else "NO LINE") if s else "the first job never saved"),
            "detect_s": s.get("wall_s"), "recovered": None, "steps_lost": 0,  # the first job never stopped
            "data_lost": (f"none: the first job's checkpoints intact (latest = iteration {s.get('latest')}, "
                          f"{s.get('latest_verdict')})" if s.get("latest_verdict") == "complete"
                          else f"latest: {s.get('latest')} ({s.get('latest_verdict')})"), **r}


def trial_launcher_killed(workdir: str, quick: bool) -> dict[str, Any]:
    r = writers_trial(workdir, quick, second=False)
    k = r.get("kill") or {}
    ok = bool(k) and not k["survivors"] and len(k["lines"]) >= 1 and k["lock_holder_after"] is None
    resumed = k.get("next_code") == 0 and k.get("next_resumed_from") == k.get("latest")
    return {"fault": "launcher-killed", "detected": ok,
            "how": (f"SIGKILL of torchrun mid-run: every worker gone after {max(k['gone_s'].values(), default=None)}s "
                    f"(--comm-timeout {k['limit_s']:g}s): " + (k["lines"][0].split("error: ", 1)[-1][:120]
                                                                if k["lines"] else "NO LINE")
                    + f"; the next job took the lock and resumed from iteration {k.get('next_resumed_from')}"
                    if k else "the job never started"),
            "detect_s": max(k["gone_s"].values()) if k and k["gone_s"] else None, "recovered": resumed,
            "steps_lost": None, "data_lost": (f"none: latest = iteration {k.get('latest')}, "
                                              f"{k.get('latest_verdict')}" if k else "n/a"), **r}


def _contract(trial: Callable[[str, bool], dict[str, Any]]) -> Callable[[str, bool], dict[str, Any]]:
    """The runner's view of a trial: exactly KEYS (the trial itself returns more, for the tests)."""
    def fn(workdir: str, quick: bool) -> dict[str, Any]:
        return _pick(trial(workdir, quick))
    fn.__name__ = trial.__name__
    return fn


def _pick(detail: dict[str, Any]) -> dict[str, Any]:
    out = {k: detail[k] for k in KEYS}
    out["detect_s"] = None if out["detect_s"] is None else float(out["detect_s"])
    out["steps_lost"] = None if out["steps_lost"] is None else int(out["steps_lost"])
    return out


TRIALS: list[tuple[str, Callable[[str, bool], dict[str, Any]]]] = [
    ("rank-killed-restart", trial_rank_killed_restart),
    ("rank-killed", trial_rank_killed),
    ("rank-stopped", trial_rank_stopped),
    ("preempted", trial_preempted),
    ("node-missing-static", trial_node_missing_static),
    ("node-missing-c10d", trial_node_missing_c10d),
    ("second-writer", trial_second_writer),
    ("launcher-killed", trial_launcher_killed),
    ("nic-down", trial_nic_down),
]
FAULTS: list[tuple[str, Callable[[str, bool], dict[str, Any]]]] = [(n, _contract(f)) for n, f in TRIALS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small CI size")
    ap.add_argument("--only", action="append", help="run only this trial (repeatable)")
    ap.add_argument("--workdir", help="keep the trials' logs and checkpoints here (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    names = [n for n, _ in FAULTS]
    for n in args.only or []:
        if n not in names:
            ap.error(f"--only {n}: not one of {', '.join(names)}")
    for name, fn in FAULTS:
        if args.only and name not in args.only:
            continue
        work = os.path.join(args.workdir, name) if args.workdir else tempfile.mkdtemp(prefix=f"mr-chaos-{name}-")
        os.makedirs(work, exist_ok=True)
        try:
            print(json.dumps(fn(work, args.quick)), flush=True)
        finally:
            if not args.workdir:
                shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
