"""The privacy-budget ledger of a dataset: append-only and atomic, in the store.

Layout, under the store root: ``ledger/<dataset_id>/entries/<seq>.json`` (``seq`` zero-padded, from 0).
Every entry is written once with put-if-absent at the next sequence number, after reading all earlier
entries: the classic optimistic append. Two writers that race for the same number cannot both win; the
loser re-reads the ledger (now holding the winner's entry), re-checks the budget and tries the next number.
No entry is ever rewritten or removed, so the ledger is also the audit trail.

Entries (``type``):

* ``open`` (seq 0): the dataset's total budget ``total_rho`` (ρ-zCDP), registered by the first job that
  names the dataset (its spec's ``dataset_budget_rho``). A total never changes.
* ``reserve``: a job's ``rho`` (its whole budget), appended at plan time, BEFORE any measurement. It is
  refused with :class:`BudgetExceeded` if the committed total plus ``rho`` would exceed ``total_rho``.
  Idempotent per job id: a retried plan finds its reservation and gets it back.
* ``spend``: when the job finalises, the ρ actually spent: the sum of the sampler's own privacy-map values
  over the job's measurements (:mod:`functions.dpquery.measure`). Idempotent per job id.

Spend rule (reserve with slack, record actual): the plan allocates ``rho_planned = rho·(1 − RHO_SLACK)``
(:mod:`functions.dpquery.planner`), so the OpenDP maps (the ideal p_S/(2σ_S²) plus a rounding term of a
few ulps) sum to at most the reserved ``rho``; measure refuses to draw noise for a residual set whose map
exceeds its planned share by more than the slack. A job counts toward the total with its ``spend`` once it
has one, else with its reservation (a job that failed after reserving keeps its reservation: some of its
noise may have been drawn; a reservation is never released automatically).

Composition: zCDP composes by addition, so the ledger sums ρ; the (ε, δ) statement for the dataset as a
whole is the CKS conversion of that sum (:func:`functions.dpquery.privacy.cdp_eps`).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from typing import Any

from functions import store
from functions.errors import BudgetExceeded, ShardfoldError, SpecError, StoreError
from functions.store.uri import join

MAX_ATTEMPTS = 200  # optimistic-append attempts before giving up (each lost race means progress elsewhere)
_SEQ_DIGITS = 8


def ledger_uri(store_root: str, dataset_id: str) -> str:
    return join(store_root, "ledger", dataset_id)


def _entry_uri(store_root: str, dataset_id: str, seq: int) -> str:
    return join(ledger_uri(store_root, dataset_id), "entries", f"{seq:0{_SEQ_DIGITS}d}.json")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass
class LedgerState:
    """The ledger folded: total, per-job reservations and spends, and the next sequence number."""

    dataset_id: str
    total_rho: float | None = None
    reserved: dict[str, float] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)
    entries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def next_seq(self) -> int:
        return len(self.entries)

    def committed(self) -> float:
        """ρ counted against the total: each job's spend if it has one, else its reservation."""
        return math.fsum(self.spent.get(j, r) for j, r in self.reserved.items())

    def remaining(self) -> float:
        return max(0.0, (self.total_rho or 0.0) - self.committed())

    def summary(self) -> dict[str, Any]:
        return {
            "dataset_id": self.dataset_id,
            "total_rho": self.total_rho,
            "committed_rho": self.committed(),
            "remaining_rho": self.remaining(),
            "jobs": len(self.reserved),
            "entries": len(self.entries),
        }


def read(store_root: str, dataset_id: str) -> LedgerState:
    """The ledger's current state (an empty state when the dataset has no ledger yet)."""
    prefix = join(ledger_uri(store_root, dataset_id), "entries") + "/"
    uris = store.list_uris(prefix)
    state = LedgerState(dataset_id)
    for seq, uri in enumerate(sorted(uris)):
        name = uri.rsplit("/", 1)[1]
        if name != f"{seq:0{_SEQ_DIGITS}d}.json":
            raise StoreError(f"ledger of {dataset_id!r} is not contiguous at {name}; it was edited by hand")
        entry = store.get_json(uri)
        _fold(state, entry)
    return state


def _fold(state: LedgerState, entry: dict[str, Any]) -> None:
    kind = entry.get("type")
    if kind == "open":
        state.total_rho = float(entry["total_rho"])
    elif kind == "reserve":
        state.reserved[entry["job_id"]] = float(entry["rho"])
    elif kind == "spend":
        state.spent[entry["job_id"]] = float(entry["rho_spent"])
    state.entries.append(entry)


