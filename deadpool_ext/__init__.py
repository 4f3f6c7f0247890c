"""DeadPool hot-swap recovery for Megatron training (arXiv 2607.01646).

This package grows with the project's issues: buddy mirroring of the
distributed-optimizer shard, then hot-swap recovery with warm spares, then
shrinking and growing the data-parallel width. The training stack it builds
on lives in ``megatron/training`` and exposes ``megatron.training.training.Hook``
as the extension point.
"""
