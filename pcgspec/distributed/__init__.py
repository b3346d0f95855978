"""Tensor parallelism: the group value layers shard by (``group``), the process groups
(``process_group``: spawned by pcgspec or started by torchrun), rank 0's launcher
(``launcher``), the per-step message channel (``broadcast``) and the one-shot all-reduce over
symmetric memory (``symm_mem``). It imports nothing of runners/: the worker loop, which runs a
``ModelRunner``, is ``runners/tp_worker.py``, handed to the launcher by rank 0's runner.
"""
