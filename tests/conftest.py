"""Fixtures shared by test files, and the order the suite runs its files in."""
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
STDLIB_FILES = [str(STDLIB / f) for f in ("os.py", "argparse.py", "textwrap.py", "string.py", "shutil.py",
                                          "glob.py", "fnmatch.py", "queue.py", "bisect.py", "heapq.py")]


# seconds each file's tests took in a fresh-clone CI run (tests/update_durations.py writes it): only the order uses it
DURATIONS = ROOT / "tests" / "durations.json"


def pytest_collection_modifyitems(config, items):
    """Longest files first, each file's tests together: with two workers taking whole files (tests/run.sh:
    ``--dist loadfile --no-loadscope-reorder``) a worker that finishes a file takes the next longest, so the
    two end close together instead of one long file running alone at the end (xdist's own order, most tests
    first, started the one-test fine-tune example last). A file's time comes from tests/durations.json (a CI
    run's; files not in it go after those in it, those with a `slow` test first). Files marked `waits` go right
    after the longest one. The order is the same on every worker, as xdist requires."""
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
    # files marked `waits` (timeouts, missing peers: a fraction of a core) right after the longest file, so
    # they run on one worker while that file's ranks take both cores, instead of beside a one-core file late
    first = [it for it in items if it.path == items[0].path] if items else []
    rest = [it for it in items[len(first):] if it.path not in waiting]
    items[:] = first + [it for it in items[len(first):] if it.path in waiting] + rest


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
