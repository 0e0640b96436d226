"""Errors a user of the SDK can cause; all are :class:`functions.errors.ShardfoldError` subclasses."""

from __future__ import annotations

from shardfold.functions.errors import ShardfoldError


class JobFailed(ShardfoldError):
    """The job ended FAILED or CANCELLED, so it has no result."""


class JobNotFinished(ShardfoldError):
    """The job is still PENDING or RUNNING; its result is not written yet."""


class StackNotFound(ShardfoldError):
    """The AWS backend needs the stack outputs that ``shardfold deploy`` saves, and they are missing."""


class BackendError(ShardfoldError):
    """An unknown backend name, or a backend that cannot be set up as configured."""


# Failures that re-running the same spec cannot mend: the spec, the inputs it names or the budget must change
SPEC_FAILURES = (
    "SpecError",
    "DatasetError",
    "BadInputError",
    "InvalidModelFile",
    "ModelLoadError",
    "PlanError",
    "TooFewClients",
    "BudgetExceeded",
    "InputChanged",
)


def ended_badly(job_id: str, state: str, error: str | None) -> JobFailed:
    """JobFailed for a job that ended without success: its state, its error and what to do next: resume
    a job whose cause can be mended outside its spec (a missing object uploaded, a grant added, a crash),
    submit again one whose spec or inputs must change (resume re-runs the same spec)."""
    text = f"job {job_id} {state.lower()}: {error or 'no error recorded'}"
    if state == "FAILED":
        if any(name in (error or "") for name in SPEC_FAILURES):
            text += "; fix the spec (or the inputs it names) and submit it again: resume re-runs this spec"
        else:
            text += f"; fix the cause and run `shardfold resume {job_id}`"
    return JobFailed(text)
