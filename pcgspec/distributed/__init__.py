"""Tensor parallelism: the group value layers shard by (``group``), the process groups
(``process_group``), rank 0's launcher and batch broadcast (``launcher``, ``broadcast``) and the
worker loop (``worker``).
"""
