"""Surviving real clusters: pre-flight rendezvous with a rank map, a hang watchdog, workers that end with their
launcher, fault injection for tests."""
from .parent import exit_with_launcher
from .preflight import PreflightError, RankInfo, preflight_rendezvous, rank_map_table, tp_placement_warnings
from .watchdog import PeerFailure, Watchdog, is_communication_error

__all__ = ["PeerFailure", "PreflightError", "RankInfo", "Watchdog", "exit_with_launcher", "is_communication_error",
           "preflight_rendezvous", "rank_map_table", "tp_placement_warnings"]
