"""Fault trials (`chaos`, `chaos_data`, `chaos_ranks`) and the fault injection they plug into a run (`faults`)."""
