"""Errors a user can cause. Each message says what is wrong and what to fix."""


class ShardfoldError(Exception):
    """Base class for every error a user can cause (bad spec, missing object, over budget...)."""


class SpecError(ShardfoldError):
    """A job spec or event failed validation. ``errors`` lists every problem found, not just the first."""

    def __init__(self, message: str, errors: list[dict] | None = None):
        super().__init__(message)
        self.errors = errors or []


class StoreError(ShardfoldError):
    """A store operation failed for a reason the user can act on."""


class ObjectNotFound(StoreError):
    """The object at a URI does not exist."""


class ObjectExists(StoreError):
    """A write only if absent found the object there: nothing was written."""


class InvalidRange(StoreError):
    """A byte range lies outside the object (HTTP 416) or is malformed. ``reason`` is the message without
    the object's URI that starts it, for a caller that names the object its own way."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason

    @classmethod
    def of(cls, uri: str, reason: str) -> "InvalidRange":
        """The error for ``uri``: its message is ``"<uri>: <reason>"``."""
        return cls(f"{uri}: {reason}", reason)


class NoCredentials(StoreError):
    """The job names ``s3://`` objects (or the store is a bucket) and no AWS credentials are configured."""


class StoreUnreachable(StoreError):
    """The S3 endpoint did not answer (connection refused, unknown host, timeout) while a
    job was being checked or submitted. The message names the endpoint, where its address came from and
    what to check. (Inside a running job the same failure stays a transient error, which tasks retry.)"""


class UnsafeKey(StoreError):
    """A local key tried to leave the store root (``..`` or an absolute path)."""


class AccessDenied(StoreError):
    """The store refused a request for want of a permission (S3's 403), or a task reached for a place its
    kind's rights do not cover (:class:`functions.access.TaskScope`). Not retried: it will not change."""


class BatchItemError(ShardfoldError):
    """An item of a GetBatch request failed and ``continue_on_error`` was off."""

    def __init__(self, index: int, item: str, reason: str):
        super().__init__(f"item {index} ({item}): {reason}")
        self.index = index
        self.item = item
        self.reason = reason


class TooManySoftErrors(ShardfoldError):
    """More items failed than ``max_soft_errors`` allows, so the batch was aborted."""


class PlanError(ShardfoldError):
    """A job cannot be planned as asked, e.g. a task would not fit the configured function memory."""


class TooFewClients(PlanError):
    """A federated round has fewer usable client updates than its ``min_clients``/``min_fraction`` need.
    ``excluded`` lists each client left out (``{"client", "uri", "reason"}``)."""

    def __init__(self, message: str, excluded: list[dict] | None = None):
        super().__init__(message)
        self.excluded = excluded or []


class JobNotFound(ShardfoldError):
    """No job with this id exists on the selected backend."""


class InvalidModelFile(ShardfoldError):
    """A model update cannot be aggregated: not a safetensors file, truncated, unlike the other clients'
    updates, without a usable weight, or holding NaN/Inf. The message names the client and the tensor;
    ``reason`` is what is wrong without the client's label, for a caller that names the file its own way."""

    def __init__(
        self,
        message: str,
        client: int | None = None,
        uri: str | None = None,
        tensor: str | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.client = client
        self.uri = uri
        self.tensor = tensor
        self.reason = message if reason is None else reason


class NonFiniteUpdate(InvalidModelFile):
    """A client's update holds NaN or Inf (set ``allow_nonfinite`` to aggregate it anyway)."""


class NonFiniteAggregate(ShardfoldError):
    """An aggregate came out NaN or Inf although the inputs there were finite (or NaN/Inf inputs were not
    allowed): the job fails rather than write it. ``tensor`` names the tensor, ``element`` the first flat
    element at fault."""

    def __init__(self, message: str, tensor: str | None = None, element: int | None = None):
        super().__init__(message)
        self.tensor = tensor
        self.element = element


class AggregationOverflow(NonFiniteAggregate):
    """A weighted sum left the accumulator's finite range although every input was finite."""


class DatasetError(ShardfoldError):
    """A dataset does not match its schema by a public fact: it cannot be read as its format, it lacks a
    column, or a column's declared type cannot hold the attribute. The message names the file, column or
    type, never a value, a row or a count of rows (the data are private; values outside a domain are not
    errors in ``dpquery``). ``column`` is the first column at fault, ``missing`` the absent ones;
    ``count``/``counts`` are kept for callers and left empty by ``dpquery``."""

    def __init__(
        self,
        message: str,
        column: str | None = None,
        count: int | None = None,
        counts: dict[str, int] | None = None,
        missing: list[str] | None = None,
    ):
        super().__init__(message)
        self.column = column
        self.count = count
        self.counts = counts or {}
        self.missing = missing or []


class BudgetExceeded(ShardfoldError):
    """A job's privacy budget would take its dataset's ledger past the dataset's total; nothing was
    measured. The message states the total, what is already committed and what the job asked for."""


class BadInputError(ShardfoldError):
    """An inference input is unusable: an empty file, an undecodable line, a row missing its field. The
    message names the file and the line (JSONL, 1-based) or row (Parquet, 0-based)."""


class ModelLoadError(ShardfoldError):
    """An inference model cannot be used: the file at ``uri`` does not load as TorchScript or
    ``torch.export``, or its output does not match the declared signature (``(input_ids, attention_mask)``
    int64 ``[B, T]`` -> float ``[B, D]``). The message names the URI and what was expected."""

    def __init__(self, message: str, uri: str | None = None):
        super().__init__(message)
        self.uri = uri


class InputChanged(StoreError):
    """An input object changed after the job was planned: replaced, rewritten or resized since the plan
    recorded its pin (size and ETag on S3; size, mtime and inode locally). The job fails without retries,
    naming ``uri``; nothing read from the new object is used. Submit a new job to use the new content."""

    def __init__(self, message: str, uri: str | None = None):
        super().__init__(message)
        self.uri = uri
