"""megareshard: Megatron-style training whose pipeline stages live on device meshes and whose
stage boundaries are cross-mesh resharding tasks (pipelined, load-balanced broadcasts)."""

__version__ = "0.1.0"
