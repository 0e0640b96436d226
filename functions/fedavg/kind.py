"""The fedavg kind's registration: FedAvg of N client updates by byte-range shards (GradsSharding)."""

from __future__ import annotations

from typing import Any

from shardfold.functions import ledger
from shardfold.functions.access import Right
from shardfold.functions.fedavg.spec import FedAvgSpec
from shardfold.functions.fedavg.workflow import WORKFLOW
from shardfold.functions.kinds import JobKind
from shardfold.functions.tables import ResultView, Table

RESULT_ROWS = 20  # clients left out listed at the terminal (the result document lists them all)


def result_view(result: dict[str, Any]) -> ResultView:
    """Every field of the result, the clients left out of the round as a table of who and why."""
    excluded = result.get("excluded") or []
    summary = {k: v for k, v in result.items() if k not in ("excluded", "privacy")}
    if (rep := result.get("privacy")) is not None:  # DP-FedAvg
        led = rep["ledger"]
        summary["privacy"] = (
            f"ρ {rep['rho_spent']:.6g} this round; ε at δ {rep['delta']:g}: {rep['epsilon_cks']:.4g} (CKS); "
            f"clip_norm {rep['clip_norm']:g}, noise std {rep['noise_std']:.4g} over "
            f"{rep['expected_clients']} expected clients"
        )
        summary["ledger"] = f"{led['dataset_id']}: {ledger.summary_line(led, 'round(s)')}"
    if not excluded:
        return ResultView(summary)
    rows = [[e["client"], e["uri"], e["reason"]] for e in excluded[:RESULT_ROWS]]
    title = f"left out of the round: {len(excluded)} of {result.get('clients_listed', '?')} clients"
    more = len(excluded) - RESULT_ROWS
    notes = [f"{more} more in the result document"] if more > 0 else []
    return ResultView(summary, tables=[Table(title, ["client", "uri", "reason"], rows)], notes=notes)


KIND = JobKind(
    name="fedavg",
    package=__package__,
    spec=FedAvgSpec,
    workflow=WORKFLOW,
    sizing="shardfold.functions.fedavg.sizing",
    # DP-FedAvg reserves each round's budget before any noise is drawn and spends it at commit
    rights=frozenset({Right.INPUTS, Right.OUTPUTS, Right.LEDGER}),
    result_view=result_view,
    # the averaged model's bytes written, where the executors count shards
    progress="shardfold.functions.fedavg.progress:progress",
    extras=lambda spec: ("dp",) if spec.dp is not None else (),  # DP-FedAvg's noise: OpenDP
)
