"""The lab's tests; `run_main` runs a lab tool's ``main(argv)`` in the test process, `run_as_torchrun` on forked
ranks with torchrun's environment."""
from __future__ import annotations

import contextlib
import io
import os
from types import SimpleNamespace
from typing import Callable, Sequence


def run_main(main: Callable[[Sequence[str]], int], argv: list[str], capsys) -> SimpleNamespace:
    """A tool's main() in this process (what its command line runs, without seconds of imports in a fresh
    interpreter): returncode, stdout, stderr, as ``subprocess.run`` would give them."""
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def _torchrun_rank(rank: int, world: int, module: str, argv: list[str], port: int) -> tuple[int, str, str]:
    import importlib

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WANDB_MODE="disabled")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = importlib.import_module(module).main(list(argv))
    return code, out.getvalue(), err.getvalue()


def run_as_torchrun(module: str, argv: list[str], world: int, timeout: float = 150.0) -> list[SimpleNamespace]:
    """``torchrun --nproc-per-node world -m module argv``'s workers, forked from the test harness's server with
    torchrun's environment (each making its own process group, as a worker does) instead of a launcher and a
    fresh interpreter per rank (~4.5 CPU-s of imports each on 2 cores). Each rank's returncode, stdout, stderr."""
    from tests.harness import free_port, run_ranks

    return [SimpleNamespace(returncode=c, stdout=o, stderr=e)
            for c, o, e in run_ranks(_torchrun_rank, world, module, argv, free_port(), init_group=False,
                                     timeout=timeout)]
