"""The ``fedavg`` job kind: FedAvg of N client updates (safetensors) by byte-range shards (GradsSharding).

Modules (all pure Python + numpy; no torch, no AWS outside :mod:`functions.store`):

* :mod:`functions.fedavg.layout` — safetensors parsing and validation (length prefix, header JSON, offsets,
  truncation), the cross-client layout check and the output header.
* :mod:`functions.fedavg.kernels` — the numeric reducers (weighted/uniform mean, median, trimmed mean,
  integer policies) applied to one piece of one tensor, in fixed client order.
* :mod:`functions.fedavg.shardplan` — :class:`~functions.fedavg.shardplan.Budget`, the shard-count rule, the
  chunk rule and :func:`~functions.fedavg.shardplan.task_loads` (per-task peak memory and S3 requests).
* :mod:`functions.fedavg.core` — ``inspect`` (read and check headers, choose shards; writes nothing),
  ``plan`` → ``aggregate`` (one shard) → ``commit``.
* :mod:`functions.fedavg.sizing` — the kind's ``probe`` and ``loads`` (:mod:`functions.estimate`), over
  ``core.inspect`` and ``shardplan.task_loads``.
* :mod:`functions.fedavg.handlers` — the thin Lambda handlers.

See :mod:`functions.fedavg.core` for the semantics (formula, dtypes, integer and bool policies, errors).
"""
