"""The layout planner's validation on the emulated cluster (`validate_planner`, its grids in `validation`) and
replays of recorded runs (`replay_contention`)."""
