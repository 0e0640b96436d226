"""The ``dpquery`` job: marginal query workloads answered under zCDP with ResidualPlanner.

* :mod:`functions.privacy` — zCDP ↔ (ε, δ) conversions (CKS bound, exact Gaussian curve), shared with
  DP-FedAvg; :mod:`functions.ledger` — the budget ledger of each dataset (both kinds charge it).
* :mod:`functions.dpquery.planner` — the pure plan: closure of the workload, noise scales, predicted
  variances, privacy report, and the grouping of residual sets / marginals into fan-out tasks.
"""
