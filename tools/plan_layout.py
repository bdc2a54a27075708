#!/usr/bin/env python
"""Choose tp, pp, dp, micro batch, schedule, resharding strategy, recomputation and ZeRO for a model on a cluster.

The tool is megareshard/cli/plan_layout.py, also the command ``megareshard-plan-layout``;
this script needs megareshard installed (``pip install -e .``, the README's setup).
"""
from megareshard.cli import as_script, plan_layout

as_script(globals(), plan_layout)
