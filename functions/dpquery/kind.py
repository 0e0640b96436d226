"""The dpquery kind's registration: marginal workloads answered under zCDP (ResidualPlanner)."""

from __future__ import annotations

from typing import Any

from shardfold.functions import ledger
from shardfold.functions.access import Right
from shardfold.functions.dpquery.spec import DPQuerySpec, marginal_name
from shardfold.functions.dpquery.workflow import WORKFLOW
from shardfold.functions.kinds import JobKind
from shardfold.functions.tables import ResultView, Table

RESULT_ROWS = 50  # released tables listed by `run`/`result` (all of them with --json)


def result_view(result: dict[str, Any]) -> ResultView:
    """The privacy spent, the ledger, and one row per released table."""
    rep, led = result["report"], result["ledger"]
    summary = {
        "job_id": result["job_id"],
        "dataset_id": result["dataset_id"],
        "privacy": f"ρ {rep['rho_spent']:.6g} spent of the job's {rep['rho_budget']:.6g}; "
        f"ε at δ {rep['delta']:g}: {rep['epsilon_cks']:.4g} (CKS), "
        f"{rep['epsilon_gaussian']:.4g} (exact Gaussian, this job alone)",
        "ledger": f"dataset {ledger.summary_line(led)}",
        "accuracy": f"predicted workload RMSE {rep['predicted_rmse']:.4g} per cell, "
        f"{rep['marginals']:,} marginal(s), {rep['cells']:,} cells",
        "output": result["output"],
    }
    tables = result.get("tables")
    if tables is None:
        return ResultView(summary, notes=[f"{rep['marginals']:,} tables listed in {result['tables_index']}"])
    rows = [
        [
            marginal_name(t["attributes"]),
            f"{t['cells']:,}",
            f"{t['std_error']:.4g}",
            t["parquet"].rsplit("/", 1)[-1],
        ]
        for t in tables[:RESULT_ROWS]
    ]
    view = ResultView(
        summary,
        tables=[
            Table(
                "released tables (unbiased estimates ± std error per cell)",
                ["marginal", "cells", "std error", "parquet"],
                rows,
            )
        ],
    )
    if len(tables) > RESULT_ROWS:
        view.notes.append(
            f"... and {len(tables) - RESULT_ROWS:,} more: `shardfold result {result['job_id']} --json`"
        )
    return view


KIND = JobKind(
    name="dpquery",
    package=__package__,
    spec=DPQuerySpec,
    workflow=WORKFLOW,
    sizing="shardfold.functions.dpquery.sizing",
    # the budget is reserved before the first noisy answer and spent when the answers are written
    rights=frozenset({Right.INPUTS, Right.OUTPUTS, Right.LEDGER}),
    result_view=result_view,
    # they read the rows: their times, memory and bytes are proxies of the row count (functions.telemetry)
    private_steps=frozenset({"prepare", "measure_group"}),
    extras=lambda spec: ("dp",),
)
