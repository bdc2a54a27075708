"""Fixtures shared by test files."""
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
STDLIB_FILES = [str(STDLIB / f) for f in ("os.py", "argparse.py", "textwrap.py", "string.py", "shutil.py",
                                          "glob.py", "fnmatch.py", "queue.py", "bisect.py", "heapq.py")]


def pytest_collection_modifyitems(config, items):
    """Files with a `slow` test first, each file's tests together, otherwise in collection order: with two
    workers taking whole files (tests/run.sh: ``--dist loadfile --no-loadscope-reorder``) the long files start
    at once and the short ones fill the end, instead of one long file running alone at the end (xdist's own
    order, most tests first, started the one-test fine-tune example last). The order is the same on every
    worker, as xdist requires."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: a file's tests stay together


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
