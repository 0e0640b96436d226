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
