"""The privacy-budget ledger of a dataset: append-only and atomic, in the store.

Layout, under the store root: ``ledger/<dataset_id>/entries/<seq>.json`` (``seq`` zero-padded, from 0).
Every entry is written once with put-if-absent at the next sequence number, after reading all earlier
entries: the classic optimistic append. Two writers that race for the same number cannot both win; the
loser re-reads the ledger (now holding the winner's entry), re-checks the budget and tries the next number.
No entry is ever rewritten or removed, so the ledger is also the audit trail.

Entries (``type``):

* ``open`` (seq 0): the dataset's total budget ``total_rho`` (ρ-zCDP), registered by the first job that
  names the dataset (its spec's ``dataset_budget_rho``), and its privacy ``unit``: ``row`` (a dataset that
  dpquery releases; absent in ledgers opened before units) or ``client`` (a federation whose DP-FedAvg
  rounds charge it). A total and a unit never change: a job of the other unit is refused.
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
whole is the CKS conversion of that sum (:func:`functions.privacy.cdp_eps`).

**The ledger is bound to the data** (so the same data under a new id cannot open a fresh budget).

* The identity of a dataset (:func:`functions.dpquery.data.identify`) is its URI, its size, its S3 ETag (or
  local mtime/inode), and a **content fingerprint**: ``sha256:<hex>`` of the object's bytes, streamed (one
  extra read of the dataset at plan time, locally and on S3 alike). The ETag is recorded but not used to
  decide sameness: a multipart upload's ETag depends on the part size, and an SSE-KMS object's is not an MD5
  at all, so the same bytes uploaded twice can have two ETags (and a re-upload would otherwise open a fresh
  budget).
* The ``open`` entry records the identity and the ``version`` (the spec's ``dataset_version``, null by
  default); a ``bind`` entry binds a further version of the same dataset id (or, for a ledger opened
  before binding existed, its first one). Versions of one id share its ledger and total budget: a new
  version of a dataset is mostly the same people.
* A fingerprint index, ``ledger/_by-fingerprint/<hex>.json`` (put-if-absent, never rewritten: the first
  id to bind a content owns it; ``_`` cannot start a dataset id), maps a content to its (dataset id,
  version). It is claimed BEFORE the ledger entry that binds the content, so two ids racing for the same
  bytes cannot both bind them.
* Refusals (:class:`functions.errors.SpecError`, before any reservation): the content is registered under
  another dataset id (or another version of this one); or this (id, version) is bound to other content. A
  message names ids, versions and the URI the ledger was opened from; never the fingerprint, a size, a
  count or a value. (The refusal itself tells the submitter whether the bytes they supplied are
  byte-identical to a registered dataset: that needs the whole file, byte for byte, and is documented in
  docs/specs.md.)
* Sameness is byte identity: a re-encoded, re-sorted or edited copy is different content. The binding
  stops re-registering the same object or a copy of it, not a derived dataset.
* The fingerprint is as sensitive as the data (it confirms a guess of the whole file), so it lives only
  under ``ledger/`` (a system prefix no spec may write or name) and never appears in a result, a log or
  an error.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from typing import Any

from shardfold.functions import store
from shardfold.functions.errors import BudgetExceeded, ShardfoldError, SpecError, StoreError
from shardfold.functions.store.uri import join

DATASET_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a ledger's key (and a dataset version's name)
MAX_ATTEMPTS = 200  # optimistic-append attempts before giving up (each lost race means progress elsewhere)
_SEQ_DIGITS = 8
INDEX = "_by-fingerprint"  # ledger/_by-fingerprint/<hex>.json; "_" cannot start a dataset id


def ledger_uri(store_root: str, dataset_id: str) -> str:
    return join(store_root, "ledger", dataset_id)


def _entry_uri(store_root: str, dataset_id: str, seq: int) -> str:
    return join(ledger_uri(store_root, dataset_id), "entries", f"{seq:0{_SEQ_DIGITS}d}.json")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def index_uri(store_root: str, fingerprint: str) -> str:
    return join(store_root, "ledger", INDEX, fingerprint.split(":", 1)[-1] + ".json")


def _public(identity: dict[str, Any]) -> dict[str, Any]:
    """What a ledger entry records of an identity: the URI and the content fingerprint. Not the size, the
    pin (a local pin holds the size) or the row bound: they are functions of the rows, and a ledger is read
    by everyone who may run jobs on the dataset."""
    return {k: identity[k] for k in ("uri", "fingerprint")}


_UNIT_TEXT = {"row": "a dataset's rows (dpquery)", "client": "a federation's clients (DP-FedAvg)"}


def _version_text(version: str | None) -> str:
    return f"version {version!r}" if version is not None else "its initial version"


@dataclass
class LedgerState:
    """The ledger folded: total, per-job reservations and spends, and the next sequence number."""

    dataset_id: str
    total_rho: float | None = None
    unit: str = "row"
    bindings: dict[str | None, dict[str, Any]] = field(default_factory=dict)  # version -> identity
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
            "versions": [v for v in self.bindings],
            "unit": self.unit,
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
        state.unit = entry.get("unit", "row")
        if entry.get("dataset") is not None:
            state.bindings[entry.get("version")] = entry["dataset"]
    elif kind == "bind":
        state.bindings.setdefault(entry.get("version"), entry["dataset"])
    elif kind == "reserve":
        state.reserved[entry["job_id"]] = float(entry["rho"])
    elif kind == "spend":
        state.spent[entry["job_id"]] = float(entry["rho_spent"])
    state.entries.append(entry)


def _append(store_root: str, dataset_id: str, seq: int, entry: dict[str, Any]) -> bool:
    body = json.dumps({"seq": seq, **entry}, sort_keys=True).encode()
    return store.put_if_absent(_entry_uri(store_root, dataset_id, seq), body)


def _check_binding(state: LedgerState, identity: dict[str, Any], version: str | None) -> bool:
    """Raise if this (id, version) is bound to other content, or the content is another version of this
    id; True when the version still needs binding."""
    fp = identity["fingerprint"]
    bound = state.bindings.get(version)
    if bound is not None:
        if bound["fingerprint"] != fp:
            raise SpecError(
                f"dataset_id {state.dataset_id!r} ({_version_text(version)}) is bound to other content, "
                f"registered from {bound.get('uri')}; the content of {identity['uri']} is not the same. Use "
                "the data it was registered with; for a deliberately new version of the same dataset set "
                "'dataset_version' (versions share the dataset's budget); unrelated data needs its own "
                "dataset_id",
                [{"field": "dataset_id", "error": "bound to other content"}],
            )
        return False
    for other, b in state.bindings.items():
        if b["fingerprint"] == fp:
            raise SpecError(
                f"the content of {identity['uri']} is already {_version_text(other)} of dataset_id "
                f"{state.dataset_id!r}; name that version (dataset_version: "
                f"{json.dumps(other)}) instead of registering it again",
                [{"field": "dataset_version", "error": "the same content is another version"}],
            )
    return True


def _claim(store_root: str, dataset_id: str, version: str | None, job_id: str, identity: dict) -> None:
    """Claim the content's fingerprint for (dataset_id, version), or raise if another id owns it."""
    uri = index_uri(store_root, identity["fingerprint"])
    body = {"dataset_id": dataset_id, "version": version, "job_id": job_id, "time": _now()}
    if store.put_if_absent(uri, json.dumps(body, sort_keys=True).encode()):
        return
    owner = store.get_json(uri)
    if (owner.get("dataset_id"), owner.get("version")) == (dataset_id, version):
        return
    if owner.get("dataset_id") == dataset_id:
        raise SpecError(
            f"the content of {identity['uri']} is already {_version_text(owner.get('version'))} of "
            f"dataset_id {dataset_id!r}; name that version instead of registering it again",
            [{"field": "dataset_version", "error": "the same content is another version"}],
        )
    raise SpecError(
        f"the content of {identity['uri']} is already registered under dataset_id {owner.get('dataset_id')!r}"
        f" ({_version_text(owner.get('version'))}); a dataset's budget is not reopened under a new id. Use "
        f"dataset_id {owner.get('dataset_id')!r}",
        [{"field": "dataset_id", "error": "the same content is registered under another dataset_id"}],
    )


