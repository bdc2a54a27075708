#!/usr/bin/env python
"""Print the rank map of a parallel layout: which host, tp, pp and dp rank every global rank gets.

The tool is megareshard/cli/show_topology.py, also the command ``megareshard-show-topology``;
this script needs megareshard installed (``pip install -e .``, the README's setup).
"""
from megareshard.cli import as_script, show_topology

as_script(globals(), show_topology)
