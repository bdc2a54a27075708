"""Surviving real clusters: pre-flight rendezvous with a rank map, and a hang watchdog."""
from .preflight import PreflightError, RankInfo, preflight_rendezvous, rank_map_table, tp_placement_warnings
from .watchdog import Watchdog

__all__ = ["PreflightError", "RankInfo", "Watchdog", "preflight_rendezvous", "rank_map_table",
           "tp_placement_warnings"]