def reserve(
    store_root: str,
    dataset_id: str,
    job_id: str,
    rho: float,
    total_rho: float | None = None,
    identity: dict[str, Any] | None = None,
    version: str | None = None,
    unit: str = "row",
) -> dict[str, Any]:
    """Reserve ``rho`` for ``job_id`` on the dataset's ledger, opening the ledger with ``total_rho`` if
    it has none. Raises :class:`BudgetExceeded` if the dataset's total would be exceeded, and
    :class:`SpecError` if ``total_rho`` is missing for a new ledger or differs from the registered one.
    Returns the ledger summary after the reservation (the same on a retry).

    With ``identity`` (:func:`functions.dpquery.data.identify`) the ledger is bound to the data (module
    docstring): the content must be the one bound to ``(dataset_id, version)``, or a content no other id (or
    version) has bound, which this call then binds. Without it (unit tests of the budget logic, and a
    federation, whose rounds read new updates each time) no binding is checked. ``unit``: the job's privacy
    unit, ``row`` or ``client``; a ledger opened for the other is refused."""
    if not (rho > 0 and math.isfinite(rho)):
        raise SpecError(f"budget: rho must be a finite number > 0, got {rho}")
    for _ in range(MAX_ATTEMPTS):
        state = read(store_root, dataset_id)
        need_bind = identity is not None and _check_binding(state, identity, version)
        if state.total_rho is None:  # the dataset's first job opens its ledger (a racing one may instead)
            total = _first_total(dataset_id, total_rho)
            entry = {"type": "open", "total_rho": total, "unit": unit, "job_id": job_id, "time": _now()}
            if identity is not None:
                _claim(store_root, dataset_id, version, job_id, identity)
                entry.update(dataset=_public(identity), version=version)
            _append(store_root, dataset_id, 0, entry)
            continue
        _check_terms(state, total_rho, unit)
        if need_bind:
            _bind(store_root, state, job_id, identity, version)
            continue
        if _check_reservation(state, job_id, rho):  # held already: a retried plan
            return state.summary()
        entry = {"type": "reserve", "job_id": job_id, "rho": float(rho), "time": _now()}
        if _append(store_root, dataset_id, state.next_seq, entry):
            _fold(state, entry)
            return state.summary()
    raise StoreError(f"ledger of {dataset_id!r}: too many concurrent writers; retry the job")


