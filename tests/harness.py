"""Run a function on N gloo ranks and collect what each rank returns.

    from tests.harness import run_ranks

    def _check(ctx_rank, world_size, x):        # module level, so it pickles
        ...                                      # torch.distributed is initialised
        return something_picklable

    results = run_ranks(_check, 8, 3.0)          # [rank0_result, ..., rank7_result]

Why it looks like this (measured on the 2-core development machines): importing torch in 8 fresh processes costs
~7 s on 2 cores, and a plain ``fork`` of a parent that already ran an OpenMP matmul
hangs. So children come from a *forkserver* that imported torch, the trainer and DCP (another ~1.3 s per
process) once and never computes: every launch is a cheap fork of a clean process. Rendezvous goes through a
``FileStore`` in a temp dir (no port races between concurrent test runs).

On failure every rank's traceback is shown; ranks still running when another rank
failed, or when the timeout hits, have their Python stacks dumped (faulthandler) so a
deadlock says where each rank was waiting.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from lab import free_port  # noqa: F401 (the tests' port picker, the lab's trials' too)

_CTX = None
# what a rank imports anyway, imported once in the forkserver instead of in every rank: torch._dynamo alone
# (torch.optim's first optimizer imports it) costs a rank 0.7 s, ~2.5 s of an 8-rank launch on 2 cores
# (and DCP, which the trainer imports only on its first save or load: 1.2 s per checkpointing rank); pytest, which
# every rank imports when it unpickles its function from a test module: 0.1 CPU-s a rank (40 ranks: 12.3 -> 8.1
# CPU-s with it preloaded), and the suite forks hundreds
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim", "torch.profiler", "numpy.random",
            "megareshard", "megareshard.training", "megareshard.models.gpt", "megareshard.models.utransformer",
            "megareshard.checkpoint.dcp_io", "pytest"]


def _context():
    global _CTX  # a cache of the forkserver context, not parallel state
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CTX = ctx
    return _CTX


class RankFailure(AssertionError):
    """One or more ranks raised, crashed or timed out; the message holds every rank's story."""


def _child(rank: int, world_size: int, store_path: str | None, stack_path: str,
           payload: bytes, sys_path: list[str], env: dict[str, str], queue) -> None:
    sys.path[:] = sys_path
    os.environ.update(env)
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(payload)
        if store_path is None:  # run_ranks(init_group=False): the function makes its own process group, if any
            queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
            return
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        from megareshard.parallel import nccl_check

        nccl_check.maybe_install()  # MEGARESHARD_NCCL_CHECK=DIR: record every operation (run_ranks(nccl_check=True))
        failure = None
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            # reported before leaving: the peers this rank left blocked in a collective never come to leave, and
            # run_ranks' grace period for them starts at this report, not after _leave_together's 10 s
            failure = traceback.format_exc()
            queue.put((rank, False, failure))
        finally:
            nccl_check.dump()
            _leave_together(store, rank, world_size)
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        if failure is None:
            queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including DCP's BaseException subclasses
        queue.put((rank, False, traceback.format_exc()))


def _leave_together(store, rank: int, world_size: int) -> None:
    """Destroy the process group only once every rank is done with it. ``init_process_group`` can return on one
    rank while a peer is still connecting to it (gloo's full mesh), so a rank whose function communicates
    nothing could otherwise close its sockets under that peer's handshake ("Connection closed by peer"). Through
    the store, not a collective: it adds nothing to the NCCL checking mode's records, and a rank that failed
    got here too; a rank that never comes (a crash, a hang) is waited for 10 s at most."""
    from datetime import timedelta

    store.set(f"harness/left/{rank}", "1")
    try:
        store.wait([f"harness/left/{r}" for r in range(world_size)], timedelta(seconds=10))
    except Exception:
        pass


