"""The text files a data tool reads (``tools/train_tokenizer.py``, ``tools/preprocess_data.py``: ``--input``)."""
from __future__ import annotations

import glob
import os
from typing import Sequence


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files named by ``patterns`` (plain paths, globs with ** allowed, or directories)."""
    files: list[str] = []
    for pat in patterns:
        if os.path.isdir(pat):
            matches = sorted(p for p in glob.glob(os.path.join(pat, "**", "*"), recursive=True) if os.path.isfile(p))
        elif any(c in pat for c in "*?["):
            matches = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
        else:
            if not os.path.isfile(pat):
                raise FileNotFoundError(f"input file not found: {pat!r}")
            matches = [pat]
        if not matches:
            raise FileNotFoundError(f"input pattern {pat!r} matched no files")
        files.extend(matches)
    return files