def _append(store_root: str, dataset_id: str, seq: int, entry: dict[str, Any]) -> bool:
    body = json.dumps({"seq": seq, **entry}, sort_keys=True).encode()
    return store.put_if_absent(_entry_uri(store_root, dataset_id, seq), body)


def reserve(
    store_root: str,
    dataset_id: str,
    job_id: str,
    rho: float,
    total_rho: float | None = None,
) -> dict[str, Any]:
    """Reserve ``rho`` for ``job_id`` on the dataset's ledger, opening the ledger with ``total_rho`` if
    it has none. Raises :class:`BudgetExceeded` if the dataset's total would be exceeded, and
    :class:`SpecError` if ``total_rho`` is missing for a new ledger or differs from the registered one.
    Returns the ledger summary after the reservation (the same on a retry)."""
    if not (rho > 0 and math.isfinite(rho)):
        raise SpecError(f"budget: rho must be a finite number > 0, got {rho}")
    for _ in range(MAX_ATTEMPTS):
        state = read(store_root, dataset_id)
        if state.total_rho is None:
            if total_rho is None:
                raise SpecError(
                    f"dataset {dataset_id!r} has no budget ledger yet: the first job on it must give "
                    "'dataset_budget_rho' (the dataset's total ρ, fixed from then on)",
                    [{"field": "dataset_budget_rho", "error": "required for a dataset's first job"}],
                )
            if not (total_rho > 0 and math.isfinite(total_rho)):
                raise SpecError(f"dataset_budget_rho must be a finite number > 0, got {total_rho}")
            entry = {"type": "open", "total_rho": float(total_rho), "job_id": job_id, "time": _now()}
            _append(store_root, dataset_id, 0, entry)  # lost race: someone else opened it; re-read
            continue
        if total_rho is not None and float(total_rho) != state.total_rho:
            raise SpecError(
                f"dataset_budget_rho {total_rho} differs from the total {state.total_rho} registered for "
                f"dataset {dataset_id!r}; a dataset's total never changes (omit the field or give the total)",
                [{"field": "dataset_budget_rho", "error": f"registered total is {state.total_rho}"}],
            )
        if job_id in state.reserved:
            if state.reserved[job_id] != float(rho):
                raise ShardfoldError(
                    f"job {job_id} already reserved rho {state.reserved[job_id]} on dataset {dataset_id!r}, "
                    f"not {rho}; its spec changed after planning"
                )
            return state.summary()
        committed = state.committed()
        if math.fsum([committed, float(rho)]) > state.total_rho:
            raise BudgetExceeded(
                f"dataset {dataset_id!r}: this job's rho {rho:.6g} exceeds the remaining budget "
                f"{state.remaining():.6g} (total {state.total_rho:.6g}, already committed {committed:.6g} by "
                f"{len(state.reserved)} job(s)); nothing was measured"
            )
        entry = {"type": "reserve", "job_id": job_id, "rho": float(rho), "time": _now()}
        if _append(store_root, dataset_id, state.next_seq, entry):
            state.reserved[job_id] = float(rho)
            state.entries.append(entry)
            return state.summary()
    raise StoreError(f"ledger of {dataset_id!r}: too many concurrent writers; retry the job")


def spend(store_root: str, dataset_id: str, job_id: str, rho_spent: float) -> dict[str, Any]:
    """Record the ρ the job actually spent (≤ its reservation). Idempotent: a retry finds the entry."""
    for _ in range(MAX_ATTEMPTS):
        state = read(store_root, dataset_id)
        if job_id not in state.reserved:
            raise StoreError(f"job {job_id} has no reservation on the ledger of dataset {dataset_id!r}")
        if job_id in state.spent:
            return state.summary()
        if rho_spent > state.reserved[job_id]:
            raise ShardfoldError(
                f"job {job_id} spent rho {rho_spent!r}, more than its reservation {state.reserved[job_id]!r}"
            )
        entry = {"type": "spend", "job_id": job_id, "rho_spent": float(rho_spent), "time": _now()}
        entry["rho_reserved"] = state.reserved[job_id]
        if _append(store_root, dataset_id, state.next_seq, entry):
            state.spent[job_id] = float(rho_spent)
            state.entries.append(entry)
            return state.summary()
    raise StoreError(f"ledger of {dataset_id!r}: too many concurrent writers; retry the job")
