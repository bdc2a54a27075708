#!/usr/bin/env python
"""Inspect, export and import megareshard checkpoints (single process, no process group needed).

The tool is megareshard/cli/checkpoint_util.py, also the command ``megareshard-checkpoint-util``;
this script needs megareshard installed (``pip install -e .``, the README's setup).
"""
from megareshard.cli import as_script, checkpoint_util

as_script(globals(), checkpoint_util)
