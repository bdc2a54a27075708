#!/usr/bin/env python
"""Generate text from a checkpoint of any layout (one process): greedy, or top-p sampling.

The tool is megareshard/cli/generate.py, also the command ``megareshard-generate``;
this script needs megareshard installed (``pip install -e .``, the README's setup).
"""
from megareshard.cli import as_script, generate

as_script(globals(), generate)
