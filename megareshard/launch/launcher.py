"""``megareshard-run`` (``python -m megareshard.launch``): torchrun, with a failure told in one line.

It takes torchrun's arguments (``torch.distributed.run``'s own parser) and runs torch's own elastic agent
(``elastic_launch``: rendezvous, restarts, ``--max-restarts``, the per-rank log files). Three things differ:

* **A failure is one line and a path.** Under plain torchrun a worker's one-line error is followed by 40–110
  lines of torchrun's ``ChildFailedError`` report and traceback. Here the launcher prints the failing rank's
  own error line (the ``PROG: error: ...`` line of ``megareshard/entry.py``, or else the last line that rank
  wrote to stderr) and where its full log is, and exits with that rank's exit code (1 if a signal killed it)::

      megareshard-run: rank 1 failed (exit code 1): pretrain_gpt.py: error: ...
      megareshard-run: its full log: LOGDIR/<run>/attempt_0/1/stderr.log (local rank 1, pid 4242; stdout.log
      beside it, every rank's in LOGDIR/<run>/attempt_0)

* **Every rank's output is kept.** Unless ``--redirects``/``--tee`` say otherwise, both streams are teed
  (torchrun's ``--tee 3``): on the console as under torchrun, without a ``[default0]:`` prefix on each line
  (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` sets one), and in ``--log-dir`` (torch's default: a new
  ``torchelastic_*`` directory under ``$TMPDIR``).

* **SIGTERM saves and exits 0.** torchrun answers SIGTERM by sending SIGTERM to its workers and, after
  ``--shutdown-timeout`` (30 s), SIGKILL, then exits 1 — a save that takes longer is cut off. The launcher
  instead forwards SIGTERM to its workers and waits for them as long as they take: workers started with
  ``--exit-signal-handler`` save at the next iteration boundary and exit 0, and so does the launcher. If a
  worker does not exit 0 (no ``--exit-signal-handler``: SIGTERM kills it), the launcher says which and exits
  non-zero without restarting anyone. SIGINT, SIGHUP and SIGQUIT keep torchrun's handling.

``import megareshard.launch`` does not import this module.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import sys
import uuid
from dataclasses import dataclass

__all__ = ["main"]

PROG = "megareshard-run"
# the training entry points' one line (megareshard/entry.py), as argparse words it too
_ERROR_LINE = re.compile(r"^\S+: error: ")
# what a rank's line says when it stopped because a peer failed (megareshard/launch/watchdog.py): not the cause
_PEER_REPORT = "(a peer rank died"


class _Terminated(Exception):
    """Raised out of the SIGTERM handler when a worker did not exit 0: the agent then stops (no restart)."""

    def __init__(self, ranks: list["_Rank"]):
        super().__init__("SIGTERM")
        self.ranks = ranks


class _NoPrefix(str):
    """An empty log-line prefix that torch's agent takes as set (it builds prefixes only from a truthy template),
    so teed lines reach the console as the worker wrote them."""

    def __bool__(self) -> bool:
        return True


@dataclass
class _Rank:
    rank: int | None
    local_rank: int | None
    pid: int
    exitcode: int | None   # negative: killed by that signal; None: unknown
    log_dir: str | None    # the directory holding its stdout.log, stderr.log, error.json

    def who(self) -> str:
        return "a worker" if self.rank is None else f"rank {self.rank}"

    def where(self) -> str:
        local = "" if self.local_rank is None else f"local rank {self.local_rank}, "
        return f"{local}pid {self.pid}"

    def how(self) -> str:
        if self.exitcode is None:
            return "exit status unknown"
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exit code {self.exitcode}"


def _say(line: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"{PROG}: {line}\n")
    sys.stderr.flush()


def _error_line(rank: _Rank, *, last_resort: bool) -> str | None:
    """The rank's one-line error from its stderr.log: its last ``PROG: error:`` line, or (``last_resort``) its last
    non-empty line (a traceback's ``ValueError: ...``)."""
    if not rank.log_dir:
        return None
    try:
        with open(os.path.join(rank.log_dir, "stderr.log"), errors="replace") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line
    return lines[-1].strip() if lines and last_resort else None


def _report(ranks: list[_Rank], what: str) -> int:
    """Print the one line and where the log is; return the exit code for the launcher."""
    # the root cause first: a rank a signal killed outright (SIGKILL, SIGSEGV; not the SIGTERM the agent sends the
    # others once one failed), then one that printed its error line, then one that only reported its peer's failure
    # (megareshard/launch/watchdog.py), then one that exited non-zero without a line (a traceback's last line)
    def tier(r: _Rank, line: str | None) -> int:
        if r.exitcode is not None and r.exitcode < 0 and r.exitcode != -signal.SIGTERM:
            return 0
        if line:
            return 2 if _PEER_REPORT in line else 1
        return 3 if r.exitcode is not None and r.exitcode > 0 else 4

    lines = {id(r): _error_line(r, last_resort=False) for r in ranks}
    ranks = sorted(ranks, key=lambda r: (tier(r, lines[id(r)]), r.rank if r.rank is not None else 1 << 30))
    if not ranks:
        _say(what)
        return 1
    chosen = ranks[0]
    line = lines[id(chosen)] or (_error_line(chosen, last_resort=True) if tier(chosen, None) == 3 else None)
    # the ranks the agent stopped because this one failed are not news; others that failed on their own are
    others = sum(1 for r in ranks if r is not chosen and r.exitcode != -signal.SIGTERM)
    also = f" (and {others} other rank{'s' if others > 1 else ''})" if others else ""
    _say(f"{chosen.who()}{also} {what} ({chosen.how()})" + (f": {line}" if line else ""))
    if chosen.log_dir and os.path.isfile(os.path.join(chosen.log_dir, "stderr.log")):
        _say(f"its full log: {os.path.join(chosen.log_dir, 'stderr.log')} ({chosen.where()}; stdout.log beside it, "
             f"every rank's in {os.path.dirname(chosen.log_dir)})")
    elif chosen.log_dir:
        _say(f"its stderr was not recorded (--redirects/--tee leave it out; {chosen.where()}); the logs are in "
             f"{os.path.dirname(chosen.log_dir)}")
    code = chosen.exitcode
    return code if code is not None and 0 < code < 256 else 1


def _attempt_log_dir(config) -> str | None:
    """The directory of the last attempt's per-rank logs: ``<--log-dir>/<run id>_<random>/attempt_<n>``."""
    specs = config.logs_specs
    run_dir = getattr(specs, "_run_log_dir", None)  # DefaultLogsSpecs keeps the one it made
    if not run_dir:
        root = getattr(specs, "root_log_dir", None)
        try:
            runs = [os.path.join(root, d) for d in os.listdir(root) if d.startswith(f"{config.run_id}_")]
        except (OSError, TypeError):
            return None
        run_dir = max(runs, key=os.path.getmtime, default=None)
    try:
        attempts = [d for d in os.listdir(run_dir) if re.fullmatch(r"attempt_\d+", d)]
    except (OSError, TypeError):
        return None
    if not attempts:
        return None
    return os.path.join(run_dir, max(attempts, key=lambda d: int(d.split("_")[1])))


def _children() -> list[int]:
    """This process's child processes (the agent's workers), from /proc."""
    me, pids = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == me:
            pids.append(int(name))
    return sorted(pids)


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _wait_exited(pid: int) -> int | None:
    """Block until child ``pid`` has exited, leaving it to the agent to reap (WNOWAIT); its exit code (negative:
    the signal that killed it)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class _Preemption:
    """The launcher's SIGTERM handler (it runs in the main thread, where the agent monitors its workers)."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum, frame) -> None:
        if self.received:  # a second SIGTERM while the workers save: already forwarded
            return
        self.received = True
        workers = []
        for pid in _children():
            env = _environ(pid)
            error_file = env.get("TORCHELASTIC_ERROR_FILE")
            workers.append(_Rank(int(env["RANK"]) if env.get("RANK", "").isdigit() else None,
                                 int(env["LOCAL_RANK"]) if env.get("LOCAL_RANK", "").isdigit() else None, pid, None,
                                 os.path.dirname(error_file) if error_file and error_file != os.devnull else None))
        _say(f"SIGTERM: asking the {len(workers)} training process{'es' if len(workers) != 1 else ''} on this node to "
             "save at the next iteration boundary and exit")
        for w in workers:
            try:
                os.kill(w.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for w in workers:
            w.exitcode = _wait_exited(w.pid)
        if workers and all(w.exitcode == 0 for w in workers):
            return  # the agent sees every worker succeed: the launcher exits 0
        raise _Terminated([w for w in workers if w.exitcode != 0])


def _line_buffered() -> None:
    """Teed worker lines and the launcher's own reach a pipe (a log file, `| tee`) as they are written."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass


def _prepare(args) -> None:
    """What ``torch.distributed.run.run`` does to the arguments before ``config_from_args``."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def main(argv: list[str] | None = None) -> int:
    _line_buffered()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    parser = torchrun.get_args_parser()
    parser.prog = PROG
    parser.description = ("torchrun's arguments and agent; a failing rank is reported in one line with where its "
                          "log is, and SIGTERM is forwarded to the workers (which save and exit 0 with "
                          "--exit-signal-handler). " + (parser.description or ""))
    args = parser.parse_args(argv)
    if args.redirects == "0" and args.tee == "0":
        args.tee = "3"  # every rank's stdout and stderr on the console and in its log file
    _prepare(args)
    config, cmd, cmd_args = torchrun.config_from_args(args)

    if config.log_line_prefix_template is None:
        config.log_line_prefix_template = _NoPrefix("")
    # SIGTERM is this launcher's (below), not torch's (SIGTERM, then SIGKILL after --shutdown-timeout)
    handled = getattr(config, "signals_to_handle", None) or os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE",
                                                                           "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    kept = [s.strip() for s in handled.split(",") if s.strip() not in ("", "SIGTERM")]
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(kept)  # older torch reads only this
    if hasattr(config, "signals_to_handle"):
        config.signals_to_handle = ",".join(kept)
    preemption = _Preemption()
    signal.signal(signal.SIGTERM, preemption)
    # its lines ("Sending process N closing signal SIGTERM", "failed (exitcode: 1) local_rank: ...") are what the
    # report below says in one line
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)

    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        attempt = _attempt_log_dir(config)
        ranks = [_Rank(rank, f.local_rank, f.pid, f.exitcode,
                       os.path.join(attempt, str(f.local_rank)) if attempt else None)
                 for rank, f in e.failures.items()]
        return _report(ranks, "failed")
    except _Terminated as t:
        if not t.ranks:
            _say("SIGTERM while no worker was running: nothing to save")
            return 128 + signal.SIGTERM
        killed = [r for r in t.ranks if r.exitcode is not None and r.exitcode < 0]
        if len(killed) < len(t.ranks):  # one exited with an error of its own (a save that failed): its line
            return _report([r for r in t.ranks if r not in killed], "exited non-zero after SIGTERM")
        killed.sort(key=lambda r: r.rank or 0)
        if len({r.exitcode for r in killed}) == 1:
            what = f"{', '.join(r.who() for r in killed)} {'was' if len(killed) == 1 else 'were'} {killed[0].how()}"
        else:
            what = ", ".join(f"{r.who()} {r.how()}" for r in killed)
        logs = next((os.path.dirname(r.log_dir) for r in killed if r.log_dir), None)
        _say(f"SIGTERM: {what} instead of saving: a script saves and exits 0 on SIGTERM with --exit-signal-handler "
             "(pretrain_gpt.py, pretrain_utransformer.py)" + (f"; logs in {logs}" if logs else ""))
        return 128 + signal.SIGTERM
    except SignalException as e:
        _say(f"{e.sigval.name}: the workers were stopped")
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 (rendezvous and start-up errors: one line, not torch's traceback)
        text = " ".join(str(e).split()) or "(no message)"
        _say(f"error: {type(e).__name__}: {text}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if preemption.received:
        _say("SIGTERM: every worker on this node exited 0")
    return 0
