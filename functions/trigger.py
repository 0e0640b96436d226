"""The bucket trigger: a spec dropped at ``jobs/<name>.json`` starts a job.

S3 sends "Object Created" to EventBridge, which invokes :func:`handler`. The pure core :func:`dispatch`
reads the spec and hands it to the one submit path (:func:`functions.submit.submit`: validation, policy,
the plan check against the deployed sizes, ``jobs/<id>/spec.json``), which starts the workflow through an
injected ``start(job_id, kind, spec_uri)`` callable; then it writes a report beside the spec:
``jobs/<name>.status.json`` on success or ``jobs/<name>.error.json`` listing every problem. ``shardfold
watch`` runs the same core on a local directory with the local executor as the starter.

Our own writes (reports, ``jobs/<id>/...``) land in the same bucket and fire events too; they are ignored by
key shape, so the trigger never loops.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote_plus

from aws_lambda_powertools.utilities.parser import parse
from aws_lambda_powertools.utilities.parser.models import S3EventNotificationEventBridgeModel
from pydantic import ValidationError

from shardfold.functions import access, credentials, store
from shardfold.functions.errors import ObjectNotFound, ShardfoldError, SpecError, StoreError, StoreUnreachable
from shardfold.functions.jobs import status_key
from shardfold.functions.log import logger
from shardfold.functions.specs import load_document
from shardfold.functions.store.uri import is_s3, join, split_s3, store_root
from shardfold.functions.submit import MAX_SPEC_BYTES, SpecTooLarge, Starter, Submitted, submit

# The deployed sizes (the stack's ``sizes`` output), which the Pulumi program gives the dispatch function.
SIZES_ENV = "SHARDFOLD_SIZES"

REPORT_SUFFIXES = (".status.json", ".error.json")
# A claim older than this belongs to a delivery that died (the dispatch function's timeout is 60 s).
CLAIM_TTL_S = 120.0
_JOB_SPEC_KEY = re.compile(r"^jobs/[^/]+\.json$")


def report_uris(spec_uri: str) -> tuple[str, str]:
    """``(status_uri, error_uri)`` beside the spec: ``jobs/<name>.json`` -> ``jobs/<name>.status.json``..."""
    stem = spec_uri[: -len(".json")]
    return f"{stem}.status.json", f"{stem}.error.json"


def _relative_key(uri: str, root: str) -> str | None:
    """``uri`` relative to ``root``, or None when it lies outside it."""
    root = root.rstrip("/") + "/"
    return uri[len(root) :] if uri.startswith(root) else None


def ignore_reason(spec_uri: str, root: str | None = None) -> str | None:
    """Why this object is not a job spec to dispatch, or None if it is one.

    Only ``*.json`` objects that are direct children of ``jobs/`` under the store root (the bucket root on
    S3) are specs; our own reports and everything under ``jobs/<id>/`` are not. A file outside the store root
    (a directory given to ``shardfold watch``) is judged by its name only.
    """
    name = spec_uri.rsplit("/", 1)[-1]
    if name.endswith(REPORT_SUFFIXES):
        return f"{name} is a dispatch report, not a spec"
    if not name.endswith(".json") or name == ".json":
        return f"{name} is not a .json job spec"
    if is_s3(spec_uri):
        bucket, _ = split_s3(spec_uri)
        root = f"s3://{bucket}"
    key = _relative_key(spec_uri, root or store_root())
    if key is not None and not _JOB_SPEC_KEY.match(key):
        return f"{key} is not a direct child of jobs/"
    return None


def _root_for(spec_uri: str) -> str:
    """Where the job's own objects go: the bucket root on S3, the local store root otherwise."""
    if is_s3(spec_uri):
        bucket, _ = split_s3(spec_uri)
        return f"s3://{bucket}"
    return store_root()


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def dispatch(
    spec_uri: str,
    start: Starter,
    *,
    root: str | None = None,
    deployed: Mapping[str, Any] | None = None,
    grants: access.Grants | None = None,
    runs_here: bool = False,
    delivery: str | None = None,
) -> dict[str, Any]:
    """Validate the spec at ``spec_uri`` and start its job; return the report written beside it.
    ``runs_here`` as for :func:`functions.submit.submit` (``watch``: the local backend).

    ``delivery`` names this upload of the spec (the S3 event's sequencer; ``watch``: the file's mtime and
    size; default: its bytes). EventBridge delivers each upload at least once: a repeated delivery gets the
    report of the first, and starts nothing; a new upload, even of the same bytes, is a new job.

    Returns ``{"ignored": reason}`` for objects that are not job specs (nothing is written then). A spec
    that fails validation (or is not JSON) yields the error report ``{"spec_uri", "error", "errors": [...]}``
    naming every bad field; nothing is started. Errors outside the user's control (store or AWS failures)
    propagate so the caller (Lambda's async retry, ``watch``) can retry.
    """
    reason = ignore_reason(spec_uri, root)
    if reason:
        logger.info("ignored", extra={"spec_uri": spec_uri, "reason": reason})
        return {"ignored": reason}
    root = root or _root_for(spec_uri)
    status_uri, error_uri = report_uris(spec_uri)

    try:
        size = store.size(spec_uri)
        if size > MAX_SPEC_BYTES:  # refused unread: the function's memory is no place for it
            return _report_error(spec_uri, error_uri, SpecTooLarge(size), f"size:{size}")
        raw = store.get(spec_uri)
    except ObjectNotFound as exc:
        # deleted between the event and now: nothing to report beside, and nothing to start
        logger.warning("spec vanished", extra={"spec_uri": spec_uri})
        return {"ignored": str(exc)}
    digest = hashlib.sha256(raw).hexdigest()

    # The upload's claim (put-if-absent): of two deliveries at once the first dispatches and the other reports
    # that; once settled it holds the report, which a later delivery of the same upload gets back. A claim
    # left by a delivery that died before settling expires, so a retry of the event still starts the job.
    claim = claim_uri(spec_uri, delivery or f"sha256:{digest}")
    held = _claim(claim, spec_uri)
    if held is not None:
        return held

    try:
        job = submit(
            _dropped(load_document(raw)),
            store_root=root,
            start=start,
            base_uri=spec_uri,
            deployed=deployed,
            grants=grants,
            runs_here=runs_here,
        )
    except StoreUnreachable:  # not the spec's fault: raise, so the event is retried (Lambda's async retry)
        store.delete(claim)
        raise
    except ShardfoldError as exc:
        report = _report_error(spec_uri, error_uri, exc, digest)
        _settle(claim, report)
        return report

    report = _report_started(spec_uri, job, digest, status_uri, error_uri)
    _settle(claim, report)
    logger.info("dispatched", extra={"job_id": job.job_id, "kind": job.kind, "spec_uri": spec_uri})
    return report


