"""Cross-mesh resharding (paper §2.2-§3): pure planning here, execution in `executor`.

Planning pipeline: `decompose` a (shape, src mesh/spec, dst mesh/spec) into unit tasks,
cost each under a registered strategy (`strategies/`, `network.task_cost`), and schedule sending hosts and order
(`schedulers`); `NetworkModel` predicts the plan's time and its lower bound.
"""

from .decompose import UnitTask, decompose
from .mesh import Mesh
from .network import NetworkModel, task_cost
from .strategies import Strategy, get_strategy, register_strategy, strategy_names
from .schedulers import RESHARD_SCHEDULERS, ReshardScheduler, register_scheduler, scheduler_names
from .wire import TaskCost
from .plan import ReshardingPlan, plan_resharding
from .spec import ShardingSpec, local_slices, split_bounds
from .cases import one_to_many_cases, paper_case

__all__ = [
    "Mesh",
    "ShardingSpec",
    "local_slices",
    "split_bounds",
    "UnitTask",
    "decompose",
    "ReshardingPlan",
    "plan_resharding",
    "NetworkModel",
    "TaskCost",
    "task_cost",
    "Strategy",
    "get_strategy",
    "register_strategy",
    "strategy_names",
    "RESHARD_SCHEDULERS",
    "ReshardScheduler",
    "register_scheduler",
    "scheduler_names",
    "paper_case",
    "one_to_many_cases",
]
