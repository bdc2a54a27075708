"""tools/chaos_ranks.py as a module: the reliability tests run its trials at the quick size and check
the details each trial returns (beyond the runner's seven fields)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def chaos_ranks():
    name = "chaos_ranks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "chaos_ranks.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up by name
        spec.loader.exec_module(mod)
    return sys.modules[name]
