"""The ``dpquery`` job: marginal query workloads answered under zCDP with ResidualPlanner.

* :mod:`functions.dpquery.privacy` — zCDP ↔ (ε, δ) conversions (CKS bound, exact Gaussian curve); stdlib only.
* :mod:`functions.dpquery.planner` — the pure plan: closure of the workload, noise scales, predicted
  variances, privacy report, and the grouping of residual sets / marginals into fan-out tasks.
"""