def _first_total(dataset_id: str, total_rho: float | None) -> float:
    """The total ρ the first job on a dataset gives its ledger."""
    if total_rho is None:
        raise SpecError(
            f"dataset {dataset_id!r} has no budget ledger yet: the first job on it must give "
            "'dataset_budget_rho' (the dataset's total ρ, fixed from then on)",
            [{"field": "dataset_budget_rho", "error": "required for a dataset's first job"}],
        )
    if not (total_rho > 0 and math.isfinite(total_rho)):
        raise SpecError(f"dataset_budget_rho must be a finite number > 0, got {total_rho}")
    return float(total_rho)


def _check_terms(state: LedgerState, total_rho: float | None, unit: str) -> None:
    """Refuse a job whose privacy unit or given total is not the ledger's."""
    if state.unit != unit:
        raise SpecError(
            f"dataset_id {state.dataset_id!r} is the budget ledger of {_UNIT_TEXT[state.unit]}, but this job "
            f"protects {_UNIT_TEXT[unit]}; budgets of different privacy units do not add up: give this "
            "job its own dataset_id",
            [{"field": "dataset_id", "error": f"a ledger of privacy unit {state.unit!r}"}],
        )
    if total_rho is not None and float(total_rho) != state.total_rho:
        raise SpecError(
            f"dataset_budget_rho {total_rho} differs from the total {state.total_rho} registered for "
            f"dataset {state.dataset_id!r}; a dataset's total never changes (omit the field or give the "
            "total)",
            [{"field": "dataset_budget_rho", "error": f"registered total is {state.total_rho}"}],
        )


def _bind(store_root: str, state: LedgerState, job_id: str, identity: dict, version: str | None) -> None:
    """Claim the content for (dataset, ``version``) and append its ``bind`` entry (won or lost: re-read)."""
    _claim(store_root, state.dataset_id, version, job_id, identity)
    entry = {
        "type": "bind",
        "dataset": _public(identity),
        "version": version,
        "job_id": job_id,
        "time": _now(),
    }
    _append(store_root, state.dataset_id, state.next_seq, entry)


def _check_reservation(state: LedgerState, job_id: str, rho: float) -> bool:
    """True when the job holds this reservation already (a retried plan), False when it is new and ``rho``
    fits the total; :class:`BudgetExceeded` when it does not fit, :class:`ShardfoldError` when the job holds
    a different one (its spec changed after planning)."""
    if job_id in state.reserved:
        if state.reserved[job_id] != float(rho):
            raise ShardfoldError(
                f"job {job_id} already reserved rho {state.reserved[job_id]} on dataset "
                f"{state.dataset_id!r}, not {rho}; its spec changed after planning"
            )
        return True
    committed = state.committed()
    if math.fsum([committed, float(rho)]) > state.total_rho:
        raise BudgetExceeded(
            f"dataset {state.dataset_id!r}: this job's rho {rho:.6g} exceeds the remaining budget "
            f"{state.remaining():.6g} (total {state.total_rho:.6g}, already committed {committed:.6g} by "
            f"{len(state.reserved)} job(s)); nothing was measured"
        )
    return False


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
            _fold(state, entry)
            return state.summary()
    raise StoreError(f"ledger of {dataset_id!r}: too many concurrent writers; retry the job")


def summary_line(summary: dict[str, Any], jobs: str = "job(s)") -> str:
    """A ledger summary (:meth:`LedgerState.summary`, as results carry it) in one line, for a result view."""
    return (
        f"total ρ {summary['total_rho']:.6g}, committed {summary['committed_rho']:.6g}, "
        f"remaining {summary['remaining_rho']:.6g} ({summary['jobs']} {jobs})"
    )
