"""Tensor parallelism: the group value layers shard by (``group``), the process groups
(``process_group``), rank 0's launcher and batch broadcast (``launcher``, ``broadcast``). It
imports nothing of runners/: the worker loop, which runs a ``ModelRunner``, is
``runners/tp_worker.py``, handed to the launcher by rank 0's runner.
"""
