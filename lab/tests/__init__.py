"""The lab's tests; `run_main` runs a lab tool's ``main(argv)`` in the test process."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Sequence


def run_main(main: Callable[[Sequence[str]], int], argv: list[str], capsys) -> SimpleNamespace:
    """A tool's main() in this process (what its command line runs, without seconds of imports in a fresh
    interpreter): returncode, stdout, stderr, as ``subprocess.run`` would give them."""
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
