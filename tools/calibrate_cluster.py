#!/usr/bin/env python
"""Measure the machines at hand for the layout planner and write a cluster JSON.

The tool is megareshard/cli/calibrate_cluster.py, also the command ``megareshard-calibrate-cluster``;
this script needs megareshard installed (``pip install -e .``, the README's setup).
"""
from megareshard.cli import as_script, calibrate_cluster

as_script(globals(), calibrate_cluster)
