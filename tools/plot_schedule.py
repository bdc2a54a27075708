#!/usr/bin/env python
"""Draw a pipeline schedule's timeline (simulated or measured) as a PNG, paper Figure 4 style.

The tool is megareshard/cli/plot_schedule.py, also the command ``megareshard-plot-schedule``;
this script needs megareshard installed (``pip install -e .``, the README's setup).
"""
from megareshard.cli import as_script, plot_schedule

as_script(globals(), plot_schedule)
