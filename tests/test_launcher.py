"""megareshard-run (``python -m megareshard.launch``): torchrun's arguments and elastic agent, a failing rank told in
one line with where its full log is (no ChildFailedError report), SIGTERM forwarded to the workers, which save and
exit 0 as the launcher does; and the quick start keeps a previous run instead of removing it. SIGTERM to the
launcher during real training (the ranks agree, save at the next boundary and exit 0, and so does the launcher) is
tests/reliability/test_ranks_preempt.py: its launch script execs the launcher, which takes the signal."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "megareshard.launch", "--standalone"]

# a worker as cheap as a worker can be (no torch): rank 1 fails with the entry points' one line, rank 0 trains on
WORKER = """\
import os, signal, sys, time
rank = int(os.environ["RANK"])
if os.environ.get("SAVE_ON_SIGTERM") == "1":
    def on_term(signum, frame):
        print(f"rank {rank}: saved", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
print(f"rank {rank}: iteration 1", flush=True)
if rank == 1 and os.environ.get("FAIL") == "1":
    time.sleep(0.2)
    print("a warning on stderr first", file=sys.stderr, flush=True)
    sys.stderr.write("worker.py: error: the loss became NaN in iteration 3 (injected)\\n")
    sys.exit(1)
time.sleep(60)
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    return env


class _Reader:
    """A process's merged output, read as it comes (so a test can wait for a line)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines, self.cond = proc, [], threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.lines.append(None)
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self.cond:
            while not any(line and re.search(pattern, line) for line in self.lines):
                if None in self.lines or not self.cond.wait(max(0.0, end - time.monotonic())):
                    return False
        return True

    def text(self) -> str:
        with self.cond:
            return "".join(line for line in self.lines if line)


def _start(argv: list[str], env: dict[str, str], cwd: Path) -> _Reader:
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return _Reader(proc)


def test_a_failing_rank_is_one_line_and_its_log_not_torchruns_report(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    p = subprocess.run([*LAUNCH, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "worker.py"],
                       env=_env(tmp_path, FAIL="1"), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out                                  # the failing rank's exit code
    assert "ChildFailedError" not in out and "Traceback" not in out and "Root Cause" not in out, out
    assert "closing signal" not in out and "failed (exitcode" not in out, out   # torch's own lines, said below
    assert "rank 0: iteration 1" in p.stdout and "rank 1: iteration 1" in p.stdout   # the console as under torchrun
    said = [line for line in p.stderr.splitlines() if line.startswith("megareshard-run:")]
    assert len(said) == 2, out
    assert said[0] == ("megareshard-run: rank 1 failed (exit code 1): worker.py: error: the loss became NaN in "
                       "iteration 3 (injected)"), said
    m = re.match(r"megareshard-run: its full log: (\S+/attempt_0/1/stderr\.log) \(local rank 1, pid \d+; stdout\.log "
                 r"beside it, every rank's in (\S+/attempt_0)\)$", said[1])
    assert m, said[1]
    log = Path(m[1])
    assert log.is_file() and log.is_relative_to(tmp_path / "logs")
    assert "a warning on stderr first" in log.read_text() and "the loss became NaN" in log.read_text()
    assert "rank 1: iteration 1" in (log.parent / "stdout.log").read_text()


def test_sigterm_to_the_launcher_without_a_handler_stops_without_restarting(tmp_path):
    """A worker that does not save on SIGTERM dies of it: the launcher says so and exits non-zero, and does not
    restart the workers (--max-restarts 1) as it would after a failure."""
    (tmp_path / "worker.py").write_text(WORKER)
    r = _start([*LAUNCH, "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
                "worker.py"], _env(tmp_path), tmp_path)
    try:
        assert r.wait_for(r"rank 1: iteration 1", 60) and r.wait_for(r"rank 0: iteration 1", 10), r.text()
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(60) == 128 + signal.SIGTERM, r.text()
    finally:
        r.proc.kill()
    out = r.text()
    assert out.count("rank 0: iteration 1") == 1, out             # not restarted
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    assert re.search(r"megareshard-run: SIGTERM: rank 0, rank 1 were killed by SIGTERM instead of saving: .*"
                     r"--exit-signal-handler", out), out


def _fake_quickstart(tmp_path: Path) -> tuple[Path, Path]:
    """examples/quickstart.sh in a copy of the repository's layout whose python, venv and data step are stand-ins:
    'training' writes a checkpoint and a metrics line, so the script's handling of a run directory runs in
    milliseconds."""
    root = tmp_path / "repo"
    (root / "examples").mkdir(parents=True)
    (root / "tools").mkdir()
    (root / "examples/quickstart.sh").write_text((ROOT / "examples/quickstart.sh").read_text())
    (root / "examples/prepare_data.sh").write_text("exit 0\n")
    calls = tmp_path / "calls.log"
    py = tmp_path / "python"
    py.write_text(f"""#!/bin/bash
echo "$*" >> {calls}
case " $* " in
  *" --validate-only "*|*" - "*) cat > /dev/null; exit 0 ;;
  *" pretrain_gpt.py "*)
    save=""; metrics=""; prev=""
    for a in "$@"; do
      [ "$prev" = --save ] && save=$a; [ "$prev" = --metrics-file ] && metrics=$a; prev=$a
    done
    mkdir -p "$save/iter_0000002"; echo 2 > "$save/latest"; echo "run $RUN_ID" > "$save/iter_0000002/which"
    echo '{{"iteration": 2, "loss": 5.0}}' > "$metrics" ;;