def _report_started(spec_uri: str, job: Submitted, digest: str, status_uri: str, error_uri: str) -> dict:
    """Write the report of a started job beside its spec (``.status.json``), replacing an old complaint."""
    report = {
        "job_id": job.job_id,
        "kind": job.kind,
        "state": "RUNNING",
        "execution": job.execution,
        "spec_uri": job.spec_uri,
        "submitted_spec": spec_uri,
        "spec_sha256": digest,
        "dispatched_at": _now(),
    }
    store.put_json(status_uri, report)
    if store.exists(error_uri):  # a fixed spec replaces the old complaint
        store.delete(error_uri)
    return report


def _dropped(doc: dict[str, Any]) -> dict[str, Any]:
    """A dropped spec names only the store's objects, whatever it says (:mod:`functions.access`); a
    ``local_files`` that is no boolean is left for validation to refuse, naming it."""
    return {**doc, "local_files": False} if isinstance(doc.get("local_files", False), bool) else doc


def claim_uri(spec_uri: str, delivery: str) -> str:
    """The claim of one upload (``delivery``) of the spec at ``spec_uri``, beside it (never a ``.json``)."""
    return f"{spec_uri[: -len('.json')]}.{hashlib.sha256(delivery.encode()).hexdigest()[:16]}.claim"


def _claim(claim_uri: str, spec_uri: str) -> dict[str, Any] | None:
    """Claim an upload for this delivery (put-if-absent): None when this delivery dispatches it, else what
    to answer: the settled report of an earlier delivery, or that another is dispatching it now. An
    unsettled claim older than :data:`CLAIM_TTL_S` (its delivery died) is taken over once."""
    body = json.dumps({"claimed_at": time.time()}).encode()
    if store.put_if_absent(claim_uri, body):
        return None
    try:
        held = store.get_json(claim_uri)
        if isinstance(held.get("report"), dict):
            logger.info(
                "duplicate delivery", extra={"spec_uri": spec_uri, "job_id": held["report"].get("job_id")}
            )
            return held["report"]
        age = time.time() - float(held["claimed_at"])
    except (ObjectNotFound, StoreError, AttributeError, KeyError, TypeError, ValueError):
        age = CLAIM_TTL_S
    if age < CLAIM_TTL_S:
        return {"duplicate": f"{spec_uri} is being dispatched by another delivery"}
    store.delete(claim_uri)
    if store.put_if_absent(claim_uri, body):
        return None
    return {"duplicate": f"{spec_uri} is being dispatched by another delivery"}


def _settle(claim_uri: str, report: dict[str, Any]) -> None:
    """Record the upload's outcome in its claim, for repeated deliveries of the same upload."""
    store.put_json(claim_uri, {"claimed_at": time.time(), "report": report})


