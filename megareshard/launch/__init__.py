"""Surviving real clusters: pre-flight rendezvous with a rank map, a hang watchdog, fault injection for tests."""
from .preflight import PreflightError, RankInfo, preflight_rendezvous, rank_map_table, tp_placement_warnings
from .watchdog import PeerFailure, Watchdog, is_communication_error

__all__ = ["PeerFailure", "PreflightError", "RankInfo", "Watchdog", "is_communication_error", "preflight_rendezvous",
           "rank_map_table", "tp_placement_warnings"]