esac
exit 0
""")
    py.chmod(0o755)
    (root / "tools/ensure_venv.sh").write_text(f'VENV_PY="{py}"\n')
    return root, calls


def test_rerunning_the_quick_start_keeps_the_previous_runs_checkpoints(tmp_path):
    root, calls = _fake_quickstart(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "DATA_DIR", "EXTRA_ARGS")}

    def quickstart(run_id: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "examples/quickstart.sh"], cwd=root, env={**env, "RUN_ID": run_id},
                              capture_output=True, text=True, timeout=60)

    first = quickstart("one")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "previous run" not in first.stdout                   # nothing there yet: nothing said, nothing moved
    run = root / "runs/quickstart"
    assert (run / "checkpoints/iter_0000002/which").read_text() == "run one\n"

    for output in (run / "metrics.jsonl", run / "checkpoints"):  # the first run ended at a known time
        os.utime(output, (1.7e9, 1.7e9))
    second = quickstart("two")
    assert second.returncode == 0, second.stdout + second.stderr
    kept = sorted(p.name for p in (root / "runs").iterdir() if p.name != "quickstart")
    assert len(kept) == 1 and re.fullmatch(r"quickstart-\d{8}-\d{6}", kept[0]), kept
    assert time.strftime("quickstart-%Y%m%d-%H%M%S", time.localtime(1.7e9)) == kept[0]
    # the first run's checkpoint and metrics are kept, the new run's are where the README says
    assert (root / "runs" / kept[0] / "checkpoints/iter_0000002/which").read_text() == "run one\n"
    assert (root / "runs" / kept[0] / "metrics.jsonl").is_file()
    assert (run / "checkpoints/iter_0000002/which").read_text() == "run two\n"
    said = [line for line in second.stdout.splitlines() if "previous run" in line]
    assert said == [f"== runs/quickstart held a previous run: kept in runs/{kept[0]} (its checkpoints: "
                    f"runs/{kept[0]}/checkpoints); this run starts afresh"], second.stdout
    # and it trains through the launcher, each rank's output kept in the run directory
    launches = [line for line in calls.read_text().splitlines()
                if "pretrain_gpt.py" in line and "--validate-only" not in line]
    expected = "-m megareshard.launch --standalone --nproc-per-node 8 --log-dir runs/quickstart/logs pretrain_gpt.py "
    assert len(launches) == 2 and all(line.startswith(expected) for line in launches), launches


def test_the_console_script_is_the_launcher():
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^megareshard-run = "megareshard\.launch\.launcher:main"$', scripts, re.M), scripts
    # (read, not imported: `import megareshard.launch` loads torch, seconds of a test's budget)
    assert re.search(r"^def main\(argv: list\[str\] \| None = None\) -> int:", (ROOT / "megareshard/launch/launcher.py")
                     .read_text(), re.M)
    assert "from megareshard.launch.launcher import main" in (ROOT / "megareshard/launch/__main__.py").read_text()
