"""Fixtures shared by test files, and the order the suite runs its files in."""
import json
import os
import subprocess
import time
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One OpenMP thread per test process (and, inherited, per tool or example a test starts), unless the caller chose:
# the suite runs two workers on 2 cores, and torch's default of one thread per core then makes every op of an
# in-process run wait, spinning, for a thread the other worker's processes keep off its core. Measured under
# the suite's load: tests/pipeline/test_runtime.py's single-process reference (a 4-layer model, 2 iterations)
# took 10-12 CPU-seconds with 2 threads, 0.2 s with 1; the file's pytest process 18.9 -> 6.8 CPU-s. The ranks
# of tests/harness.py already ran with 1 thread. Set before the test modules import torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
STDLIB = Path(sysconfig.get_paths()["stdlib"])
STDLIB_FILES = [str(STDLIB / f) for f in ("os.py", "argparse.py", "textwrap.py", "string.py", "shutil.py",
                                          "glob.py", "fnmatch.py", "queue.py", "bisect.py", "heapq.py")]


# CPU-seconds each file's tests used in a serial run (tests/update_durations.py writes it): only the order uses it
DURATIONS = ROOT / "tests" / "durations.json"
# a serial run (-n 0) with MEGARESHARD_TEST_CPU=FILE appends each test's CPU-seconds (the whole machine's, so
# its ranks and tools count too) to FILE, for tests/update_durations.py
CPU_CENSUS = os.environ.get("MEGARESHARD_TEST_CPU")


def _busy_seconds() -> float:
    """CPU-seconds the machine has been busy (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_CENSUS:
        yield
        return
    busy, start = _busy_seconds(), time.monotonic()
    yield
    with open(CPU_CENSUS, "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": item.nodeid, "cpu": round(_busy_seconds() - busy, 2),
                            "wall": round(time.monotonic() - start, 2)}) + "\n")


def pytest_collection_modifyitems(config, items):
    """Costliest files first, each file's tests together: with two workers taking whole files (tests/run.sh:
    ``--dist loadfile --no-loadscope-reorder``) a worker that finishes a file takes the next costliest, so the
    two end close together instead of one long file running alone at the end (xdist's own order, most tests
    first, started the one-test fine-tune example last). A file's cost is its CPU-seconds in
    tests/durations.json (files not in it go after those in it, those with a `slow` test first): on 2 cores
    the files whose ranks take both cores come first. Files marked `waits` go one after each of the costliest
    files. The order is the same on every worker, as xdist requires."""
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        seconds = {}
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    waiting = {item.path for item in items if item.get_closest_marker("waits")}

    def key(item):
        rel = item.path.relative_to(ROOT).as_posix() if item.path.is_relative_to(ROOT) else str(item.path)
        return -float(seconds.get(rel, 0.0)), item.path not in slow_files

    items.sort(key=key)  # stable: a file's tests stay together
    # a waiting file (timeouts, missing peers: a fraction of a core) runs on one worker while a costly file's ranks
    # take both cores, not beside another waiting file (both cores idle) or a one-core file late in the run
    files: dict[Path, list] = {}
    for it in items:
        files.setdefault(it.path, []).append(it)
    busy = [f for f in files if f not in waiting]
    waits = [f for f in files if f in waiting]
    order = [f for pair in zip(busy, waits) for f in pair] + busy[len(waits):] + waits[len(busy):]
    items[:] = [it for f in order for it in files[f]]


@pytest.fixture(scope="session")
def stdlib_text(tmp_path_factory):
    """A small version of the quick start's data: an 800-piece BPE tokenizer and a tokenized dataset
    (``tok.model``, ``text.bin``/``text.idx``) built by the real tools from ten stdlib modules."""
    d = tmp_path_factory.mktemp("stdlib_text")
    subprocess.run([sys.executable, str(ROOT / "tools/train_tokenizer.py"), "--input", *STDLIB_FILES,
                    "--model-prefix", str(d / "tok"), "--vocab-size", "800", "--quiet"], check=True)
    subprocess.run([sys.executable, str(ROOT / "tools/preprocess_data.py"), "--input", *STDLIB_FILES,
                    "--tokenizer-model", str(d / "tok.model"), "--output-prefix", str(d / "text"),
                    "--append-eod", "--quiet"], check=True)
    for ext in (".bin", ".idx"):  # the tool names its output as Megatron-LM does: PREFIX_text_document
        (d / f"text_text_document{ext}").rename(d / f"text{ext}")
    return d
