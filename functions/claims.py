"""Output claims: an output a spec names belongs to one job at a time, and what is already there (another
job's finished output, or an object no job wrote) is replaced only when the spec says ``overwrite``.

A claim is ``claims/<h>/<n>.json`` under the store root: ``h`` the sha256 of the output's full URI, ``n``
1, 2, ... (zero-padded); the highest ``n`` is the output's owner. Submit claims the next ``n`` with
put-if-absent, which is a compare-and-swap on both stores (S3's ``If-None-Match: *``, a hard link locally):
of two jobs claiming one output at once exactly one wins, and the other is refused naming it. A job's own
default output (``jobs/<id>/output/``) needs no claim.

A claim is taken over only from an owner that has ended (its status SUCCEEDED, FAILED or CANCELLED), or
that never came to be: neither its spec nor its status exists :data:`UNRECORDED_S` after it claimed (its
submit failed after claiming; a submit records its spec within a second, so a live claimant is never taken
for stale). Submit checks, after writing the spec, that its claim is still the latest, and every task
resolving the output checks again (:func:`shardfold.functions.access.output_uri`): a task never writes an
output another job holds.

The owner's status is read from ``jobs/<id>/status.json``. On AWS the executor writes it when a client
looks at the job, so a claim can stay held by a job that ended unobserved until ``shardfold status ID`` (or
any verb reading it) records the end; the refusal says so.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

from shardfold.functions import store
from shardfold.functions.errors import ObjectNotFound, SpecError, StoreError
from shardfold.functions.jobs import kind_of, spec_key, status_key
from shardfold.functions.store.uri import join

CLAIMS_PREFIX = "claims/"
UNRECORDED_S = 600.0  # a claimant with no spec this long after claiming is taken to have failed to submit
ENDED = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class OutputClaimed(SpecError):
    """The output is held by another job (running, or finished and not to be overwritten)."""


@dataclass(frozen=True)
class Claim:
    n: int
    job_id: str
    uri: str
    at: float = 0.0  # when it was claimed (the claimant's clock)


def _folder(store_root: str, uri: str) -> str:
    return join(store_root, f"{CLAIMS_PREFIX}{hashlib.sha256(uri.encode()).hexdigest()[:40]}/")


def latest(store_root: str, uri: str) -> Claim | None:
    """The output's current claim (its owner), or None when no job ever claimed it."""
    folder = _folder(store_root, uri)
    names = [u[len(folder) :] for u in store.list_uris(folder)]
    numbered = sorted((int(n[:-5]), n) for n in names if n.endswith(".json") and n[:-5].isdigit())
    for n, name in reversed(numbered):
        try:
            record = store.get_json(folder + name)
        except (ObjectNotFound, StoreError):
            continue
        if isinstance(record, dict) and kind_of(str(record.get("job_id"))) and record.get("uri") == uri:
            at = record.get("at")
            return Claim(n, record["job_id"], uri, float(at) if isinstance(at, int | float) else 0.0)
    return None


def _state(store_root: str, held: Claim) -> str:
    """The holder's recorded state; ``"UNRECORDED"`` when neither its status nor its spec exists
    :data:`UNRECORDED_S` after it claimed (before that it is being submitted: ``"SUBMITTING"``)."""
    try:
        record = store.get_json(join(store_root, status_key(held.job_id)))
        return str(record.get("state")) if isinstance(record, dict) else "RUNNING"
    except (ObjectNotFound, StoreError):
        if store.exists(join(store_root, spec_key(held.job_id))):
            return "RUNNING"
        return "UNRECORDED" if time.time() - held.at > UNRECORDED_S else "SUBMITTING"


def _occupied(uri: str, prefix: bool) -> bool:
    if prefix:
        return bool(store.list_uris(uri.rstrip("/") + "/"))
    return store.exists(uri)


def claimable(
    store_root: str, uri: str, job_id: str | None, field: str, *, prefix: bool, overwrite: bool
) -> Claim | None:
    """The output's current claim when ``job_id`` (None: a job not yet submitted) may claim it; else
    :class:`OutputClaimed` naming ``field`` and the job holding it, or that something is there and
    ``overwrite`` is off. Reads only (``shardfold plan`` asks it too)."""
    held = latest(store_root, uri)
    if held is not None and held.job_id != job_id:
        state = _state(store_root, held)
        if state not in ENDED and state != "UNRECORDED":
            msg = (
                f"{field}: {uri} is the output of job {held.job_id}, which has not ended ({state}); wait for "
                f"it or cancel it, then submit again (`shardfold status {held.job_id}` records an end on AWS)"
            )
            raise OutputClaimed(msg, [{"field": field, "error": msg}])
    if not overwrite and _occupied(uri, prefix):
        by = f"job {held.job_id}'s output" if held is not None else "an object no job of this store wrote"
        msg = f'{field}: {uri} already exists ({by}); set "overwrite": true to replace it, or write elsewhere'
        raise OutputClaimed(msg, [{"field": field, "error": msg}])
    return held


def claim(store_root: str, uri: str, job_id: str, field: str, *, prefix: bool, overwrite: bool) -> Claim:
    """Claim output ``uri`` (a full URI; ``prefix``: a folder of objects) for ``job_id``, or refuse as
    :func:`claimable` does."""
    held = claimable(store_root, uri, job_id, field, prefix=prefix, overwrite=overwrite)
    n = (held.n if held is not None else 0) + 1
    mine = Claim(n, job_id, uri)
    record = {"uri": uri, "job_id": job_id, "overwrite": overwrite, "at": time.time()}
    body = json.dumps(record, sort_keys=True).encode()
    if not store.put_if_absent(f"{_folder(store_root, uri)}{n:08d}.json", body):
        winner = latest(store_root, uri)
        who = winner.job_id if winner is not None else "another job"
        msg = f"{field}: {uri} was claimed by job {who} at the same moment; submit again once it has ended"
        raise OutputClaimed(msg, [{"field": field, "error": msg}])
    return mine


def release(store_root: str, job_id: str, uris: list[str] | None = None) -> None:
    """Withdraw ``job_id``'s latest claims on ``uris`` (a submit that did not finish): the previous owner
    holds the output again. Only a claim that is still the latest is withdrawn."""
    for uri in uris or []:
        held = latest(store_root, uri)
        if held is not None and held.job_id == job_id:
            store.delete(f"{_folder(store_root, uri)}{held.n:08d}.json")


def check_held(store_root: str, uri: str, job_id: str, field: str = "output") -> None:
    """Refuse (naming the holder) when another job holds output ``uri``: what a task checks before it
    writes there. An output no job claimed (a job submitted before claims) is not refused, nor is anything
    asked with a plan's stand-in id (not a job id: submit claims once the job has one)."""
    if kind_of(job_id) is None:
        return
    held = latest(store_root, uri)
    if held is not None and held.job_id != job_id:
        msg = f"{field}: {uri} is now the output of job {held.job_id}; this job ({job_id}) no longer holds it"
        raise OutputClaimed(msg, [{"field": field, "error": msg}])
