"""One way in: the SDK, the CLI, ``shardfold watch`` and the bucket trigger all submit through :func:`submit`.

A submission is: parse the spec (its kind's model; ``./`` URIs resolved against the spec file) → the
policy checks (:func:`check_policy`) → a bounded probe of the inputs and the plan check against the memory
each task will get (the workflow's ``memory_mb`` locally, the deployed sizes on AWS) → write
``jobs/<id>/spec.json`` and what the probe learned (``jobs/<id>/probe.json``) → start the workflow. A rule
added here holds on every path; the tasks check again what they rely on.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardfold.functions import access, claims, collector, kinds, runtime, store
from shardfold.functions.errors import NoCredentials, ShardfoldError, SpecError, StoreError, StoreUnreachable
from shardfold.functions.estimate import PLAN_BUDGET, SUBMIT_BUDGET, Estimate, Limits, ProbeBudget, estimate
from shardfold.functions.jobs import job_key, new_job_id, spec_key
from shardfold.functions.specs import JobSpec, UriField, dump_spec, parse_spec, resolve_relative, uri_fields
from shardfold.functions.store.uri import join, local_path

# (job_id, kind, spec_uri) -> execution id (an ARN on AWS) or None
Starter = Callable[[str, str, str], str | None]
# An inline spec larger than this is refused before it is parsed: the bucket trigger (512 MB) would need
# ~30x its size to parse it. Large requests belong in a manifest the tasks stream.
MAX_SPEC_BYTES = 4 * 1024 * 1024


class SpecTooLarge(SpecError):
    def __init__(self, size: int):
        msg = (
            f"the spec is {size:,} bytes, more than the {MAX_SPEC_BYTES:,} an inline spec may have; put "
            "long lists in a manifest (getbatch: 'manifest', a JSON Lines object of items) and submit a "
            "small spec that names it"
        )
        super().__init__(msg, [{"field": "<spec>", "error": msg}])


@dataclass
class Submitted:
    job_id: str
    kind: str
    spec_uri: str
    execution: str | None
    estimate: Estimate


def probe_key(job_id: str) -> str:
    return job_key(job_id, "probe.json")


def estimate_key(job_id: str) -> str:
    """The estimate the job was admitted with, which ``shardfold report`` sets against what it did."""
    return job_key(job_id, "estimate.json")


def withhold(estimate: dict[str, Any], private: frozenset[str]) -> dict[str, Any]:
    """The estimate without the figures of ``private`` steps (requests, durations, GB-s, and the costs made
    of them), which a kind's sizing derives from its private data's size (dpquery: a proxy of the rows)."""
    if not private:
        return estimate
    out = dict(estimate)
    out["steps"] = [
        {**s, **dict.fromkeys(("gets", "puts", "duration_s", "gb_s", "instance_s"), None)}
        if s["name"] in private
        else s
        for s in estimate["steps"]
    ]
    out["cost_usd"] = {}
    out.update(gets=None, puts=None)
    out["notes"] = [f"figures of steps {sorted(private)} withheld: they depend on private data"]
    return out


_FOUND_CREDENTIALS: set[tuple] = set()


def _credentials_key() -> tuple[str | None, ...]:
    return tuple(
        os.environ.get(v) for v in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SHARED_CREDENTIALS_FILE")
    )


def _look_for_credentials() -> bool:
    """Whether boto3 finds credentials now; a found answer is kept per process and environment (a boto3
    session costs ~10 ms to build, a quarter of a small job's submit), a missing one is looked for again."""
    import boto3

    if boto3.session.Session().get_credentials() is None:
        return False
    _FOUND_CREDENTIALS.add(_credentials_key())
    return True


def check_credentials(spec: JobSpec, store_root: str) -> None:
    """One line instead of a botocore traceback when a job names ``s3://`` objects (or the store is a
    bucket) and boto3 finds no credentials (environment, profile, SSO, container or instance role)."""
    if _credentials_key() in _FOUND_CREDENTIALS:
        return  # found before in this process and environment: no need to walk the spec
    on_s3 = [f.uri for f in uri_fields(spec) if store.is_s3(f.uri)]
    if not on_s3 and not store.is_s3(store_root):
        return
    if not _look_for_credentials():
        what = on_s3[0] if on_s3 else store_root
        raise NoCredentials(
            f"no AWS credentials found, and this job reads or writes S3 ({what}): set AWS_PROFILE, or "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run `aws configure` (a role works on AWS)"
        )


def check_policy(spec: JobSpec, store_root: str, grants: access.Grants | None = None) -> None:
    """Refuse what the submitter may not do (:mod:`functions.access`), naming every field at fault: local
    files on the S3 store, outputs under the store's system prefixes, an output that is one of the inputs.
    The tasks check the same rules again, and those of what submit cannot see (a manifest's items)."""
    errors: list[dict[str, str]] = []
    inputs: list[tuple[str, str]] = []
    outputs: list[tuple[UriField, str]] = []
    checked: set[str] = set()  # folders found not to be links, shared by every input's check
    for f in uri_fields(spec):
        try:
            if f.role == "input":
                inputs.append((f.field, access.input_uri(f.uri, store_root, grants=grants, checked=checked)))
            else:
                outputs.append((f, access.output_uri(f.uri, store_root, grants=grants)))
        except ShardfoldError as exc:
            errors.append({"field": f.field, "error": str(exc)})
    for f, out in outputs:
        try:
            access.not_an_input(out, inputs, prefix=f.prefix)
        except ShardfoldError as exc:
            errors.append({"field": f.field, "error": str(exc)})
    if errors:
        summary = "; ".join(f"{e['field']}: {e['error']}" for e in errors[:10])
        raise SpecError(f"{len(errors)} URI(s) the job may not use: {summary}", errors)


def _outputs(spec: JobSpec, store_root: str, grants: access.Grants | None) -> list[tuple[UriField, str]]:
    """The output fields ``spec`` names, with their full URIs."""
    return [
        (f, access.output_uri(f.uri, store_root, f.field, grants=grants))
        for f in uri_fields(spec)
        if f.role == "output"
    ]


def _forget(spec: JobSpec, store_root: str, job_id: str, grants: access.Grants | None) -> None:
    """Remove what a submit that did not finish wrote of ``job_id``: its folder and its output claims."""
    try:
        store.delete_prefix(join(store_root, job_key(job_id)) + "/")
        with access.policy(spec):
            claims.release(store_root, job_id, [full for _, full in _outputs(spec, store_root, grants)])
    except (OSError, ShardfoldError):
        pass  # the store that failed may fail again: a folder without a spec is no job, a claim goes stale


def claim_outputs(
    spec: JobSpec, store_root: str, job_id: str, grants: access.Grants | None = None
) -> list[tuple[UriField, str]]:
    """Claim every output ``spec`` names for ``job_id`` (:mod:`functions.claims`); the fields and full URIs.
    :class:`~functions.claims.OutputClaimed` names the field and the job holding it."""
    overwrite = bool(getattr(spec, "overwrite", False))
    outputs = _outputs(spec, store_root, grants)
    for f, full in outputs:
        claims.claim(store_root, full, job_id, f.field, prefix=f.prefix, overwrite=overwrite)
    return outputs


# Inputs named as store keys that check_local_twins stats (the rest are found when a task reads them)
MAX_TWIN_CHECKS = 10_000


def check_local_twins(spec: JobSpec, store_root: str, base_uri: str | None) -> None:
    """Refuse an input named as a store key (``data/x``) that the store lacks while a local file of that
    name sits beside the spec (or in the working directory, for a dict): the user meant the file, spelled
    ``./data/x``. One stat per key (the first :data:`MAX_TWIN_CHECKS`), and a store lookup only for a key
    that has a local twin; a spec from the bucket has no local files and is not looked at."""
    if not base_uri or not base_uri.startswith("file://"):
        return
    missing = []
    keys = [f for f in uri_fields(spec) if f.role == "input" and "://" not in f.uri and not f.prefix]
    for f in keys[:MAX_TWIN_CHECKS]:
        twin = resolve_relative("./" + f.uri, base_uri)
        if local_path(twin).is_file() and not store.exists(join(store_root, f.uri)):
            missing.append((f, twin))
    if missing:
        errors = [
            {"field": f.field, "error": f"no object {f.uri!r} in the store; the local file is './{f.uri}'"}
            for f, _ in missing
        ]
        f, twin = missing[0]
        raise SpecError(
            f"{f.field}: {f.uri!r} names a key under the store root ({store_root}), which has no such "
            f"object, while the local file {local_path(twin)} exists: write './{f.uri}' for that file"
            + (f" (and {len(missing) - 1} more like it)" if len(missing) > 1 else ""),
            errors,
        )


def _document_bytes(doc: Any) -> int | None:
    """The size of a spec document as JSON text (None for a parsed model: measured once dumped)."""
    if isinstance(doc, bytes | str):
        return len(doc)
    if isinstance(doc, Mapping):
        return len(json.dumps(doc, default=str).encode())
    return None


def check(
    doc: Any,
    *,
    store_root: str,
    base_uri: str | None = None,
    deployed: Mapping[str, Any] | None = None,
    grants: access.Grants | None = None,
    budget: ProbeBudget = PLAN_BUDGET,
    runs_here: bool = False,
) -> tuple[JobSpec, Estimate]:
    """Everything a submission checks, writing nothing: the spec and its estimate (``shardfold plan``).

    ``runs_here``: this machine runs the job's tasks (the local and moto backends), so it must have the
    extras its kind imports (:class:`~functions.extras.MissingExtra` names the one to install).
    An S3 endpoint that does not answer is :class:`StoreUnreachable`, naming the endpoint."""
    size = _document_bytes(doc)
    if size is not None and size > MAX_SPEC_BYTES:  # refused before the work of parsing and checking it
        raise SpecTooLarge(size)
    spec = parse_spec(doc, base_uri=base_uri)
    if runs_here:
        kinds.find(spec.kind).require_extras(spec)
    with access.policy(spec):
        check_policy(spec, store_root, grants)
        check_credentials(spec, store_root)
        check_local_twins(spec, store_root, base_uri)
        overwrite = bool(getattr(spec, "overwrite", False))
        with store.endpoint_errors():
            for f, full in _outputs(spec, store_root, grants):  # what submit's claim would refuse
                claims.claimable(store_root, full, None, f.field, prefix=f.prefix, overwrite=overwrite)
        limits = Limits(deployed, workflow_file=kinds.find(spec.kind).workflow_file)
        with store.endpoint_errors():
            est = estimate(spec, store_root, budget=budget, limits=limits)
    return spec, est.check()


def submit(
    doc: Any,
    *,
    store_root: str,
    start: Starter,
    base_uri: str | None = None,
    deployed: Mapping[str, Any] | None = None,
    grants: access.Grants | None = None,
    runs_here: bool = False,
) -> Submitted:
    """Check ``doc``, record it under a new job id and start it; :class:`SpecError`/``PlanError`` refuse it
    before anything is written, :class:`StoreUnreachable` says the S3 endpoint did not answer,
    :class:`~functions.extras.MissingExtra` that this machine (``runs_here``) lacks an extra it needs."""
    with collector.relaxed():  # a request of thousands of items allocates a few objects each
        return _submit(doc, store_root, start, base_uri, deployed, grants, runs_here)


def _submit(
    doc: Any,
    store_root: str,
    start: Starter,
    base_uri: str | None,
    deployed: Mapping[str, Any] | None,
    grants: access.Grants | None,
    runs_here: bool,
) -> Submitted:
    spec, est = check(
        doc,
        store_root=store_root,
        base_uri=base_uri,
        deployed=deployed,
        grants=grants,
        budget=SUBMIT_BUDGET,
        runs_here=runs_here,
    )
    text = json.dumps(dump_spec(spec), sort_keys=True).encode()
    if len(text) > MAX_SPEC_BYTES:  # a dict from the SDK is held to the same limit as a file
        raise SpecTooLarge(len(text))
    job_id = new_job_id(spec.kind)
    spec_uri = join(store_root, spec_key(job_id))
    try:
        with store.endpoint_errors(), access.policy(spec):
            outputs = claim_outputs(spec, store_root, job_id, grants)  # before any record of the job
            store.put_json(join(store_root, probe_key(job_id)), est.probe)
            private = kinds.find(spec.kind).private_steps
            admitted = {**withhold(est.to_dict(), private), "submitted_at": time.time()}
            store.put_json(join(store_root, estimate_key(job_id)), admitted, indent=None)
            store.put(spec_uri, text)
            for f, full in outputs:  # still ours now that the job is recorded
                claims.check_held(store_root, full, job_id, f.field)
    except (OSError, StoreError) as exc:  # a full disk, an I/O error: leave no half-recorded job behind
        _forget(spec, store_root, job_id, grants)
        if isinstance(exc, StoreUnreachable):
            raise
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StoreError(f"could not record the job in the store ({why}); nothing was started") from exc
    except ShardfoldError:
        _forget(spec, store_root, job_id, grants)
        raise
    runtime.remember_spec(spec_uri, text, spec)  # the tasks of a job run in this process parse it no more
    execution = start(job_id, spec.kind, spec_uri)
    return Submitted(job_id, spec.kind, spec_uri, execution, est)