def _report_error(spec_uri: str, error_uri: str, exc: ShardfoldError, digest: str) -> dict[str, Any]:
    errors = getattr(exc, "errors", None) or [{"field": "<spec>", "error": str(exc)}]
    report = {
        "spec_uri": spec_uri,
        "error": str(exc),
        "errors": errors,
        "spec_sha256": digest,
        "reported_at": _now(),
    }
    store.put_json(error_uri, report)
    logger.warning("spec rejected", extra={"spec_uri": spec_uri, "errors": errors})
    return report


# --- Lambda side ------------------------------------------------------------------------------------------

_sfn_clients: dict[tuple, Any] = credentials.cache()


def _sfn() -> Any:
    # One client per warm container, created on first use so importing this module stays cheap; keyed by
    # process and endpoint settings (as functions.store.s3 does) so a fork or a test's endpoint gets its own.
    env = os.environ
    key = (
        os.getpid(),
        env.get("AWS_ENDPOINT_URL_STEPFUNCTIONS") or env.get("AWS_ENDPOINT_URL"),
        env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        credentials.current(),
    )
    client = _sfn_clients.get(key)
    if client is None:
        client = _sfn_clients[key] = credentials.session().client("stepfunctions")
    return client


def state_machine_arns() -> dict[str, str]:
    """``{kind: state machine ARN}`` from ``SHARDFOLD_STATE_MACHINES`` (set by the Pulumi program)."""
    raw = os.environ.get("SHARDFOLD_STATE_MACHINES", "")
    try:
        arns = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ShardfoldError(f"SHARDFOLD_STATE_MACHINES is not JSON ({exc}); expected {{kind: arn}}") from exc
    if not isinstance(arns, dict):
        raise ShardfoldError("SHARDFOLD_STATE_MACHINES must be a JSON object {kind: state machine arn}")
    return arns


def sfn_starter(arns: dict[str, str] | None = None) -> Starter:
    """A starter that runs the kind's deployed state machine, with the job id as the execution name.

    Also writes ``jobs/<id>/status.json`` with the execution ARN, the same record the AWS executor keeps,
    so ``Client(backend="aws").job(id)`` finds jobs that were started from the bucket.
    """

    def start(job_id: str, kind: str, spec_uri: str) -> str:
        table = arns if arns is not None else state_machine_arns()
        if kind not in table:
            raise ShardfoldError(f"job kind {kind!r} is not deployed here (deployed: {sorted(table)})")
        bucket, _ = split_s3(spec_uri)
        root = f"s3://{bucket}"
        payload = {"job_id": job_id, "spec_uri": spec_uri, "store_root": root}
        resp = _sfn().start_execution(stateMachineArn=table[kind], name=job_id, input=json.dumps(payload))
        arn = resp["executionArn"]
        # the record shape of orchestrator.status.JobStatus, so the AWS executor reads it as its own
        store.put_json(
            join(root, status_key(job_id)),
            {
                "job_id": job_id,
                "kind": kind,
                "backend": "aws",
                "state": "RUNNING",
                "steps": {},
                "error": None,
                "started_at": _now(),
                "ended_at": None,
                "spec_uri": spec_uri,
                "execution_arn": arn,
            },
        )
        return arn

    return start


def spec_uri_from_event(event: dict[str, Any]) -> str:
    """The ``s3://bucket/key`` of an EventBridge "Object Created" event (keys arrive URL-encoded)."""
    try:
        parsed = parse(event=event, model=S3EventNotificationEventBridgeModel)
    except ValidationError as exc:
        errors = [{"field": ".".join(map(str, e["loc"])), "error": e["msg"]} for e in exc.errors()]
        raise SpecError("event is not an S3 Object Created event from EventBridge", errors) from exc
    return f"s3://{parsed.detail.bucket.name}/{unquote_plus(parsed.detail.object.key)}"


def delivery_from_event(event: dict[str, Any]) -> str | None:
    """The upload an "Object Created" event is about: its object's sequencer (S3 orders the PUTs of a key by
    it; every delivery of one event carries the same), with the ETag."""
    obj = (event.get("detail") or {}).get("object") or {}
    sequencer = obj.get("sequencer")
    return f"{sequencer}:{obj.get('etag', '')}" if isinstance(sequencer, str) and sequencer else None


def handler(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Lambda entry point for EventBridge "Object Created" events on the job bucket."""
    if event.get("detail-type") != "Object Created":
        return {"ignored": f"detail-type {event.get('detail-type')!r} is not 'Object Created'"}
    spec_uri = spec_uri_from_event(event)
    return dispatch(spec_uri, sfn_starter(), deployed=deployed_sizes(), delivery=delivery_from_event(event))


def deployed_sizes() -> dict[str, Any] | None:
    """The deployed sizes from ``SHARDFOLD_SIZES`` (None when unset: the workflow's own sizes)."""
    raw = os.environ.get(SIZES_ENV, "")
    try:
        sizes = json.loads(raw) if raw else None
    except json.JSONDecodeError as exc:
        raise ShardfoldError(f"{SIZES_ENV} is not JSON ({exc}); expected the stack's sizes output") from exc
    return sizes
