"""One way in: the SDK, the CLI, ``shardfold watch`` and the bucket trigger all submit through :func:`submit`.

A submission is: parse the spec (its kind's model; ``./`` URIs resolved against the spec file) → the
policy checks (:func:`check_policy`) → a bounded probe of the inputs and the plan check against the memory
each task will get (the workflow's ``memory_mb`` locally, the deployed sizes on AWS) → write
``jobs/<id>/spec.json`` and what the probe learned (``jobs/<id>/probe.json``) → start the workflow. A rule
added here holds on every path; the tasks check again what they rely on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from functions import kinds, store
from functions.errors import SpecError
from functions.estimate import PLAN_BUDGET, SUBMIT_BUDGET, Estimate, Limits, ProbeBudget, estimate
from functions.jobs import job_key, new_job_id, spec_key
from functions.specs import JobSpec, dump_spec, parse_spec, uri_fields
from functions.store.uri import is_s3, join

# (job_id, kind, spec_uri) -> execution id (an ARN on AWS) or None
Starter = Callable[[str, str, str], str | None]


@dataclass
class Submitted:
    job_id: str
    kind: str
    spec_uri: str
    execution: str | None
    estimate: Estimate


def probe_key(job_id: str) -> str:
    return job_key(job_id, "probe.json")


def check_policy(spec: JobSpec, store_root: str) -> None:
    """Refuse what the submitter may not do, naming every field at fault.

    On the S3 store a spec may not name local files: the functions would read their own filesystem (its
    ``/proc``, its credentials), not the submitter's.
    """
    if is_s3(store_root):
        local = [f for f in uri_fields(spec) if f.uri.startswith("file://")]
        if local:
            errors = [
                {"field": f.field, "error": f"{f.uri} is a local file; the S3 store reads only s3:// objects"}
                for f in local
            ]
            raise SpecError(
                f"{len(local)} URI(s) name local files, which jobs on the S3 store cannot read "
                f"({errors[0]['field']}: {local[0].uri}); upload them to s3:// or run with the local backend",
                errors,
            )


def check(
    doc: Any,
    *,
    store_root: str,
    base_uri: str | None = None,
    deployed: Mapping[str, Any] | None = None,
    budget: ProbeBudget = PLAN_BUDGET,
) -> tuple[JobSpec, Estimate]:
    """Everything a submission checks, writing nothing: the spec and its estimate (``shardfold plan``).

    An S3 endpoint that does not answer is :class:`StoreUnreachable`, naming the endpoint."""
    spec = parse_spec(doc, base_uri=base_uri)
    check_policy(spec, store_root)
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
) -> Submitted:
    """Check ``doc``, record it under a new job id and start it; :class:`SpecError`/``PlanError`` refuse it
    before anything is written, :class:`StoreUnreachable` says the S3 endpoint did not answer."""
    spec, est = check(doc, store_root=store_root, base_uri=base_uri, deployed=deployed, budget=SUBMIT_BUDGET)
    job_id = new_job_id(spec.kind)
    spec_uri = join(store_root, spec_key(job_id))
    with store.endpoint_errors():
        store.put_json(join(store_root, probe_key(job_id)), est.probe)
        store.put_json(spec_uri, dump_spec(spec))
    execution = start(job_id, spec.kind, spec_uri)
    return Submitted(job_id, spec.kind, spec_uri, execution, est)
