"""Resharding strategies, one registry: how one unit task's slice reaches its receivers (paper §3.1).

A strategy is one file here plus a registry line (`docs/extending.md`): a `Strategy` that brings its
messages (what the executor sends), its cost in the network model (what the schedulers and the planner
weigh), its chunk choice and the backends it runs on. The command line's ``--reshard-strategy`` choices, the
planner's search, the network model and the executor all read the registry; code outside the package
registers its own (`register_strategy`, e.g. the lab's 1-byte ``signal`` bound, through ``--custom-import``).
"""
from __future__ import annotations

from .base import Strategy, get_strategy, register_strategy, strategy_names
# each registers itself, in the paper's order (the order --help lists them)
from . import sendrecv  # noqa: F401, E402
from . import allgather  # noqa: F401, E402
from . import broadcast  # noqa: F401, E402

__all__ = ["Strategy", "get_strategy", "register_strategy", "strategy_names"]