@dataclass
class _Outcome:
    ok: bool
    value: Any


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              env: dict[str, str] | None = None, nccl_check: bool = False, init_group: bool = True,
              **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the list of per-rank return values. Raises ``RankFailure`` with every rank's
    traceback (and the stacks of ranks that were still running) if any rank fails or the
    whole run exceeds ``timeout`` seconds. With ``nccl_check=True`` every rank runs in
    NCCL's checking mode (``megareshard.parallel.nccl_check``: tags forced to 0, every
    operation recorded) and the run fails if the records break NCCL's rules. With ``init_group=False`` no
    process group is made: `fn` starts its own (a launcher's rendezvous under test).
    """
    if not 1 <= world_size <= 16:
        raise ValueError(f"world_size {world_size} is outside 1..16")
    if nccl_check and not init_group:
        raise ValueError("nccl_check needs the process group run_ranks makes (init_group=True)")
    if nccl_check:
        from megareshard.parallel.nccl_check import ENV, check_logs

        with tempfile.TemporaryDirectory(prefix="mr-ncclcheck-") as logs:
            out = run_ranks(fn, world_size, *args, timeout=timeout, env={**(env or {}), ENV: logs}, **kwargs)
            bad = check_logs(logs)
            if bad:
                raise RankFailure(f"NCCL rules broken running {getattr(fn, '__qualname__', fn)}:\n" + "\n".join(bad))
        return out
    ctx = _context()
    payload = pickle.dumps((fn, args, kwargs))
    child_env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="mr-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        queue = ctx.Queue()
        procs = []
        for rank in range(world_size):
            p = ctx.Process(target=_child, name=f"rank{rank}",
                            args=(rank, world_size, store_path if init_group else None,
                                  os.path.join(tmp, f"stack{rank}"),
                                  payload, list(sys.path), child_env, queue), daemon=True)
            p.start()
            procs.append(p)
        outcomes: dict[int, _Outcome] = {}
        deadline = time.monotonic() + timeout
        first_failure_at = None
        timed_out = False
        try:
            while len(outcomes) < world_size:
                now = time.monotonic()
                if now > deadline:
                    timed_out = True
                    break
                # after one rank fails, the others usually block in a collective: give them
                # a short grace period to fail on their own, then dump their stacks.
                if first_failure_at is not None and now - first_failure_at > 5.0:
                    break
                try:
                    rank, ok, value = queue.get(timeout=0.2)
                except Exception:
                    for r, p in enumerate(procs):
                        if r not in outcomes and not p.is_alive() and p.exitcode not in (0, None):
                            # died without reporting (segfault, os._exit, OOM kill)
                            time.sleep(0.2)  # its queue message may still be in flight
                            if r not in outcomes and queue.empty():
                                outcomes[r] = _Outcome(False, f"process exited with code {p.exitcode} "
                                                              "without reporting (crash or kill)")
                                first_failure_at = first_failure_at or time.monotonic()
                    continue
                outcomes[rank] = _Outcome(ok, pickle.loads(value) if ok else value)
                if not ok and first_failure_at is None:
                    first_failure_at = time.monotonic()
            stuck = [r for r in range(world_size) if r not in outcomes]
            for r in stuck:
                if procs[r].is_alive():
                    os.kill(procs[r].pid, signal.SIGUSR1)
            if stuck:
                time.sleep(0.5)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            queue.close()
        if stuck:
            for r in stuck:
                try:
                    with open(os.path.join(tmp, f"stack{r}")) as f:
                        stack = f.read().strip()
                except OSError:
                    stack = ""
                why = "timed out" if timed_out else "still running after another rank failed"
                outcomes[r] = _Outcome(False, f"{why}; stack at that moment:\n{stack or '(no stack dumped)'}")
    failed = {r: o.value for r, o in sorted(outcomes.items()) if not o.ok}
    if failed:
        head = (f"{len(failed)} of {world_size} ranks failed running {getattr(fn, '__qualname__', fn)}"
                + (f" (timeout {timeout:.0f}s)" if timed_out else ""))
        body = "\n".join(f"----- rank {r} -----\n{msg}" for r, msg in failed.items())
        raise RankFailure(f"{head}\n{body}")
    return [outcomes[r].value for r in range(world_size)]




def _pretrain_rank(rank: int, world: int, argv: list[str], log: str) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # what pretrain_gpt.py reads besides the process group
    fd = os.open(log.format(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from pretrain_gpt import main

    try:
        return main(list(argv))
    finally:  # a forked rank ends in os._exit: what Python still buffers would never reach the log
        sys.stdout.flush()
        sys.stderr.flush()


def run_pretrain(argv: list[str], world: int, log: str, timeout: float = 600.0,
                 env: dict[str, str] | None = None) -> list[Any]:
    """``pretrain_gpt.py argv`` on ``world`` forked ranks (what torchrun's workers run, without a torchrun and a
    fresh interpreter per rank: seconds of imports each on 2 cores); rank r's stdout and stderr go to
    ``log.format(r)``. Returns each rank's exit code; raises ``RankFailure`` as `run_ranks` does."""
    return run_ranks(_pretrain_rank, world, list(argv), log, timeout=timeout,
                     env={"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), **(env or {})})
